"""`segserve loadtest` (segserve.server.loadtest): against a small fake OpenAI-compatible server
started in-process (the report, the workload, error paths, open loop, outputs) and against
real segserve processes on a tiny random model (segmented and stock, `--compare`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import subprocess
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

from segserve.server import loadtest
from segserve.server.loadtest.cli import WORKLOAD_FLAGS, add_workload_flags, workload_argv
from segserve.server.loadtest.client import RequestRecord, base_url
from segserve.server.loadtest.prom import parse_metric, server_sample
from segserve.server.loadtest.report import format_table, percentile, summarize
from segserve.server.loadtest.runner import LoadConfig, RunResult
from segserve.server.loadtest.workload import user_text

REPO = Path(__file__).resolve().parents[1]
REFUSAL = "needs 5000 bytes, budget 4000"
MODEL = "fake-model"


def _chunk(delta: dict[str, str], finish: str | None = None) -> str:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def _error(status: int, code: str, message: str) -> JSONResponse:
    error = {"message": message, "type": code, "param": None, "code": code}
    return JSONResponse({"error": error}, status_code=status)


def build_fake_app(
    peak: int = 150_000_000, reject: bool = True, slow: bool = False, *,
    strict_model: bool = False, status: int | None = None, delay: float = 0.0,
    list_models: bool = True, metrics: bool = True,
) -> Starlette:
    """Streams 4 content chunks + usage; 507 when (user + turn) % 3 == 0 and `reject`;
    every chat answers `status` instead when given; `strict_model`: only MODEL is served
    (404 for "default", as most servers do); `delay`: seconds before the first chunk."""
    seen: list[dict[str, Any]] = []
    scrapes: list[str | None] = []

    async def chat(request: Request) -> Response:
        body = await request.json()
        seen.append({"body": body, "session": request.headers.get("x-session-id"),
                     "auth": request.headers.get("authorization"), "t": time.monotonic()})
        if strict_model and body["model"] != MODEL:
            return _error(404, "model_not_found", f"model {body['model']!r} not found")
        if status == 429:
            return JSONResponse({"error": {"message": "slow down", "type": "rate_limit"}},
                                status_code=429, headers={"Retry-After": "1"})
        if status is not None:
            return PlainTextResponse("Internal Server Error", status_code=status)
        match = re.match(r"User (\d+), turn (\d+):", body["messages"][-1]["content"])
        assert match is not None
        user, turn = int(match.group(1)), int(match.group(2))
        if reject and (user + turn) % 3 == 0:
            return _error(507, "insufficient_memory", REFUSAL)

        async def events() -> AsyncIterator[str]:
            if delay:
                await asyncio.sleep(delay)
            yield _chunk({"role": "assistant"})
            for i in range(4):
                yield _chunk({"content": f"u{user}t{turn}w{i} "})
                await asyncio.sleep(0.002)
            while slow:  # never finishes; the client's deadline has to end it
                await asyncio.sleep(0.05)
                yield ": keep-alive\n\n"
            yield _chunk({}, finish="length")
            usage = {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104,
                     "prompt_tokens_details": {"cached_tokens": 25}}
            yield f"data: {json.dumps({'id': 'c1', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        if not list_models:
            return PlainTextResponse("Not Found", status_code=404)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics_route(request: Request) -> Response:
        scrapes.append(request.headers.get("authorization"))
        if not metrics:
            return PlainTextResponse("Not Found", status_code=404)
        return PlainTextResponse(
            "# HELP segserve_memory_bytes Memory by kind\n# TYPE segserve_memory_bytes gauge\n"
            f'segserve_memory_bytes{{kind="active"}} 5.0e8\nsegserve_memory_bytes{{kind="peak"}} '
            f"{float(peak)!r}\n"
        )

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/v1/models", models), Route("/metrics", metrics_route),
                            Route("/health", health)])
    app.state.seen = seen
    app.state.scrapes = scrapes
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


def _turn_of(body: dict[str, Any]) -> tuple[int, int]:
    user, turn = map(int, re.findall(r"\d+", body["messages"][-1]["content"])[:2])
    return user, turn


def test_report_against_fake_server(capsys: pytest.CaptureFixture[str]) -> None:
    app = build_fake_app()
    with serve(app) as url:
        rc, out, err = run_main(["--url", url + "/v1", *ARGS, "--max-seconds", "15", "--json"],
                                capsys)
    assert rc == 0
    report = json.loads(out)  # --json: stdout is the JSON and nothing else
    assert report["model"] == MODEL and report["mode"] == "closed_loop"
    # 507 for (user, turn) in (0, 0), (1, 2), (2, 1)
    assert report["requests"] == 9 and report["completed"] == 6
    assert report["status_counts"] == {"200": 6, "507": 3}
    assert report["errors_by_status"] == {"507": 3}
    assert report["failures"] == {"507 insufficient_memory": 3}
    assert report["insufficient_memory_507"] == {
        "count": 3, "reasons": [{"code": "insufficient_memory", "message": REFUSAL, "count": 3}]
    }
    assert (report["completion_tokens"], report["prompt_tokens"]) == (24, 600)
    assert report["cached_tokens"] == 150 and report["cached_token_ratio"] == 0.25
    assert report["server_peak_memory_bytes"] == 150_000_000
    assert report["tokens_per_s"] == pytest.approx(24 / report["wall_s"])
    for key in ("ttft_s", "itl_s", "e2e_s", "tpot_s", "output_tokens_per_s"):
        dist = report[key]
        assert set(dist) == {"p50", "p90", "p95", "p99", "mean", "n"}
        assert 0 < dist["p50"] <= dist["p90"] <= dist["p95"] <= dist["p99"]
    assert report["itl_s"]["n"] == 18  # 3 gaps between the 4 content chunks of 6 answers
    assert report["ttft_s"]["p99"] <= report["e2e_s"]["p99"]
    assert report["config"]["users"] == 3 and report["config"]["max_tokens"] == 8
    assert "api_key" not in json.dumps(report["config"])
    assert "9/9" in err


def test_clients_resend_history_without_session_id(capsys: pytest.CaptureFixture[str]) -> None:
    app = build_fake_app()
    with serve(app) as url:
        assert run_main(["--url", url, *ARGS, "--json"], capsys)[0] == 0
    lengths: dict[tuple[int, int], int] = {}
    for seen in app.state.seen:
        body = seen["body"]
        assert seen["session"] is None and seen["auth"] is None
        assert body["model"] == MODEL and body["temperature"] == 0
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 8
        user, turn = _turn_of(body)
        assert body["messages"][-1]["content"] == user_text(0, user, turn, 5)
        lengths[(user, turn)] = len(body["messages"])
        if (user, turn) == (1, 2):
            assert body["messages"][1] == {"role": "assistant",
                                           "content": "u1t0w0 u1t0w1 u1t0w2 u1t0w3 "}
    # failed turns drop out of the history: user 0 failed turn 0, user 2 failed turn 1
    assert lengths == {(0, 0): 1, (0, 1): 1, (0, 2): 3, (1, 0): 1, (1, 1): 3, (1, 2): 5,
                       (2, 0): 1, (2, 1): 3, (2, 2): 3}


def test_session_mode_sends_one_session_id_per_conversation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    app = build_fake_app(reject=False)
    with serve(app) as url:
        rc, out, _ = run_main(["--url", url, *ARGS, "--conversation", "session", "--json"],
                              capsys)
    assert rc == 0 and json.loads(out)["completed"] == 9
    ids: dict[int, set[str]] = {}
    for seen in app.state.seen:
        user, turn = _turn_of(seen["body"])
        assert len(seen["body"]["messages"]) == 2 * turn + 1  # history is still resent
        ids.setdefault(user, set()).add(seen["session"])
    assert all(len(s) == 1 and None not in s for s in ids.values())
    assert len(set().union(*ids.values())) == 3


def test_max_seconds_is_a_hard_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(build_fake_app(reject=False, slow=True)) as url:
        t0 = time.monotonic()
        rc, out, _ = run_main(["--url", url, *ARGS, "--max-seconds", "0.5", "--json"], capsys)
        elapsed = time.monotonic() - t0
    report = json.loads(out)
    assert rc == 0 and elapsed < 5
    assert report["requests"] == 3 and report["completed"] == 0  # one cut turn per user
    assert report["failures"] == {"200 client_deadline": 3}


def test_model_comes_from_v1_models_and_default_is_rejected_elsewhere(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Most servers reject model "default": the tool asks /v1/models; an explicit
    --model default is sent as given and every refusal is counted by status."""
    app = build_fake_app(reject=False, strict_model=True)
    with serve(app) as url:
        rc, out, _ = run_main(["--url", url, *ARGS, "--json"], capsys)
        assert rc == 0
        report = json.loads(out)
        assert report["model"] == MODEL and report["completed"] == 9
        rc, out, _ = run_main(["--url", url, *ARGS, "--model", "default", "--json"], capsys)
    report = json.loads(out)
    assert rc == 0 and report["completed"] == 0
    assert report["errors_by_status"] == {"404": 9}
    assert report["failures"] == {"404 model_not_found": 9}
    assert report["ttft_s"]["p50"] is None


def test_no_model_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(build_fake_app(list_models=False)) as url:
        rc, out, err = run_main(["--url", url, *ARGS], capsys)
    assert rc == 2 and out == ""
    assert "/v1/models answered 404" in err and "--model" in err


@pytest.mark.parametrize(("status", "failure"), [(429, "429 rate_limit"), (500, "500 http_500")])
def test_http_errors_are_counted_by_status(status: int, failure: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with serve(build_fake_app(status=status)) as url:
        rc, out, _ = run_main(["--url", url, *ARGS, "--jsonl", "/dev/null"], capsys)
    table, _, body = out.partition("\n{")
    report = json.loads("{" + body)
    assert rc == 0 and report["requests"] == 9 and report["completed"] == 0
    assert report["errors_by_status"] == {str(status): 9}
    assert report["failures"] == {failure: 9}
    assert re.search(rf"^failed {failure}\s+9$", table, re.M)


def test_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    rc, _, err = run_main(["--url", url, *ARGS], capsys)
    assert rc == 2 and "ConnectError" in err  # the model list is asked first
    rc, out, _ = run_main(["--url", url, *ARGS, "--model", "m", "--json"], capsys)
    report = json.loads(out)
    assert rc == 0 and report["requests"] == 9
    assert report["errors_by_status"] == {"0": 9} and report["failures"] == {"0 ConnectError": 9}
    assert report["server_peak_memory_bytes"] is None
    assert report["server_memory"] == {"series": None, "samples": []}


def test_api_key_is_sent_to_every_endpoint(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    for flags, key in ((["--api-key", "sk-flag"], "sk-flag"),
                       (["--api-key-file", str(key_file)], "sk-file")):
        app = build_fake_app(reject=False)
        with serve(app) as url:
            assert run_main(["--url", url, *ARGS, *flags, "--json"], capsys)[0] == 0
        assert {s["auth"] for s in app.state.seen} == {f"Bearer {key}"}
        assert set(app.state.scrapes) == {f"Bearer {key}"}
    rc, _, err = run_main(["--api-key", "a", "--api-key-file", str(key_file)], capsys)
    assert rc == 2 and "pass one" in err


def test_open_loop_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """Arrivals do not wait for answers: with answers slower than the gaps between
    arrivals, new conversations open and requests overlap."""
    app = build_fake_app(reject=False, delay=0.3)
    with serve(app) as url:
        t0 = time.monotonic()
        rc, out, _ = run_main(["--url", url, "--users", "2", "--turns", "3", "--rate", "40",
                               "--words-per-turn", "5", "--json"], capsys)
        elapsed = time.monotonic() - t0
    report = json.loads(out)
    assert rc == 0 and report["mode"] == "open_loop"
    assert report["requests"] == 6 and report["completed"] == 6
    assert report["conversations"] > 2  # every open conversation was busy at some arrival
    assert report["send_lag_s"]["p99"] < 0.25
    assert elapsed < 6 * 0.3  # closed loop with 2 users would take >= 3 * 0.3 s per user...
    starts = sorted(s["t"] for s in app.state.seen)
    assert starts[-1] - starts[0] < 0.3 + 0.2  # ...here all six were sent within one answer
    for seen in app.state.seen:  # each conversation's turns stay in order
        user, turn = _turn_of(seen["body"])
        assert len(seen["body"]["messages"]) == 2 * turn + 1


def test_outputs_json_out_jsonl_and_plot(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    files = {k: tmp_path / k for k in ("report.json", "records.jsonl", "plot.png")}
    with serve(build_fake_app()) as url:
        rc, out, _ = run_main(["--url", url, *ARGS, "--metrics-interval", "0.05",
                               "--json-out", str(files["report.json"]),
                               "--jsonl", str(files["records.jsonl"]),
                               "--plot", str(files["plot.png"])], capsys)
    assert rc == 0
    assert out.startswith("metric") and "{" not in out  # --json-out: the table only
    assert "TTFT s p99" in out and "out tok/s/req p50" in out
    report = json.loads(files["report.json"].read_text())
    assert report["server_memory"]["series"] == "segserve_memory_bytes"
    assert report["server_memory"]["samples"][0][1] == 5e8
    records = [json.loads(line) for line in files["records.jsonl"].read_text().splitlines()]
    assert len(records) == 9 and {r["run"] for r in records} == {"run"}
    ok = [r for r in records if r["ok"]]
    assert len(ok) == 6 and all(len(r["itl_s"]) == 3 and r["tokens"] == 4 for r in ok)
    assert all(r["finish_reason"] == "length" for r in ok)
    assert {r["status"] for r in records if not r["ok"]} == {507}
    assert files["plot.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_fails_before_the_load(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    app = build_fake_app()
    with serve(app) as url:
        rc, out, err = run_main(["--url", url, *ARGS, "--plot", "x.png"], capsys)
    assert rc == 2 and out == "" and "--plot needs matplotlib" in err
    assert app.state.seen == []


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.5:9/v1/", "http://127.0.0.5:9"),
        ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
        ("https://api.example.com/v1", "https://api.example.com"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
        ("http://gw.internal/openai/v1", "http://gw.internal/openai"),
    ],
)
def test_any_url_is_accepted(url: str, base: str) -> None:
    assert base_url(url) == base


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/", "127.0.0.1:8000", "http://"])
def test_malformed_urls_are_refused(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(["--url", url, "--max-seconds", "1"], capsys)
    assert rc == 2 and out == "" and url in err


def test_every_flag_has_help() -> None:
    for action in loadtest.build_parser()._actions:
        assert action.help and len(action.help) > 10, action.option_strings


def test_a_driver_s_workload_flags_reach_loadtest_unchanged() -> None:
    """A driver declares the workload flags with its own defaults (bench/replicas.py does)
    and hands `segserve loadtest` what it parsed: the same values arrive, flag for flag."""
    driver = argparse.ArgumentParser()
    add_workload_flags(driver, users=8, turns=4, max_tokens=16, words_per_turn=60,
                       max_seconds=300.0)
    theirs = driver.parse_args(["--turns", "7", "--conversation", "session"])
    ours = loadtest.build_parser().parse_args(workload_argv(theirs))
    assert {d: getattr(ours, d) for d in WORKLOAD_FLAGS} == {
        "users": 8, "turns": 7, "conversation": "session", "max_tokens": 16,
        "words_per_turn": 60, "max_seconds": 300.0}
    # every workload flag is declared once, by the shared function
    declared = [a.dest for a in loadtest.build_parser()._actions]
    assert all(declared.count(d) == 1 for d in WORKLOAD_FLAGS)
    with pytest.raises(SystemExit):  # the bounds travel with the flags
        driver.parse_args(["--users", "0"])


def test_segserve_loadtest_imports_the_package_not_a_file() -> None:
    """`segserve loadtest` works from an installed wheel: the tool is a listed package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from setuptools import find_packages

    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert "segserve.server.loadtest" in find_packages(str(REPO), include=found["find"]["include"])
    cli = (REPO / "server" / "cli.py").read_text()
    assert "bench" not in cli.split("def _loadtest", 1)[1].split("\ndef ", 1)[0]
    run = subprocess.run([sys.executable, "-m", "segserve.server.cli", "loadtest", "--help"],
                         capture_output=True, text=True, cwd="/", timeout=60)
    assert run.returncode == 0 and "--rate" in run.stdout and "--api-key" in run.stdout


def test_bench_shim_keeps_its_users_working() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import loadtest as shim  # bench/speed.py does `from loadtest import ...`
    finally:
        sys.path.remove(str(REPO / "bench"))
    assert shim.main is loadtest.main and shim.LoadTestError is loadtest.LoadTestError
    assert shim.check_loopback_url("http://localhost:8000/v1") == "http://localhost:8000"
    with pytest.raises(loadtest.LoadTestError):
        shim.check_loopback_url("http://10.0.0.1:8000")


def test_parse_metric() -> None:
    text = (
        "# HELP segserve_memory_bytes bytes\n# TYPE segserve_memory_bytes gauge\n"
        'segserve_memory_bytes_total{kind="peak"} 1\n'
        'segserve_memory_bytes{kind="current"} 2\n'
        'segserve_memory_bytes{device="0",kind="peak",note="a \\"q\\""} 3.5e+09 1700000000\n'
    )
    assert parse_metric(text, "segserve_memory_bytes", {"kind": "peak"}) == 3.5e9
    assert parse_metric(text, "segserve_memory_bytes", {"kind": "weights"}) is None
    assert parse_metric("", "segserve_memory_bytes", {"kind": "peak"}) is None
    assert parse_metric("up 1\n", "up", {}) == 1.0


def test_summarize_percentiles() -> None:
    R = RequestRecord
    ok = [R(0, i, 0.0, status=200, ttft_s=i / 10, e2e_s=i / 10 + 1.0, completion_tokens=11,
            prompt_tokens=10, cached_tokens=i) for i in range(1, 11)]
    bad = [R(1, 0, 0.0, status=507, error_code="insufficient_memory", error_message="m"),
           R(1, 1, 0.0, status=0, error_code="ConnectError")]
    cfg = LoadConfig("http://127.0.0.1:1", 2, 11, 8, 5, 10.0)
    report = summarize(RunResult(ok + bad, 4.0, "m", "id", 2, None), cfg)
    assert report["ttft_s"] == {"p50": 0.5, "p90": 0.9, "p95": 1.0, "p99": 1.0,
                                "mean": pytest.approx(0.55), "n": 10}  # nearest rank
    assert report["tpot_s"]["p50"] == pytest.approx(0.1)  # (e2e - ttft) / (tokens - 1)
    assert report["output_tokens_per_s"]["p99"] == pytest.approx(10.0)
    assert report["tokens_per_s"] == 110 / 4.0
    assert report["cached_token_ratio"] == 55 / 100
    assert report["status_counts"] == {"0": 1, "200": 10, "507": 1}
    assert report["errors_by_status"] == {"0": 1, "507": 1}
    assert report["failures"] == {"0 ConnectError": 1, "507 insufficient_memory": 1}
    assert report["server_peak_memory_bytes"] is None
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0
    table = format_table({"run": report})
    assert re.search(r"^TTFT s p90\s+0\.9$", table, re.M)


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
    cmd = f"{sys.executable} {script}"
    rc, out, _ = run_main(["--compare", "--server-cmd", cmd, "--bank-max-bytes", "1000",
                           *ARGS, "--max-seconds", "15", "--startup-timeout", "30",
                           "--jsonl", str(tmp_path / "r.jsonl")], capsys)
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
    runs = [json.loads(line)["run"] for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert runs == ["segmented"] * 9 + ["stock"] * 9


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
    s = server_sample(text)
    assert s.peak_bytes == 123
    assert s.guard_interventions == {"shed_bank": 2.0}
    assert s.bank_evictions == {"ram_cap": 5.0}
    assert server_sample("segserve_memory_peak_bytes 7\n").peak_bytes == 7


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.process_support import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.mark.slow
def test_compare_against_real_segserve_segmented_and_stock(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same workload against two real segserve processes (segmented, then stock) on
    a tiny random model; session mode; the model id comes from /v1/models."""
    cmd = f"{sys.executable} -m segserve.server.cli serve --model {tiny_model_dir} --bank-dir none"
    rc, out, err = run_main(["--compare", "--server-cmd", cmd, "--users", "2", "--turns", "3",
                             "--words-per-turn", "6", "--max-tokens", "4", "--conversation",
                             "session", "--max-seconds", "120", "--startup-timeout", "120",
                             "--metrics-interval", "0.2", "--json"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    for label in ("segmented", "stock"):
        rep = result[label]
        assert rep["status_counts"] == {"200": 6}, rep["failures"]
        assert rep["model"] == tiny_model_dir.name or tiny_model_dir.name in rep["model"]
        assert rep["completion_tokens"] == 6 * 4
        assert rep["ttft_s"]["n"] == 6 and rep["e2e_s"]["p99"] >= rep["ttft_s"]["p99"]
        assert rep["server_peak_memory_bytes"] and rep["server_peak_memory_bytes"] > 0
        assert rep["server_memory"]["samples"], "segserve exposes memory in /metrics"
        assert rep["cached_tokens"] > 0  # turns 2 and 3 reuse the conversation so far
    assert result["ratios"]["requests"] == 1.0


def _load_locustfile() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("segserve_bench_locustfile",
                                                  REPO / "bench" / "locustfile.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_locustfile_imports_without_locust_and_parses_streams() -> None:
    mod = _load_locustfile()  # must not need locust
    try:
        import locust  # noqa: F401
        has_locust = True
    except ImportError:
        has_locust = False
    assert hasattr(mod, "ChatUser") == has_locust
    lines = [b": keep-alive", _chunk({"role": "assistant"}).strip().encode(),
             _chunk({"content": "he"}).strip(), _chunk({"content": "llo"}).strip(),
             "data: [DONE]", _chunk({"content": "never"}).strip()]
    reply, ttft, error = mod.stream_reply(lines, time.perf_counter())
    assert (reply, error) == ("hello", None) and ttft is not None and ttft >= 0
    err = 'data: {"error": {"message": "m", "code": "insufficient_memory"}}'
    assert mod.stream_reply([err], 0.0)[2] == {"message": "m", "code": "insufficient_memory"}


def test_locust_runs_the_same_workload(tmp_path: Path) -> None:
    pytest.importorskip("locust")
    app = build_fake_app(reject=False)
    with serve(app) as url:
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO / "bench" / "locustfile.py"),
             "--headless", "-u", "2", "-r", "2", "--run-time", "4s", "--host", url,
             "--turns", "2", "--words-per-turn", "5", "--max-tokens", "4", "--only-summary"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert app.state.seen
    for seen in app.state.seen:
        body = seen["body"]
        user, turn = _turn_of(body)
        assert body["model"] == MODEL and body["messages"][-1]["content"] == user_text(
            0, user, turn, 5)
        assert len(body["messages"]) == 2 * turn + 1
