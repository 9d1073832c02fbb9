"""`/metrics` as an operator reads it: every name README.md documents is exported with its
type (parsed with prometheus-client's own parser), and the request metrics move with the
requests a client made: TTFT and end-to-end counts, prompt / generation token sums against
`usage`, finish reasons, cached tokens, bank lookups and hits."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from segserve.config.settings import load_settings
from segserve.server.http.app import create_app
from segserve.server.runner import ChatTokenizer
from segserve.server.runtime import Runtime
from tests.conftest import tiny_loaded
from tests.deploy_support import documented_metrics
from tests.http_support import serve_in_thread, tiny_runtime

CHAT = "/v1/chat/completions"
README = Path(__file__).resolve().parents[1] / "README.md"
MODEL = "tiny-test"

Families = dict[str, Any]


def documented() -> dict[str, tuple[str, str]]:
    """{name: (type, labels cell)} from README.md's metrics table."""
    text = README.read_text()
    block = text.split("<!-- metrics:begin -->", 1)[1].split("<!-- metrics:end -->", 1)[0]
    out = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            out[cells[0].strip("`")] = (cells[1], cells[2])
    return out


def scrape(client: httpx.Client) -> Families:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def family_of(name: str, kind: str) -> tuple[str, str]:
    """The (family name, type) prometheus-client's parser gives a documented name."""
    if kind == "counter":
        assert name.endswith("_total"), name
        return name[: -len("_total")], "counter"
    if kind == "info":  # text format 0.0.4 exposes an Info as a gauge named X_info
        return name, "gauge"
    return name, kind


def value(fams: Families, sample: str, **labels: str) -> float:
    """Sum of the samples named `sample` whose labels include `labels`."""
    total = 0.0
    for f in fams.values():
        for s in f.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _runtime(tok: ChatTokenizer, eos: frozenset[int]) -> Runtime:
    loaded = tiny_loaded(tok, context=1024)
    loaded = dataclasses.replace(loaded, tokenizer=dataclasses.replace(loaded.tokenizer, eos_ids=eos))
    return tiny_runtime(loaded, load_settings({}, environ={}))


def _served(tok: ChatTokenizer, eos: frozenset[int]) -> Iterator[httpx.Client]:
    rt = _runtime(tok, eos)
    try:
        with serve_in_thread(create_app(rt.serving)) as url, \
                httpx.Client(base_url=url, timeout=120, trust_env=False) as c:
            yield c
    finally:
        rt.engine.stop()


@pytest.fixture(scope="module")
def client(gguf_tokenizer: ChatTokenizer) -> Iterator[httpx.Client]:
    """EOS disabled: every request generates exactly max_tokens tokens (finish "length")."""
    yield from _served(gguf_tokenizer, frozenset())


@pytest.fixture(scope="module")
def eos_client(gguf_tokenizer: ChatTokenizer) -> Iterator[httpx.Client]:
    """Every token is an EOS: each request ends with finish "stop" at its first token."""
    yield from _served(gguf_tokenizer, frozenset(range(49152)))


def _chat(client: httpx.Client, msgs: list[dict[str, str]], n: int, **extra: Any) -> dict[str, Any]:
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": n, "temperature": 0, **extra},
                    headers={"X-Session-Id": "metrics-names"})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_readme_lists_the_metrics_with_types() -> None:
    docs = documented()
    assert len(docs) >= 40
    for name, (kind, _) in docs.items():
        assert re.fullmatch(r"[a-z_:][a-z0-9_:]*", name), name
        assert kind in {"counter", "gauge", "histogram", "info"}, (name, kind)
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
        if name.endswith("_seconds") or name.endswith("_bytes"):
            assert kind in {"gauge", "histogram"}, name


def test_every_documented_name_is_exported_with_its_type(client: httpx.Client) -> None:
    _chat(client, [{"role": "user", "content": "fill every family once"}], 2)
    fams = scrape(client)
    for name, (kind, labels) in documented().items():
        if name.startswith("process_") and not sys.platform.startswith("linux"):
            continue  # ProcessCollector reads /proc
        fam, ftype = family_of(name, kind)
        assert fam in fams, name
        assert fams[fam].type == ftype, (name, fams[fam].type)
        for s in fams[fam].samples:  # a documented label set, model_name where documented
            assert set(s.labels) - {"le"} <= set(re.findall(r"`([a-z_]+)`", labels)) or kind == "info", (name, s.labels)
            if "`model_name`" in labels:
                assert s.labels["model_name"] == MODEL, (name, s.labels)
    # nothing exported under our prefix that the README does not list
    listed = {family_of(n, k)[0] for n, (k, _) in documented().items()}
    extra = {n for n in fams if n.startswith("segserve_")} - listed
    assert not extra, sorted(extra)
    # the dashboard's list (deploy/README.md) agrees: its current names are exported with
    # the README's type, its fallbacks (names before the rework) are gone
    for name, (kind, today) in documented_metrics().items():
        fam, _ = family_of(name, kind)
        if today:
            assert documented().get(name, ("",))[0] == kind, name
        else:
            exported = {smp.name for f in fams.values() for smp in f.samples}
            assert name not in exported and name not in documented(), name


def test_request_metrics_move_with_requests(client: httpx.Client) -> None:
    before = scrape(client)
    msgs = [{"role": "user", "content": "a first turn whose rows the bank keeps"}]
    usages = []
    for turn in range(3):
        body = _chat(client, msgs, 3)
        usages.append(body["usage"])
        msgs += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                 {"role": "user", "content": f"turn {turn + 2}"}]
    # a streamed one counts the same
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": 2, "stream": True,
                                "stream_options": {"include_usage": True}},
                    headers={"X-Session-Id": "metrics-names"})
    assert r.status_code == 200
    chunks = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines()
              if line.startswith("data: {")]
    usages.append(next(c["usage"] for c in chunks if c.get("usage")))
    after = scrape(client)
    n = len(usages)

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    m = {"model_name": MODEL}
    assert delta("segserve_time_to_first_token_seconds_count", **m) == n
    assert delta("segserve_e2e_request_latency_seconds_count", **m) == n
    assert delta("segserve_e2e_request_latency_seconds_sum", **m) > 0
    assert delta("segserve_prompt_tokens_count", **m) == n
    assert delta("segserve_prompt_tokens_sum", **m) == sum(u["prompt_tokens"] for u in usages)
    assert delta("segserve_generation_tokens_sum", **m) == sum(u["completion_tokens"] for u in usages)
    assert delta("segserve_generation_tokens_count", **m) == n
    # two gaps in each 3-token request, one in the 2-token one
    assert delta("segserve_inter_token_latency_seconds_count", **m) == 3 * 2 + 1
    assert delta("segserve_time_per_output_token_seconds_count", **m) == n
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert delta("segserve_cached_tokens_total", **m) == cached
    assert delta("segserve_prefill_tokens_total", **m) == sum(u["prompt_tokens"] for u in usages) - cached
    assert delta("segserve_requests_finished_total", finish_reason="length", **m) == n
    assert delta("segserve_requests_finished_total", finish_reason="stop") == 0
    assert delta("segserve_requests_total", endpoint=CHAT, status="200") == n
    assert delta("segserve_bank_lookups_total") == n
    hits = sum(1 for u in usages if u["prompt_tokens_details"]["cached_tokens"] > 0)
    assert delta("segserve_bank_hits_total") == hits
    assert delta("segserve_bank_lookups_total", result="miss") == n - hits
    assert delta("segserve_session_segments_count") == n
    assert value(after, "segserve_num_requests_running", **m) == 0
    assert value(after, "segserve_num_requests_waiting", **m) == 0
    # TTFT reaches the 600 s a cold long prefill on CPU can take
    les = {s.labels["le"] for s in after["segserve_time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket")}
    assert "600.0" in les


# Bucket bounds are part of the exported API: a stored series and a dashboard's
# histogram_quantile() only agree with new samples while the bounds stay the same.
_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 90, 120, 180, 240, 360, 480, 600)
_TOKEN_TIME = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1, 2.5, 5, 10, 30)
_COUNTS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6)
BUCKETS: dict[str, tuple[float, ...]] = {
    "segserve_time_to_first_token_seconds": _S,
    "segserve_e2e_request_latency_seconds": _S[2:] + (900, 1200, 1800, 3600),
    "segserve_inter_token_latency_seconds": _TOKEN_TIME,
    "segserve_time_per_output_token_seconds": _TOKEN_TIME,
    "segserve_queue_wait_seconds": (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                    60, 120, 300, 600),
    "segserve_prompt_tokens": _COUNTS,
    "segserve_generation_tokens": _COUNTS,
    "segserve_session_segments": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
}


def test_histogram_names_and_buckets(client: httpx.Client) -> None:
    fams = scrape(client)
    histograms = {n for n, f in fams.items() if f.type == "histogram"}
    assert histograms == set(BUCKETS)
    for name, bounds in BUCKETS.items():
        les = {float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"}
        assert les == {float(b) for b in bounds} | {math.inf}, name


def test_state_gauges(client: httpx.Client) -> None:
    _chat(client, [{"role": "user", "content": "something for the bank to hold"}], 2)
    fams = scrape(client)
    used = {s.labels["kind"]: s.value for s in fams["segserve_memory_used_bytes"].samples}
    assert set(used) == {"weights", "kv_segments", "kv_tail", "other"}
    assert used["kv_segments"] > 0 and all(v >= 0 for v in used.values())
    assert value(fams, "segserve_memory_budget_bytes") > 0
    assert value(fams, "segserve_memory_peak_bytes") > 0
    rows = {s.labels["tier"]: s.value for s in fams["segserve_kv_rows"].samples}
    kv_bytes = {s.labels["tier"]: s.value for s in fams["segserve_kv_bytes"].samples}
    assert set(rows) == set(kv_bytes) == {"tail", "ram", "ssd"}
    assert rows["ram"] > 0 and kv_bytes["ram"] == used["kv_segments"]
    assert rows["tail"] == 0  # nothing running
    assert value(fams, "segserve_kv_segments") > 0
    assert value(fams, "segserve_bank_sessions") >= 1
    if sys.platform.startswith("linux"):
        assert value(fams, "process_resident_memory_bytes") > 0


def test_finish_reason_stop(eos_client: httpx.Client) -> None:
    before = scrape(eos_client)
    body = _chat(eos_client, [{"role": "user", "content": "stop at once"}], 8)
    assert body["choices"][0]["finish_reason"] == "stop"
    after = scrape(eos_client)
    labels = {"model_name": MODEL, "finish_reason": "stop"}
    assert value(after, "segserve_requests_finished_total", **labels) - \
        value(before, "segserve_requests_finished_total", **labels) == 1
    assert value(after, "segserve_generation_tokens_sum") - value(before, "segserve_generation_tokens_sum") \
        == body["usage"]["completion_tokens"]
    assert value(after, "segserve_requests_finished_total", finish_reason="length") == 0
