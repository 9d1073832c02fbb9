"""Prometheus metrics: the only module that imports prometheus_client.

Owns: `Metrics` (a registry per server instance, so tests can run several), which
implements `segserve.server.engine.EngineObserver` for the engine thread and exposes recorders
for the HTTP layer. Gauges that mirror state owned elsewhere (KV rows and bytes, bank,
memory) are read at scrape time from the engine's published `EngineState`
(`set_state_source`): the state of its last step, read on the engine thread.

Conventions: Prometheus base units (seconds, bytes), `_total` on counters, and vLLM's
`model_name` label on the request and token metrics (TTFT, inter-token, per-output-token
and end-to-end latency, queue wait, prompt / generation / prefill / cached tokens, finish
reasons, running and waiting requests). Server-state metrics (memory, KV, bank, admission,
HTTP) carry no model label: one server serves one model. README.md ("Metrics") lists every
name; tests/test_metrics_names.py checks each against a live `/metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from segserve.server.engine.state import EngineState

# Seconds. TTFT includes queueing, lookup, SSD restore and a cold prefill (a 6K-token
# prompt on CPU takes minutes), so its buckets reach 600 s; a whole request may run longer.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 90, 120,
                 180, 240, 360, 480, 600)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 90, 120, 180, 240, 360,
                480, 600, 900, 1200, 1800, 3600)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                       0.3, 0.5, 0.75, 1, 2.5, 5, 10, 30)
_QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                  600)
# Tokens per request: 1-2-5 steps up to a million.
_TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)
_SEGMENT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


@dataclass(frozen=True, slots=True)
class _HistogramSpec:
    name: str
    doc: str
    buckets: tuple[float, ...]
    per_model: bool = True  # vLLM's `model_name` label (request and token metrics)


HistogramKey = Literal["ttft", "itl", "tpot", "e2e", "queue_wait", "prompt", "generation",
                       "segments"]

# Every histogram, one row each: names and buckets are what dashboards and
# tests/test_metrics_names.py read, so a change here is a change of the exported API.
_HISTOGRAMS: dict[HistogramKey, _HistogramSpec] = {
    "ttft": _HistogramSpec(
        "segserve_time_to_first_token_seconds",
        "Time to first token, from arrival (queueing, lookup and restore included)",
        _TTFT_BUCKETS),
    "itl": _HistogramSpec(
        "segserve_inter_token_latency_seconds", "Time between two tokens of a request",
        _TOKEN_TIME_BUCKETS),
    "tpot": _HistogramSpec(
        "segserve_time_per_output_token_seconds",
        "Mean time per output token after the first, per finished request",
        _TOKEN_TIME_BUCKETS),
    "e2e": _HistogramSpec(
        "segserve_e2e_request_latency_seconds",
        "Arrival to last token, per finished request (finish reason stop or length)",
        _E2E_BUCKETS),
    "queue_wait": _HistogramSpec(
        "segserve_queue_wait_seconds", "Time a request waited for admission", _QUEUE_BUCKETS),
    "prompt": _HistogramSpec(
        "segserve_prompt_tokens",
        "Prompt tokens per finished request (usage.prompt_tokens; reused ones included)",
        _TOKEN_COUNT_BUCKETS),
    "generation": _HistogramSpec(
        "segserve_generation_tokens",
        "Generated tokens per finished request (usage.completion_tokens)",
        _TOKEN_COUNT_BUCKETS),
    "segments": _HistogramSpec(
        "segserve_session_segments",
        "KV segments a session's stored history spans, observed as each turn is stored",
        _SEGMENT_BUCKETS, per_model=False),
}

FINISH_REASONS = ("stop", "length", "abort")
LOOKUP_RESULTS = ("session", "prefix", "miss")
KV_TIERS = ("tail", "ram", "ssd")
MEMORY_KINDS = ("weights", "kv_segments", "kv_tail", "other")

StateSource = Callable[[], EngineState]

# No `X_created` series next to every counter and histogram: Prometheus does not use them
# in the text format, and they doubled the exposition (process-wide; only we import it).
disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream


class _StateCollector(Collector):
    """Turns the engine's state snapshot into gauges/counters at scrape time."""

    def __init__(self, source: StateSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        st = self._source()
        yield from _kv_families(st.kv, st.bank)
        yield from _memory_families(st.memory.as_dict(), st.kv)
        yield from _bank_families(st.bank)


def _histogram(spec: _HistogramSpec, registry: CollectorRegistry, model_name: str) -> Histogram:
    """The histogram of a `_HISTOGRAMS` row; per-model ones are its one `model_name` child."""
    if not spec.per_model:
        return Histogram(spec.name, spec.doc, buckets=spec.buckets, registry=registry)
    return Histogram(spec.name, spec.doc, ["model_name"], buckets=spec.buckets,
                     registry=registry).labels(model_name)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def _kv_families(kv: Mapping[str, Any], bank: Mapping[str, Any]) -> Iterator[Metric]:
    yield _gauge("segserve_kv_segments", "Distinct KV segments the session bank holds",
                 float(kv.get("live_segments", 0)))
    yield _counter("segserve_kv_seals", "Tails sealed into segments", float(kv.get("seals", 0)))
    yield _counter("segserve_kv_merges", "Tiered merges of small segments",
                   float(kv.get("merges", 0)))
    spec = kv.get("spec", {})
    yield _counter("segserve_spec_draft_tokens", "Draft tokens verified by speculative decoding",
                   float(spec.get("drafted", 0)))
    yield _counter("segserve_spec_accepted_tokens", "Draft tokens the model agreed with",
                   float(spec.get("accepted", 0)))
    kv_bytes, kv_rows = kv.get("bytes", {}), kv.get("rows", {})
    bank_bytes, bank_rows = bank.get("bytes_by_tier", {}), bank.get("rows_by_tier", {})
    by_tier_bytes = {
        "tail": kv_bytes.get("tail", 0),
        "ram": bank_bytes.get("ram", kv_bytes.get("segments", 0)),
        "ssd": bank_bytes.get("ssd", 0),
    }
    by_tier_rows = {"tail": kv_rows.get("tail", 0), "ram": bank_rows.get("ram", 0),
                    "ssd": bank_rows.get("ssd", 0)}
    b = GaugeMetricFamily(
        "segserve_kv_bytes",
        "KV cache bytes by tier: tail (running requests' unsealed rows, buffer capacity "
        "included), ram (sealed segments in the bank's RAM tier), ssd (the bank's SSD tier)",
        labels=["tier"],
    )
    r = GaugeMetricFamily(
        "segserve_kv_rows",
        "KV cache rows (token positions) by tier: tail, ram, ssd (as segserve_kv_bytes)",
        labels=["tier"],
    )
    for tier in KV_TIERS:
        b.add_metric([tier], float(by_tier_bytes[tier]))
        r.add_metric([tier], float(by_tier_rows[tier]))
    yield b
    yield r


def _memory_families(mem: Mapping[str, Any], kv: Mapping[str, Any]) -> Iterator[Metric]:
    if mem.get("budget") is not None:
        yield _gauge("segserve_memory_budget_bytes",
                     "Memory budget that admission and the guard work against",
                     float(mem["budget"]))
    if mem.get("peak") is not None:
        yield _gauge("segserve_memory_peak_bytes",
                     "Largest MLX memory in use since the server started", float(mem["peak"]))
    if mem.get("cache") is not None:
        yield _gauge("segserve_memory_cache_bytes",
                     "Freed MLX buffers kept for reuse (reclaimable; not counted in "
                     "segserve_memory_used_bytes or against the budget)", float(mem["cache"]))
    if mem.get("active") is None:
        return
    weights = int(mem.get("weights") or 0)
    segments = int(mem.get("bank") or 0)
    tail = int(kv.get("bytes", {}).get("tail", 0))
    used = {
        "weights": weights, "kv_segments": segments, "kv_tail": tail,
        "other": max(0, int(mem["active"]) - weights - segments - tail),
    }
    g = GaugeMetricFamily(
        "segserve_memory_used_bytes",
        "Memory in use by kind: weights, kv_segments (the bank's RAM tier), kv_tail "
        "(running requests' tails), other (activations, scratch; the rest of MLX active "
        "memory). The sum is what the budget is compared with",
        labels=["kind"],
    )
    for kind in MEMORY_KINDS:
        g.add_metric([kind], float(used[kind]))
    yield g


def _bank_families(bank: Mapping[str, Any]) -> Iterator[Metric]:
    if not bank:
        return
    g = GaugeMetricFamily("segserve_bank_bytes", "Session bank bytes by tier", labels=["tier"])
    for tier, v in bank.get("bytes_by_tier", {}).items():
        g.add_metric([tier], float(v))
    yield g
    yield _gauge("segserve_bank_sessions", "Sessions held by the bank",
                 float(bank.get("sessions", 0)))
    yield _gauge("segserve_bank_entries", "Turn snapshots held by the bank (all sessions)",
                 float(bank.get("entries", 0)))
    for name, key, label, doc in (
        ("segserve_bank_evictions", "evictions_by_reason", "reason", "Bank evictions"),
        ("segserve_bank_restores", "restores_by_tier", "tier", "Snapshots restored by tier"),
        ("segserve_bank_disk_faults", "disk_faults", "kind",
         "SSD tier faults: manifest_moved_aside, orphans_kept, write_failed, "
         "writer_job_failed, block_quarantined, spill_refused, disk_full_at_start"),
    ):
        c = CounterMetricFamily(name, doc, labels=[label])
        for k, v in bank.get(key, {}).items():
            c.add_metric([k], float(v))
        yield c
    for name, key, doc in (
        ("segserve_bank_spills", "spills", "Snapshots spilled to the SSD tier"),
        ("segserve_bank_quarantined_blocks", "quarantined_blocks", "Corrupt blocks set aside"),
        ("segserve_bank_lost_writes", "writes_lost", "Queued SSD writes lost at shutdown"),
    ):
        yield _counter(name, doc, float(bank.get(key, 0)))


class Metrics:
    def __init__(self, model_name: str = "default") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]

        # HTTP layer
        self.requests = Counter(
            "segserve_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r,
        )
        # Requests and tokens (vLLM's names where it has one, with its model_name label)
        self._hist: dict[HistogramKey, Histogram] = {
            key: _histogram(spec, r, model_name) for key, spec in _HISTOGRAMS.items()
        }
        self.cached = Counter(
            "segserve_cached_tokens",
            "Prompt tokens reused from stored KV (the sum of "
            "usage.prompt_tokens_details.cached_tokens)", m, registry=r,
        ).labels(model_name)
        self.prefilled = Counter(
            "segserve_prefill_tokens",
            "Prompt tokens computed by prefill (reused ones excluded; cancelled and failed "
            "requests included)", m, registry=r,
        ).labels(model_name)
        self._finished = finished = Counter(
            "segserve_requests_finished",
            "Requests that ended after admission, by finish reason (stop, length, abort = "
            "cancelled by the client)", m + ["finish_reason"], registry=r,
        )
        for reason in FINISH_REASONS:  # every series from the start, so rate() has a base
            finished.labels(model_name, reason)
        self.running_g = Gauge(
            "segserve_num_requests_running", "Requests admitted and running",
            m, registry=r,
        ).labels(model_name)
        self.waiting_g = Gauge(
            "segserve_num_requests_waiting", "Requests waiting for admission",
            m, registry=r,
        ).labels(model_name)
        # Bank / prefix reuse: every admission lookup, and the hits among them
        self._lookups = lookups = Counter(
            "segserve_bank_lookups", "KV lookups at admission by result (session, prefix, miss)",
            ["result"], registry=r,
        )
        for result in LOOKUP_RESULTS:
            lookups.labels(result)
        self.hits = Counter(
            "segserve_bank_hits",
            "KV lookups that reused stored rows (result session or prefix)", registry=r,
        )
        # Admission, guard, failures
        self.cancels = Counter("segserve_cancelled", "Requests cancelled by the client",
                               registry=r)
        self.admission = Counter(
            "segserve_admission_decisions", "Admission decisions", ["decision", "reason"],
            registry=r,
        )
        self.guard = Counter(
            "segserve_guard_interventions", "Memory guard interventions", ["reason"], registry=r
        )
        self.failures = Counter(
            "segserve_request_failures",
            "Requests ended by an unexpected error, by phase (admit, prefill, decode, "
            "sample, store, engine)",
            ["phase"], registry=r,
        )
        self.info = Info("segserve_settings", "Effective settings", registry=r)
        # process_* (CPU seconds, resident memory, open fds, start time; Linux) and python_info
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def set_state_source(self, source: StateSource) -> None:
        self.registry.register(_StateCollector(source))

    def set_settings(self, values: Mapping[str, Any]) -> None:
        self.info.info({k: str(v) for k, v in values.items() if k != "api_key"})

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- EngineObserver ----------------------------------------------------------------
    def waiting(self, n: int) -> None:
        self.waiting_g.set(n)

    def running(self, n: int) -> None:
        self.running_g.set(n)

    def prefilled_tokens(self, n: int) -> None:
        self.prefilled.inc(n)

    def cached_tokens(self, n: int) -> None:
        self.cached.inc(n)

    def first_token(self, seconds: float) -> None:
        self._hist["ttft"].observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._hist["itl"].observe(seconds)

    def request_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, seconds: float,
        per_output_token_s: float | None,
    ) -> None:
        self._finished.labels(self.model_name, reason).inc()
        self._hist["prompt"].observe(prompt_tokens)
        self._hist["generation"].observe(generation_tokens)
        self._hist["e2e"].observe(seconds)
        if per_output_token_s is not None:
            self._hist["tpot"].observe(per_output_token_s)

    def session_segments(self, n: int) -> None:
        self._hist["segments"].observe(n)

    def lookup(self, kind: str) -> None:
        self._lookups.labels(kind).inc()
        if kind != "miss":
            self.hits.inc()

    def cancelled(self) -> None:
        self.cancels.inc()
        self._finished.labels(self.model_name, "abort").inc()

    def decision(self, decision: str, reason: str) -> None:
        self.admission.labels(decision, reason).inc()

    def waited(self, seconds: float) -> None:
        self._hist["queue_wait"].observe(seconds)

    def intervention(self, reason: str) -> None:
        self.guard.labels(reason).inc()

    def request_failed(self, phase: str) -> None:
        self.failures.labels(phase).inc()

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

