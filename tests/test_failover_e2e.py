"""Failover with a shared SSD tier: two real replicas on one shared --bank-dir behind nginx.

A conversation runs on replica A; A is killed with SIGKILL between turns; the next turn
goes through nginx (deploy/nginx/segserve.conf: `proxy_next_upstream error` retries the
refused connection on the next replica of the ring), succeeds on B, and reports cached
tokens that B restored from A's blocks in the shared tier (B's /health counts the shared
restore). The same flow without a shared tier re-prefills (tests/test_replicas_e2e.py).
Skipped only where nginx or its njs module is absent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.nginx_support import NGINX, NJS_MODULE, NginxRouter
from tests.process_support import ServerProcess, write_tiny_model_dir

pytestmark = [
    pytest.mark.skipif(NGINX is None or NJS_MODULE is None,
                       reason="no nginx with njs (apt-get install nginx libnginx-mod-http-js)"),
    pytest.mark.slow,
]

BLOCK_ROWS = 256  # the bank's aligned block size: only full blocks are shared
# About 700 tokens: the history spans at least two full aligned blocks after turn 1.
FIRST = "Remember these words for later: " + " ".join(
    f"item{i} is {'red green blue amber violet'.split()[i % 5]}" for i in range(140)
)


def health(r: ServerProcess) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(r.url + "/health", timeout=10, trust_env=False).json()
    return got


def wait_published(shared: Path, entries: int, timeout: float = 60) -> None:
    """Until the shared tier holds `entries` chain entries: A's writer committed those
    blocks (/health's bank figures are refreshed by engine steps, not while idle)."""
    deadline = time.monotonic() + timeout
    while len(list((shared / "chains").glob("*/*.chn"))) < entries:
        assert time.monotonic() < deadline, "the blocks were not published in time"
        time.sleep(0.1)


def test_the_survivor_restores_a_killed_replica_s_conversation(tmp_path: Path) -> None:
    model = write_tiny_model_dir(tmp_path / "model")
    shared = tmp_path / "shared-bank"
    replicas = [
        ServerProcess(tmp_path / f"replica{i}.log", "--model", str(model),
                      "--bank-dir", str(shared), "--bank-shared", "true")
        for i in range(2)
    ]
    router: NginxRouter | None = None
    try:
        for r in replicas:
            r.wait_healthy(180)
        # One manifest and lock per replica (hostname-port ids), one shared block store.
        assert len(list((shared / "replicas").iterdir())) == 2
        router = NginxRouter(tmp_path / "nginx", [f"127.0.0.1:{r.port}" for r in replicas])
        by_port = {f":{r.port}": r for r in replicas}

        def owner(upstream: str) -> ServerProcess:
            last = upstream.split(", ")[-1]  # after a retry nginx lists every upstream tried
            return next(r for p, r in by_port.items() if last.endswith(p))

        headers = {"X-Session-Id": "shared-failover"}
        history: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
        seen: list[tuple[ServerProcess, int, int]] = []  # (replica, prompt, cached tokens)
        with httpx.Client(base_url=router.url, timeout=180, trust_env=False) as c:
            for turn in range(4):
                if turn == 2:  # mid-conversation: A's writes are committed, then A dies
                    a = seen[-1][0]
                    wait_published(shared, seen[-1][1] // BLOCK_ROWS)
                    a.kill()  # SIGKILL: no shutdown, no flush
                body = {"model": "default", "messages": history, "max_tokens": 4}
                resp = c.post("/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 200, resp.text + router.log()
                usage = resp.json()["usage"]
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                seen.append((owner(resp.headers["x-segserve-upstream"]), usage["prompt_tokens"],
                             cached))
                history += [resp.json()["choices"][0]["message"],
                            {"role": "user", "content": f"turn {turn + 2}: which item was red?"}]
        a, b = seen[0][0], seen[2][0]
        assert seen[1][0] is a and b is not a, [(r.port, p, k) for r, p, k in seen]
        assert seen[0][1] > 2 * BLOCK_ROWS and seen[1][2] > 0  # long enough; a hit on A
        # The first turn on B: A's full blocks restored from the shared tier, the partial
        # last block and the new message prefilled.
        restored = seen[2][2]
        assert restored >= 2 * BLOCK_ROWS and restored % BLOCK_ROWS == 0, seen[2]
        bank = health(b)["bank"]
        assert bank["restores_by_tier"]["shared"] >= 1 and bank["hits_by_kind"]["prefix"] >= 1
        assert bank["quarantined_blocks"] == 0
        assert seen[3][0] is b and seen[3][2] > restored  # and the session continues on B
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.kill()
