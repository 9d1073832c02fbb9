"""The `segserve loadtest` multi-turn workload for locust users (locust is not a dependency).

    pip install locust
    locust -f bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 2 \
        --run-time 5m --turns 12 --words-per-turn 300 --max-tokens 48

Each locust user holds one conversation of `--turns` turns built by
`segserve.server.loadtest.workload` (the same user text for the same seed, user and turn as
`segserve loadtest`), resends the whole history every turn (`--conversation session`
adds an X-Session-Id), streams the answer, and starts a new conversation when one ends.
Locust records two entries per turn: `chat` (the whole streamed request) and `ttft`
(time to the first content chunk). `--model` defaults to the first id from /v1/models;
`--api-key` is sent as a bearer token. Without locust installed this file still imports
(the workload helpers are usable), it just defines no user class.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from segserve.server.loadtest.workload import MODES, Conversation, chat_body, conversation

try:  # lazy: only `locust -f` needs it
    from locust import HttpUser, events, task
except ImportError:  # pragma: no cover - exercised where locust is absent
    HttpUser = None

_USER_IDS = itertools.count()


def stream_reply(lines: Any, started: float) -> tuple[str, float | None, dict[str, Any] | None]:
    """(reply text, seconds to the first content chunk, error object) from SSE lines."""
    parts: list[str] = []
    ttft = None
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return "".join(parts), ttft, chunk["error"]
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                ttft = time.perf_counter() - started if ttft is None else ttft
                parts.append(piece)
    return "".join(parts), ttft, None


if HttpUser is not None:

    @events.init_command_line_parser.add_listener
    def _flags(parser: Any) -> None:
        parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
        parser.add_argument("--words-per-turn", type=int, default=200,
                            help="words in each user message")
        parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens per request")
        parser.add_argument("--model", default="", help="default: first id from /v1/models")
        parser.add_argument("--api-key", default="", help="bearer token")
        parser.add_argument("--conversation", choices=MODES, default="history",
                            help="history, or history + X-Session-Id (session)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the user text")

    class ChatUser(HttpUser):  # type: ignore[misc]
        """One conversation at a time; the next turn is sent when the answer ended."""

        def on_start(self) -> None:
            opts = self.environment.parsed_options
            self.opts = opts
            self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
            self.model = opts.model or self._first_model()
            self.user_id = next(_USER_IDS)
            self.conv = self._new_conversation()

        def _first_model(self) -> str:
            with self.client.get("/v1/models", headers=self.headers, name="models",
                                 catch_response=True) as resp:
                try:
                    return str(resp.json()["data"][0]["id"])
                except (ValueError, KeyError, IndexError, TypeError):
                    resp.failure("no model in /v1/models; pass --model")
                    return "default"

        def _new_conversation(self) -> Conversation:
            o = self.opts
            return conversation(self.user_id, o.seed, o.words_per_turn, o.turns,
                                o.conversation, f"locust{id(self.environment)}")

        @task
        def turn(self) -> None:
            if self.conv.done:
                self.user_id = next(_USER_IDS)
                self.conv = self._new_conversation()
            messages = self.conv.start_turn()
            body = chat_body(self.model, messages, self.opts.max_tokens, 0.0)
            started = time.perf_counter()
            ok, reply = False, ""
            with self.client.post("/v1/chat/completions", json=body, stream=True, name="chat",
                                  headers={**self.headers, **self.conv.headers()},
                                  catch_response=True) as resp:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                else:
                    reply, ttft, error = stream_reply(resp.iter_lines(), started)
                    if error is not None:
                        resp.failure(f"stream error: {error}")
                    else:
                        ok = True
                        resp.success()
                        if ttft is not None:
                            events.request.fire(request_type="SSE", name="ttft",
                                                response_time=ttft * 1000.0,
                                                response_length=0, exception=None,
                                                context={})
            self.conv.end_turn(ok, reply, time.perf_counter())
