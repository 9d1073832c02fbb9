"""Prometheus metrics: the only module that imports prometheus_client.

Owns: `Metrics` (a registry per server instance, so tests can run several), which
implements `server.engine.EngineObserver` for the engine thread and exposes recorders
for the HTTP layer. Gauges that mirror state owned elsewhere (KV segments, bank bytes,
memory) are read at scrape time through `set_state_source`, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

StateSource = Callable[[], Mapping[str, Any]]


class _StateCollector(Collector):
    """Turns the engine's state snapshot into gauges/counters at scrape time."""

    def __init__(self, source: StateSource) -> None:
        self._source = source

    def collect(self) -> Any:
        st = self._source()
        yield from _kv_families(st.get("kv", {}))
        yield from _memory_families(st.get("memory", {}))
        yield from _bank_families(st.get("bank", {}))


def _kv_families(kv: Mapping[str, Any]) -> Any:
    g = GaugeMetricFamily("segserve_kv_segments", "Live KV segments (distinct, all sessions)")
    g.add_metric([], float(kv.get("live_segments", 0)))
    yield g
    c = CounterMetricFamily("segserve_kv_seals", "Tails sealed into segments")
    c.add_metric([], float(kv.get("seals", 0)))
    yield c
    m = CounterMetricFamily("segserve_kv_merges", "Tiered merges of small segments")
    m.add_metric([], float(kv.get("merges", 0)))
    yield m
    b = GaugeMetricFamily("segserve_kv_bytes", "KV bytes by kind", labels=["kind"])
    for kind, v in kv.get("bytes", {}).items():
        b.add_metric([kind], float(v))
    yield b


def _memory_families(mem: Mapping[str, Any]) -> Any:
    g = GaugeMetricFamily("segserve_memory_bytes", "Memory by kind", labels=["kind"])
    for kind, v in mem.items():
        if v is not None:
            g.add_metric([kind], float(v))
    yield g


def _bank_families(bank: Mapping[str, Any]) -> Any:
    if not bank:
        return
    g = GaugeMetricFamily("segserve_bank_bytes", "Session bank bytes by tier", labels=["tier"])
    for tier, v in bank.get("bytes_by_tier", {}).items():
        g.add_metric([tier], float(v))
    yield g
    e = GaugeMetricFamily("segserve_bank_entries", "Sessions held by the bank")
    e.add_metric([], float(bank.get("entries", 0)))
    yield e
    for name, key, label, doc in (
        ("segserve_bank_lookups", "lookups", "result", "Bank lookups by result"),
        ("segserve_bank_evictions", "evictions_by_reason", "reason", "Bank evictions"),
        ("segserve_bank_restores", "restores_by_tier", "tier", "Snapshots restored by tier"),
        ("segserve_bank_disk_faults", "disk_faults", "kind",
         "SSD tier faults: manifest_moved_aside, orphans_kept, write_failed, "
         "writer_job_failed, block_quarantined"),
    ):
        c = CounterMetricFamily(name, doc, labels=[label])
        for k, v in bank.get(key, {}).items():
            c.add_metric([k], float(v))
        yield c
    for name, key, doc in (
        ("segserve_bank_spills", "spills", "Snapshots spilled to the SSD tier"),
        ("segserve_bank_quarantined_blocks", "quarantined_blocks", "Corrupt blocks set aside"),
        ("segserve_bank_lost_writes", "lost_writes", "Queued SSD writes lost at shutdown"),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(bank.get(key, 0)))
        yield c


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "segserve_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.prompt = Counter("segserve_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.cached = Counter(
            "segserve_cached_tokens",
            "Prompt tokens reused (the sum of usage.prompt_tokens_details.cached_tokens)",
            registry=r,
        )
        self.generated = Counter("segserve_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "segserve_time_to_first_token_seconds", "Time to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "segserve_inter_token_latency_seconds", "Time between tokens",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.running_g = Gauge("segserve_requests_running", "Requests running", registry=r)
        self.waiting_g = Gauge("segserve_requests_waiting", "Requests waiting", registry=r)
        self.lookups = Counter("segserve_session_lookups", "Store lookups", ["kind"], registry=r)
        self.cancels = Counter("segserve_cancelled", "Requests cancelled", registry=r)
        self.admission = Counter(
            "segserve_admission_decisions", "Admission decisions", ["decision", "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "segserve_queue_wait_seconds", "Time waiting for memory",
            buckets=_LATENCY_BUCKETS, registry=r,
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

    def prompt_tokens(self, n: int) -> None:
        self.prompt.inc(n)

    def cached_tokens(self, n: int) -> None:
        self.cached.inc(n)

    def generated_tokens(self, n: int) -> None:
        self.generated.inc(n)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def lookup(self, kind: str) -> None:
        self.lookups.labels(kind).inc()

    def cancelled(self) -> None:
        self.cancels.inc()

    def decision(self, decision: str, reason: str) -> None:
        self.admission.labels(decision, reason).inc()

    def waited(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def intervention(self, reason: str) -> None:
        self.guard.labels(reason).inc()

    def request_failed(self, phase: str) -> None:
        self.failures.labels(phase).inc()

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
