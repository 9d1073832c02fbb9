"""Two segserve replicas behind a real nginx with deploy/nginx/segserve.conf.

Skipped only where nginx or its njs module is absent (`make test` installs Debian's
`nginx` and `libnginx-mod-http-js` where it runs as root with apt). Multi-turn
conversations go through nginx; each must stay on one replica (nginx's
`X-Segserve-Upstream` header, and the replicas' own session counts), and every follow-up
turn must report cached tokens: it reached the replica that holds its segments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.nginx_support import NGINX, NJS_MODULE, Cluster, replicas_behind_nginx
from tests.process_support import ServerProcess

pytestmark = [
    pytest.mark.skipif(NGINX is None or NJS_MODULE is None,
                       reason="no nginx with njs (apt-get install nginx libnginx-mod-http-js)"),
    pytest.mark.slow,
]

TURNS = 3

Turns = list[tuple[str, int]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with replicas_behind_nginx(tmp_path_factory.mktemp("replicas")) as c:
        yield c


def converse(cluster: Cluster, first: str, *, turns: int = TURNS,
             headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
             before_turn: Callable[[int, Turns], None] | None = None) -> Turns:
    """`turns` turns through nginx, resending the history; (upstream, cached tokens) of each.
    `before_turn(turn, so_far)` runs before each request (the failover test kills there)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": first}]
    out: Turns = []
    with cluster.client() as c:
        for turn in range(turns):
            if before_turn is not None:
                before_turn(turn, out)
            body = {"model": "default", "messages": history, "max_tokens": 4, **(extra or {})}
            r = c.post("/v1/chat/completions", json=body, headers=headers or {})
            assert r.status_code == 200, r.text + cluster.router.log()
            details = r.json()["usage"].get("prompt_tokens_details") or {}
            # nginx lists every upstream it tried, the one that answered last
            out.append((r.headers["x-segserve-upstream"].split(", ")[-1],
                        int(details.get("cached_tokens") or 0)))
            history += [r.json()["choices"][0]["message"],
                        {"role": "user", "content": f"turn {turn + 2}: tell me more about that"}]
    return out


def assert_sticky_and_cached(turns: list[tuple[str, int]], what: str) -> str:
    upstreams = {u for u, _ in turns}
    assert len(upstreams) == 1, f"{what} moved between replicas: {turns}"
    assert all(cached > 0 for _, cached in turns[1:]), f"{what}: a follow-up missed: {turns}"
    return upstreams.pop()


def bank_sessions(r: ServerProcess) -> int:
    h = httpx.get(r.url + "/health", timeout=10, trust_env=False).json()
    return int(h["bank"]["sessions"])


def test_session_header_sticks_and_follow_ups_hit(cluster: Cluster) -> None:
    placed: dict[str, str] = {}
    # 12 conversations: nginx's ring is built from the replicas' (random) ports, so with 6
    # all of them landed on one replica in about 3 % of runs (2 x 0.5^6); with 12, 0.05 %.
    for i in range(12):
        sid = f"e2e-conv-{i}"
        turns = converse(cluster, f"Conversation {i}: hello, what is a segment?",
                         headers={"X-Session-Id": sid})
        placed[sid] = assert_sticky_and_cached(turns, sid)
    # The ring spread the conversations, and each replica holds exactly the sessions
    # nginx sent it (segserve counts sessions by X-Session-Id).
    used = set(placed.values())
    assert len(used) == 2, placed
    for upstream in used:
        expect = sum(1 for u in placed.values() if u == upstream)
        assert bank_sessions(cluster.addr(upstream)) >= expect


def test_history_without_header_sticks_by_first_user_message(cluster: Cluster) -> None:
    placed = []
    for i in range(12):  # 12, not 6: see test_session_header_sticks_and_follow_ups_hit
        turns = converse(cluster, f"History-only client {i}: explain caching briefly.")
        placed.append(assert_sticky_and_cached(turns, f"history conversation {i}"))
    assert len(set(placed)) == 2, placed


def test_prompt_cache_key_hashes_like_the_header(cluster: Cluster) -> None:
    for i in range(4):
        key = f"cache-key-{i}"
        by_body = converse(cluster, f"Keyed client {i}: hi", extra={"prompt_cache_key": key})
        upstream = assert_sticky_and_cached(by_body, key)
        # The same session named by the header: the same replica (and a session hit).
        by_header = converse(cluster, f"Keyed client {i}: hi", headers={"X-Session-Id": key})
        assert {u for u, _ in by_header} == {upstream}
        assert by_header[0][1] > 0  # its first turn already continues the stored session


def test_a_killed_replica_s_conversation_continues_on_another(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Failover without a shared SSD tier: the next turn re-prefills on the next replica of
    the ring (nginx retries the refused connection), and sticks there afterwards."""
    with replicas_behind_nginx(tmp_path_factory.mktemp("failover")) as cluster:

        def kill_mid_conversation(turn: int, so_far: Turns) -> None:
            if turn == 2:
                cluster.addr(so_far[-1][0]).kill()

        seen = converse(cluster, "Remember: blue whale.", turns=4,
                        headers={"X-Session-Id": "failover-conv"}, before_turn=kill_mid_conversation)
    first, moved = seen[1][0], seen[2][0]
    assert seen[0][0] == first and moved != first, seen
    assert seen[1][1] > 0  # on its first replica: a hit
    assert seen[2][1] == 0  # the survivor never saw it: a full re-prefill
    assert seen[3][0] == moved and seen[3][1] > 0  # and it sticks to the survivor
