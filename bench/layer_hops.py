"""Count the cross-module calls ("hops") of one request, through a tiny random-weight model.

A hop is a Python call whose caller and callee are functions of two different `segserve`
modules (a `sys.setprofile` trace on every thread, switched on for the request only). The
engine thread also runs its idle turns during the request (one every 0.5 s at most), so its
count carries a little noise; the HTTP side's count does not. Engine trips are the
requests and session calls the HTTP side hands to the engine thread.

    python bench/layer_hops.py            # this checkout
    PYTHONPATH=/path/to/other/checkout python bench/layer_hops.py   # another version

Works on versions before and after the HTTP package moved to `segserve.server.http`.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starlette.testclient import TestClient  # noqa: E402

from segserve.config.settings import load_settings  # noqa: E402
from tests.conftest import tiny_loaded  # noqa: E402
from tests.http_support import tiny_runtime  # noqa: E402


def _create_app() -> Callable[..., Any]:
    for name in ("segserve.server.http.app", "segserve.server.app"):
        try:
            return importlib.import_module(name).create_app  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError("no create_app")


class Hops:
    """Installed before any thread starts (a profile function reaches only threads started
    after `threading.setprofile`); counts while `measure()` is on."""

    def __init__(self) -> None:
        self.active = False
        self.by_thread: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()
        self.trips = 0

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if not (callee.startswith("segserve.") and caller.startswith("segserve.")) or callee == caller:
            return
        side = "engine" if threading.current_thread().name == "segserve-engine" else "http"
        self.by_thread[side] += 1
        self.edges[(caller, callee)] += 1
        if callee.endswith("engine.loop") and frame.f_code.co_name in ("submit", "call"):
            self.trips += 1

    def install(self) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def __enter__(self) -> Hops:
        self.by_thread.clear()
        self.edges.clear()
        self.trips = 0
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False

    def report(self) -> dict[str, Any]:
        return {"http": self.by_thread["http"], "engine": self.by_thread["engine"],
                "engine_trips": self.trips, "distinct_edges": len(self.edges)}


def main() -> None:
    import mlx.core as mx

    from segserve.server.runner.gguf import embedded_model_path
    from segserve.server.runner.tokenizer import from_gguf_metadata

    _, meta = mx.load(str(embedded_model_path()), return_metadata=True)
    assert isinstance(meta, dict)
    tok, _ = from_gguf_metadata(meta)
    h = Hops()
    h.install()
    rt = tiny_runtime(tiny_loaded(tok, context=1024), load_settings({}, environ={}))
    app = _create_app()(getattr(rt, "serving", rt))
    msgs = [{"role": "user", "content": "count the hops of this request"}]
    out: dict[str, Any] = {}
    with TestClient(app) as c:
        # Warm up both routes (imports, compiled functions, first-use caches).
        c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
        first = c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 4})
        c.post("/v1/responses", json={"input": "again", "max_output_tokens": 4,
                                      "previous_response_id": first.json()["id"]})
        with h:
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        out["chat_completion"] = h.report()
        base = c.post("/v1/responses", json={"input": "hello there", "max_output_tokens": 4})
        with h:
            r = c.post("/v1/responses", json={"input": "and then", "max_output_tokens": 4,
                                              "previous_response_id": base.json()["id"]})
        assert r.status_code == 200, r.text
        out["responses_previous_response_id"] = h.report()
    rt.engine.stop()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
