"""The load test against a small fake OpenAI-compatible server, started in-process."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

_PATH = Path(__file__).resolve().parents[1] / "bench" / "loadtest.py"
_SPEC = importlib.util.spec_from_file_location("segserve_bench_loadtest", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
loadtest = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = loadtest  # dataclasses look their module up while being built
_SPEC.loader.exec_module(loadtest)

REFUSAL = "needs 5000 bytes, budget 4000"


def _chunk(delta: dict[str, str], finish: str | None = None) -> str:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "default",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def build_fake_app(peak: int = 150_000_000, reject: bool = True, slow: bool = False) -> Starlette:
    """Streams 4 content chunks + usage; 507 when (user + turn) % 3 == 0 and `reject`."""
    seen: list[dict[str, Any]] = []

    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get("x-session-id")})
        match = re.match(r"User (\d+), turn (\d+):", body["messages"][-1]["content"])
        assert match is not None
        user, turn = int(match.group(1)), int(match.group(2))
        if reject and (user + turn) % 3 == 0:
            error = {"message": REFUSAL, "type": "insufficient_memory", "param": None,
                     "code": "insufficient_memory"}
            return JSONResponse({"error": error}, status_code=507)

        async def events() -> AsyncIterator[str]:
            yield _chunk({"role": "assistant"})
            for i in range(4):
                yield _chunk({"content": f"u{user}t{turn}w{i} "})
            while slow:  # never finishes; the client's deadline has to end it
                await asyncio.sleep(0.05)
                yield ": keep-alive\n\n"
            yield _chunk({}, finish="stop")
            usage = {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104,
                     "prompt_tokens_details": {"cached_tokens": 25}}
            yield f"data: {json.dumps({'id': 'c1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            "# HELP segserve_memory_bytes Memory by kind\n# TYPE segserve_memory_bytes gauge\n"
            f'segserve_memory_bytes{{kind="current"}} 5.0\nsegserve_memory_bytes{{kind="peak"}} '
            f"{float(peak)!r}\n"
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/metrics", metrics), Route("/health", health)])
    app.state.seen = seen
    return app


@contextlib.contextmanager
def serve(app: Starlette) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = loadtest.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


ARGS = ["--users", "3", "--turns", "3", "--words-per-turn", "5", "--max-tokens", "8"]


def test_report_against_fake_server(capsys: pytest.CaptureFixture[str]) -> None:
    app = build_fake_app()
    with serve(app) as url:
        rc, out, err = run_main(["--url", url + "/v1", *ARGS, "--max-seconds", "15", "--json"],
                                capsys)
    assert rc == 0
    report = json.loads(out)  # --json: stdout is the JSON and nothing else
    # 507 for (user, turn) in (0, 0), (1, 2), (2, 1)
    assert report["requests"] == 9 and report["completed"] == 6
    assert report["status_counts"] == {"200": 6, "507": 3}
    assert report["failures"] == {"507 insufficient_memory": 3}
    assert report["insufficient_memory_507"] == {
        "count": 3, "reasons": [{"code": "insufficient_memory", "message": REFUSAL, "count": 3}]
    }
    assert (report["completion_tokens"], report["prompt_tokens"]) == (24, 600)
    assert report["cached_tokens"] == 150 and report["cached_token_ratio"] == 0.25
    assert report["server_peak_memory_bytes"] == 150_000_000
    assert report["tokens_per_s"] == pytest.approx(24 / report["wall_s"])
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p95"]
    assert report["config"]["users"] == 3 and report["config"]["max_tokens"] == 8
    assert "9/9" in err


def test_clients_resend_history_without_session_id(capsys: pytest.CaptureFixture[str]) -> None:
    app = build_fake_app()
    with serve(app) as url:
        assert run_main(["--url", url, *ARGS, "--json"], capsys)[0] == 0
    lengths: dict[tuple[int, int], int] = {}
    for seen in app.state.seen:
        body = seen["body"]
        assert seen["session"] is None
        assert body["model"] == "default" and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 8
        user, turn = map(int, re.findall(r"\d+", body["messages"][-1]["content"])[:2])
        assert body["messages"][-1]["content"] == loadtest.user_text(0, user, turn, 5)
        lengths[(user, turn)] = len(body["messages"])
        if (user, turn) == (1, 2):
            assert body["messages"][1] == {"role": "assistant",
                                           "content": "u1t0w0 u1t0w1 u1t0w2 u1t0w3 "}
    # failed turns drop out of the history: user 0 failed turn 0, user 2 failed turn 1
    assert lengths == {(0, 0): 1, (0, 1): 1, (0, 2): 3, (1, 0): 1, (1, 1): 3, (1, 2): 5,
                       (2, 0): 1, (2, 1): 3, (2, 2): 3}


def test_max_seconds_is_a_hard_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(build_fake_app(reject=False, slow=True)) as url:
        t0 = time.monotonic()
        rc, out, _ = run_main(["--url", url, *ARGS, "--max-seconds", "0.5", "--json"], capsys)
        elapsed = time.monotonic() - t0
    report = json.loads(out)
    assert rc == 0 and elapsed < 5
    assert report["requests"] == 3 and report["completed"] == 0  # one cut turn per user
    assert report["failures"] == {"200 client_deadline": 3}


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000",
            "http://[::2]:80", "ftp://127.0.0.1/", "http://192.168.1.2:8000/v1"],
)
def test_non_loopback_urls_are_refused(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(["--url", url, "--max-seconds", "1"], capsys)
    assert rc == 2 and out == ""
    assert url in err


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.5:9/v1/", "http://127.0.0.5:9"),
        ("http://localhost:8000", "http://localhost:8000"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
    ],
)
def test_loopback_urls_are_accepted(url: str, base: str) -> None:
    assert loadtest.check_loopback_url(url) == base


def test_parse_metric() -> None:
    text = (
        "# HELP segserve_memory_bytes bytes\n# TYPE segserve_memory_bytes gauge\n"
        'segserve_memory_bytes_total{kind="peak"} 1\n'
        'segserve_memory_bytes{kind="current"} 2\n'
        'segserve_memory_bytes{device="0",kind="peak",note="a \\"q\\""} 3.5e+09 1700000000\n'
    )
    parse = loadtest.parse_metric
    assert parse(text, "segserve_memory_bytes", {"kind": "peak"}) == 3.5e9
    assert parse(text, "segserve_memory_bytes", {"kind": "weights"}) is None
    assert parse("", "segserve_memory_bytes", {"kind": "peak"}) is None
    assert parse("up 1\n", "up", {}) == 1.0


def test_summarize_percentiles_and_ratios() -> None:
    R = loadtest.RequestResult
    ok = [R(0, i, 0.0, 200, ttft_s=i / 10, tokens=2, prompt_tokens=10, cached_tokens=i)
          for i in range(1, 11)]
    bad = [R(1, 0, 0.0, 507, error_code="insufficient_memory", error_message="m"),
           R(1, 1, 0.0, 0, error_code="ConnectError")]
    cfg = loadtest.LoadConfig("http://127.0.0.1:1", 2, 11, 8, 5, 10.0)
    report = loadtest.summarize(ok + bad, 4.0, None, cfg)
    assert report["ttft_s"] == {"p50": 0.5, "p95": 1.0}  # nearest rank
    assert report["tokens_per_s"] == 5.0
    assert report["cached_token_ratio"] == 55 / 100
    assert report["status_counts"] == {"0": 1, "200": 10, "507": 1}
    assert report["failures"] == {"0 ConnectError": 1, "507 insufficient_memory": 1}
    assert report["server_peak_memory_bytes"] is None


_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import uvicorn
from test_loadtest import build_fake_app
port = int(sys.argv[sys.argv.index("--port") + 1])
seg = os.environ["SEGSERVE_SEGMENTED_KV"] == "1"
bank = int(os.environ["SEGSERVE_BANK_MAX_BYTES"])
uvicorn.run(build_fake_app(peak=bank if seg else 2 * bank, reject=not seg),
            host="127.0.0.1", port=port, log_level="warning")
"""


def test_compare_starts_both_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent)))
    plot = tmp_path / "ttft.png"
    cmd = f"{sys.executable} {script}"
    rc, out, _ = run_main(["--compare", "--server-cmd", cmd, "--bank-max-bytes", "1000",
                           *ARGS, "--max-seconds", "15", "--startup-timeout", "30",
                           "--plot", str(plot)], capsys)
    assert rc == 0
    table, _, body = out.partition("\n{")
    assert table.split()[:4] == ["metric", "segmented", "stock", "ratio"]
    result = json.loads("{" + body)
    seg, stock = result["segmented"], result["stock"]
    assert seg["status_counts"] == {"200": 9} and stock["status_counts"] == {"200": 6, "507": 3}
    assert (seg["server_peak_memory_bytes"], stock["server_peak_memory_bytes"]) == (1000, 2000)
    assert result["ratios"]["peak bytes"] == 0.5
    assert result["ratios"]["HTTP 507"] == 0.0
    assert result["ratios"]["requests"] == 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_reports_a_server_that_dies(capsys: pytest.CaptureFixture[str]) -> None:
    cmd = f"{sys.executable} -c 'import sys; print(\"boom\"); sys.exit(3)'"
    rc, out, err = run_main(["--compare", "--server-cmd", cmd, "--startup-timeout", "10"],
                            capsys)
    assert rc == 2 and out == ""
    assert "exited with 3" in err and "boom" in err


def test_server_sample_reads_guard_and_evictions() -> None:
    text = (
        'segserve_memory_bytes{kind="peak"} 123.0\n'
        'segserve_guard_interventions_total{reason="shed_bank"} 2.0\n'
        'segserve_bank_evictions_total{reason="ram_cap"} 5.0\n'
    )
    s = loadtest.server_sample(text)
    assert s.peak_bytes == 123
    assert s.guard_interventions == {"shed_bank": 2.0}
    assert s.bank_evictions == {"ram_cap": 5.0}
