"""The composition root: everything one server instance holds, built once from `Settings`.

Owns: `Runtime` (settings, loaded model, engine, metrics, start-up verdicts) and the one
public factory that wires them: `build_runtime(settings)` for the server, and
`make_engine(...)` for benchmarks and tests that bring their own model or store. Nothing
else constructs a `Scheduler`, `ModelRunner` or `Engine`. The HTTP layer never sees the
runtime: it is given `rt.serving` (`segserve.server.http.serving.Serving`: the engine client,
the prompt builder, the model card, metrics), and only the engine thread touches MLX after
start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from segserve.bank import Bank, BankError, bank_namespace
from segserve.bank.writer import release_free_heap
from segserve.config.launcher import apply_native_settings
from segserve.config.settings import Settings
from segserve.config.sizes import parse_memory_budget
from segserve.kernels import factory
from segserve.kernels.factory import ComposedRoute, current_backend
from segserve.kernels.hook import Route, install, support_check
from segserve.kernels.selfcheck import SelfCheckResult, check_owned, self_check
from segserve.kv.segmented import TAIL_STEP
from segserve.server.chat.template import load_template_file
from segserve.server.engine import Engine, EngineObserver, NullObserver
from segserve.server.engine.client import LocalEngineClient
from segserve.server.http.metrics import Metrics
from segserve.server.http.serving import KvMode, ModelCard, PromptBuilder, Serving
from segserve.server.runner import (
    KV_LAYOUT_VERSION,
    LoadedModel,
    MemoryMeter,
    ModelRunner,
    device_memory,
    load_model,
    stock_mode,
)
from segserve.server.runner.forward import Pipelining, configure_pipelining, decode_steps_pipelined
from segserve.server.scheduling import (
    Scheduler,
    SchedulerLimits,
    SnapshotStore,
    default_budget,
)
from segserve.server.spec import INDEX_BYTES_PER_TOKEN

log = logging.getLogger("segserve")

# Automatic RAM cap of the bank: a quarter of the memory available at start-up.
AUTO_BANK_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class KVVerdict:
    requested_mode: str
    mode: str  # what actually serves: "segmented" or "stock"
    supported: bool
    reason: str
    route: str
    self_check_ok: bool | None
    self_check_detail: str


@dataclass(eq=False)
class Runtime:
    settings: Settings
    loaded: LoadedModel
    engine: Engine
    metrics: Metrics
    kv: KVVerdict
    serving: Serving  # what the HTTP side is given
    meter: MemoryMeter | None = None  # the guard's reading (resets MLX's peak counter)
    kv_events: Any = None  # segserve.server.kv_events.KVEventPublisher with --kv-events-endpoint

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return self.serving.vocab_size

    def close(self) -> None:
        """After the engine thread stopped: flush the bank's queued SSD writes."""
        store = self.engine.store
        if isinstance(store, Bank):
            store.close(timeout=30.0)  # logs the writes it could not finish
        if self.kv_events is not None:  # after the bank's close: its last event is sent
            self.kv_events.close()


def vocab_size(loaded: LoadedModel) -> int:
    """Width of the logits: what token ids (`logit_bias`, prompts) must stay under."""
    return loaded.shape.vocab_size or loaded.tokenizer.vocab_size


def make_serving(
    settings: Settings, loaded: LoadedModel, engine: Engine, metrics: Metrics, kv: KVVerdict
) -> Serving:
    """The HTTP side's context: the engine behind its client, the prompt builder, the card."""
    vocab = vocab_size(loaded)
    card = ModelCard(
        id=loaded.model_id, source=loaded.source, quantization=loaded.quantization,
        context_length=loaded.context_length, vocab_size=vocab,
        kv_bytes_per_token=loaded.kv_bytes_per_token, sampling_defaults=loaded.sampling_defaults,
        batched_decode=_batched_health(loaded),
        kv=KvMode(kv.mode, kv.requested_mode, kv.supported, kv.reason, kv.route, kv.self_check_ok,
                  kv.self_check_detail),
    )
    return Serving(
        LocalEngineClient(engine), PromptBuilder(loaded.tokenizer, loaded.context_length, vocab),
        card, settings, metrics,
    )


def _batched_health(loaded: LoadedModel) -> dict[str, Any]:
    """Whether decode steps of several sessions share one forward pass, and why (not)."""
    from segserve.server.runner.batched import batch_verdict

    v = batch_verdict(loaded.decode)
    if v is None:
        return {"on": False, "reason": "not checked: the engine was built with batching off"}
    return {"on": v.ok, "reason": v.reason}


def choose_kv(settings: Settings, loaded: LoadedModel) -> tuple[KVVerdict, Route | None]:
    """Segmented or stock, and the attention route segmented caches will carry (None in
    stock mode). Runs the support check and the start-up self-check of the route."""
    requested = "segmented" if settings.segmented_kv else "stock"
    sup = support_check(loaded.model, loaded.shape)
    if not settings.segmented_kv:
        return KVVerdict(requested, "stock", sup.ok, sup.reason, "mlx-lm sdpa", None, "not run"), None
    if not sup.ok:
        log.warning("segmented KV unsupported for this model (%s): stock mode", sup.reason)
        return KVVerdict(requested, "stock", False, sup.reason, "mlx-lm sdpa", None, "not run"), None
    dtype = mx.float32 if loaded.kv_dtype == "float32" else getattr(mx, loaded.kv_dtype)
    choice = factory.select_route(
        current_backend(),
        head_dim=sup.head_dim,
        n_q_heads=sup.n_q_heads,
        n_kv_heads=sup.n_kv_heads,
        dtype=dtype,
        compile=settings.compile,
        options=factory.KernelOptions(settings.fused_wide, settings.fused_inflight, settings.cuda_sm_count,
                                      settings.fused_owned == "on"),
        softcap=sup.softcap,
    )
    # The CPU op and the CUDA kernels cap scores themselves; elsewhere only the composed
    # route does, whose host work per layer decoded a Gemma 2 9B shape at 0.67x stock on an
    # H200 (bench/families_gpu.py --families gemma2): stock mode is faster there.
    composed_slower = bool(sup.softcap) and current_backend() != "cpu"
    if composed_slower and choice.route.name == "composed":
        why = (f"attention logits are soft-capped ({sup.softcap:g}): on {current_backend()} only the "
               "composed route computes them, slower than stock mode")
        log.warning("segmented KV not used: %s", why)
        return KVVerdict(requested, "stock", True, why, "mlx-lm sdpa", None, "not run"), None

    def checked(route: Route) -> SelfCheckResult:
        return self_check(
            route,
            n_q_heads=sup.n_q_heads,
            n_kv_heads=sup.n_kv_heads,
            head_dim=sup.head_dim,
            dtype=dtype,
            query_dtype=getattr(mx, loaded.query_dtype) if loaded.query_dtype else None,
            windows=sup.windows,
            softcap=sup.softcap,
        )

    check = checked(choice.route)
    if check.ok:
        detail = check.detail
        if getattr(choice.route, "owned_launches", False):
            # Batched decode of sessions with histories of their own (`--fused-owned on`):
            # their launches are checked too; a disagreement keeps one call per history
            # (still segmented).
            owned = check_owned(choice.route, n_q_heads=sup.n_q_heads, n_kv_heads=sup.n_kv_heads,
                                head_dim=sup.head_dim, dtype=dtype)
            if not owned.ok:
                choice.route.owned_launches = False  # type: ignore[attr-defined]  # a FusedCudaRoute
                log.warning("owned launches off: %s", owned.detail)
            detail = f"{detail}; {owned.detail}" + ("" if owned.ok else " (one call per history)")
        return KVVerdict(requested, "segmented", True, sup.reason, choice.name, True, detail), choice.route
    # A fused route that disagrees with stock SDPA: the composed reference route keeps the
    # segments (slower, but a fork or a follow-up still shares them) when it agrees itself,
    # unless it is slower than stock mode (above).
    if choice.route.name != "composed" and not composed_slower:
        fallback = ComposedRoute(compiled=settings.compile)
        second = checked(fallback)
        if second.ok:
            detail = f"{choice.name} failed ({check.detail}); {second.detail}"
            log.warning("segment attention self-check of %s failed (%s): the composed route serves",
                        choice.name, check.detail)
            return KVVerdict(requested, "segmented", True, sup.reason, fallback.name, True, detail), fallback
    log.warning("segment attention self-check failed (%s): stock mode", check.detail)
    return KVVerdict(requested, "stock", True, sup.reason, choice.name, False, check.detail), None


def namespace_for(loaded: LoadedModel) -> str:
    """The bank's namespace: stored rows are reused only by the same model, weights,
    dtype, KV layout, tokenizer and chat template."""
    return bank_namespace(
        model=loaded.model_id,
        revision=loaded.revision,
        dtype=loaded.kv_dtype,
        quantization=loaded.quantization,
        kv_layout=KV_LAYOUT_VERSION,
        tokenizer=loaded.tokenizer.fingerprint,
        chat_template=loaded.tokenizer.fingerprint,
    )


def make_bank(settings: Settings, loaded: LoadedModel) -> Bank:
    """The session bank (the engine's snapshot store) from the settings: RAM cap, SSD
    tier, disk cap and floor, shared replica."""
    if settings.bank_max_bytes:
        cap = parse_memory_budget(settings.bank_max_bytes, what="SEGSERVE_BANK_MAX_BYTES")
    else:
        cap = int(device_memory().available_bytes * AUTO_BANK_FRACTION)
    disk = parse_memory_budget(settings.bank_disk_max_bytes, what="SEGSERVE_BANK_DISK_MAX_BYTES")
    floor = parse_memory_budget(
        settings.bank_min_free_disk, what="SEGSERVE_BANK_MIN_FREE_DISK", minimum=0
    )
    cold = settings.cold_tier_dir()
    try:
        return Bank.open(
            namespace_for(loaded), cap, cold, max_disk_bytes=disk, min_free_disk_bytes=floor,
            shared_replica=settings.bank_replica(),
        )
    except BankError as exc:  # e.g. the directory is locked by another running server
        raise BankError(
            f"{exc} (SEGSERVE_BANK_DIR / --bank-dir: give another directory, or 'none' "
            "for a RAM-only bank)"
        ) from exc


def transient_bytes_per_token(loaded: LoadedModel) -> int:
    """Activation scratch per prompt token of one prefill chunk (float32 upper bound):
    residual/norm/attention vectors and the MLP's gate/up/product. Attention scores are
    priced apart (`attention_pricing`): they depend on the backend and the route."""
    hidden = loaded.shape.hidden_size
    inter = loaded.shape.intermediate_size or 4 * hidden
    return 4 * (6 * hidden + 3 * inter)


def step_scratch_bytes(loaded: LoadedModel, plain_greedy: bool = False) -> int:
    """Per step, in float32 vocabulary rows: the logits row, its log-softmax and the
    sampler's two working copies (top-p sorts a copy; logprobs keep one), four rows; a
    plain greedy request (`segserve.server.engine.GenerationRequest.plain_greedy`) holds two, the
    logits and the float32 copy the sampler's argmax reads (`segserve.server.runner.sampling`)."""
    vocab = loaded.shape.vocab_size
    return (2 if plain_greedy else 4) * vocab * 4


@dataclass(frozen=True, slots=True)
class AttentionPricing:
    """What admission needs to price one attention call (`SchedulerLimits` fields)."""

    score_bytes_per_pair: int = 0  # per query-row x key-row pair
    key_tile_rows: int = 0  # 0 = untiled
    fixed_bytes: int = 0  # a fused route's workspace, whatever the history
    # The fused workspace as a function of the call (see `SchedulerLimits`); 0 = not given.
    ws_bytes_per_slot: int = 0
    ws_chunk_rows: int = 0
    ws_window_rows: int = 0
    ws_max_pieces: int = 0
    ws_wave_blocks: int = 0
    ws_kv_heads: int = 0


def attention_pricing(loaded: LoadedModel, chunk: int, route: Route | None) -> AttentionPricing:
    """How one attention call is priced.

    Segmented (`route` given): the route says. A fused route that holds no scores reports its
    workspace (`scratch_bytes`, and where it can, `workspace_terms` as a function of the
    call); the composed route holds float32 scores and their exponentials for all query
    heads, at most one key tile at a time (`segserve.kernels.composed.key_tile_rows`). Stock: MLX's
    CPU SDPA materializes scores and softmax for every key; on a GPU stock SDPA is fused and
    holds none.
    """
    from segserve.kernels.composed import key_tile_rows

    heads = loaded.shape.n_q_heads or 1
    kv_heads = loaded.shape.n_kv_heads or heads
    per_pair = 2 * heads * 4
    if route is not None:
        fixed = getattr(route, "scratch_bytes", None)
        if fixed is not None:
            terms = getattr(route, "workspace_terms", None)
            slot, rows, window, pieces, wave = (
                terms(heads, kv_heads, loaded.head_dim) if terms is not None else (0, 0, 0, 0, 0)
            )
            return AttentionPricing(0, 0, int(fixed(heads, kv_heads, loaded.head_dim, chunk)),
                                    slot, rows, window, pieces, wave, kv_heads)
        return AttentionPricing(per_pair, key_tile_rows(heads * chunk), 0)
    return AttentionPricing(per_pair if current_backend() == "cpu" else 0, 0, 0)


def make_limits(settings: Settings, loaded: LoadedModel, route: Route | None) -> SchedulerLimits:
    """The scheduler's numbers; segmented mode exactly when a route is given."""
    dev = device_memory()
    if settings.memory_budget:
        budget = parse_memory_budget(
            settings.memory_budget, device_total_bytes=dev.total_bytes, what="SEGSERVE_MEMORY_BUDGET"
        )
    else:
        # The weights are already resident, so "available" no longer includes them.
        budget = loaded.weights_bytes + default_budget(dev.total_bytes, dev.kind, dev.available_bytes)
    ceiling = int(dev.total_bytes * settings.dense_decode_ram_percent / 100)
    attn = attention_pricing(loaded, settings.prefill_chunk, route)
    spec = settings.speculative == "auto" and route is not None
    return SchedulerLimits(
        budget_bytes=budget,
        kv_bytes_per_token=loaded.kv_bytes_per_token,
        prefill_chunk_tokens=settings.prefill_chunk,
        prefill_transient_bytes_per_token=transient_bytes_per_token(loaded),
        dense_decode_ceiling_bytes=ceiling,
        max_queue=settings.max_queue,
        queue_timeout_s=settings.queue_timeout_s,
        segmented=route is not None,
        attention_score_bytes_per_pair=attn.score_bytes_per_pair,
        attention_key_tile_rows=attn.key_tile_rows,
        step_scratch_bytes=step_scratch_bytes(loaded),
        greedy_step_scratch_bytes=step_scratch_bytes(loaded, plain_greedy=True),
        attention_fixed_bytes=attn.fixed_bytes,
        attention_ws_bytes_per_slot=attn.ws_bytes_per_slot,
        attention_ws_chunk_rows=attn.ws_chunk_rows,
        attention_ws_window_rows=attn.ws_window_rows,
        attention_ws_max_pieces=attn.ws_max_pieces,
        attention_ws_wave_blocks=attn.ws_wave_blocks,
        attention_ws_kv_heads=attn.ws_kv_heads,
        tail_step_rows=TAIL_STEP if route is not None else 1,  # stock grows its own way
        # Speculation runs in segmented mode only (segserve.server.runner.runner).
        draft_tokens=settings.speculative_max_draft if spec else 0,
        draft_index_bytes_per_token=INDEX_BYTES_PER_TOKEN if spec else 0,
    )


def make_engine(
    settings: Settings,
    loaded: LoadedModel,
    store: SnapshotStore,
    observer: EngineObserver | None = None,
    *,
    route: Route | None,
    memory_in_use: Callable[[], int] = mx.get_active_memory,
    peak_memory: Callable[[], int] = mx.get_peak_memory,
) -> Engine:
    """Wire scheduler, runner and engine (not started). Segmented KV exactly when `route`
    is given (`choose_kv`, or `segserve.kernels.factory.select_route` in benchmarks and tests); the
    attention hook is installed on the model then."""
    if route is not None:
        install(loaded.model)
    limits = make_limits(settings, loaded, route)
    runner = ModelRunner(loaded, segmented=route is not None, route=route,
                         speculative=settings.speculative == "auto",
                         max_draft=settings.speculative_max_draft,
                         spec_max_batch=spec_max_batch(settings.speculative_max_batch),
                         pipeline_steps=decode_steps_pipelined(settings.pipeline_decode_steps))
    warm = warmup_batch(settings.warmup_batch)
    return Engine(
        runner,
        Scheduler(limits, loaded.weights_bytes, store, prefill_order=settings.prefill_order),
        observer=observer or NullObserver(),
        memory_in_use=memory_in_use,
        peak_memory=peak_memory,
        on_idle=release_cpu_memory,  # a finished request's freed heap goes back (CPU)
        warm_up=(lambda stopped: runner.warm_up(warm, settings.prefill_chunk, stopped)) if warm else None,
    )


def with_chat_template(loaded: LoadedModel, path: str | None) -> LoadedModel:
    """`--chat-template FILE` replaces the model's template (and its special tokens when
    the file names them). The bank's namespace hashes the template, so stored sessions of
    another template are never reused."""
    if path is None:
        return loaded
    t = load_template_file(Path(path).expanduser())
    tok = loaded.tokenizer
    tok = dataclasses.replace(
        tok,
        chat_template=t.source,
        bos_token=t.bos_token if t.bos_token is not None else tok.bos_token,
        eos_token=t.eos_token if t.eos_token is not None else tok.eos_token,
    )
    log.info("chat template from %s", t.origin)
    return dataclasses.replace(loaded, tokenizer=tok)


def attach_kv_events(settings: Settings, store: SnapshotStore) -> Any:
    """`--kv-events-endpoint`: publish the bank's block events (None when off)."""
    if not settings.kv_events_endpoint:
        return None
    if not isinstance(store, Bank):
        raise ValueError("--kv-events-endpoint needs the session bank as the snapshot store")
    try:
        from segserve.server.kv_events import attach
    except ImportError as exc:
        raise ValueError(
            f"--kv-events-endpoint needs pyzmq and msgspec (pip install 'segserve[kv-events]'): "
            f"{exc}"
        ) from None
    try:
        return attach(
            store, settings.kv_events_endpoint, token_ids=settings.kv_events_token_ids,
            allow_remote=settings.kv_events_allow_remote,
        )
    except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
        raise ValueError(f"--kv-events-endpoint {settings.kv_events_endpoint!r}: {exc}") from None


def spec_max_batch(setting: int) -> int:
    """`--speculative-max-batch`, 0 resolved for this backend (the setting says why)."""
    if setting:
        return setting
    return 2 if current_backend() == "cpu" else 32


def warmup_batch(setting: int | None) -> int:
    """`--warmup-batch`, unset resolved for this backend (the setting says why)."""
    if setting is not None:
        return setting
    return 0 if current_backend() == "cpu" else 32


def release_cpu_memory() -> None:
    """CPU only: MLX keeps no cache of freed buffers, and freed heap goes back to the system.
    Called before the model loads (so the loader's freed buffers are not cached) and once
    the start-up checks have run.

    Why: MLX caches freed buffers for reuse (it saves Metal allocations); on the CPU
    glibc's allocator already reuses memory, so the cache only held finished requests'
    buffers resident (~11 MB of RSS after the peer benchmark's requests, read off
    /proc in a one-off check). A 512-token prefill took the same time either way on the
    2-core CPU. `malloc_trim` returns what glibc keeps of freed buffers: the start-up
    checks' forward passes left ~80 MB of it resident on a 28-layer 0.4B model
    (`segserve.bank.writer.release_free_heap`)."""
    if current_backend() != "cpu":
        return
    mx.set_cache_limit(0)
    mx.clear_cache()
    release_free_heap()


def build_runtime(
    settings: Settings,
    *,
    loaded: LoadedModel | None = None,
    store: SnapshotStore | None = None,
    kv: tuple[KVVerdict, Route | None] | None = None,
    memory_in_use: Callable[[], int] | None = None,
) -> Runtime:
    """The server's runtime: model (loaded here unless given), KV mode and route
    (`choose_kv` unless given), bank, metrics and engine (not started). Tests and
    benchmarks pass what they bring: a tiny model, a RAM-only store, a fixed route, a
    fake memory reading."""
    # Before the model loads: the CPU extension reads its knobs at its first op.
    apply_native_settings(settings)
    configure_pipelining(Pipelining(settings.pipeline_layers, settings.pipeline_decode))
    release_cpu_memory()
    loaded = with_chat_template(loaded or load_model(settings), settings.chat_template)
    verdict, route = kv if kv is not None else choose_kv(settings, loaded)
    if route is None:
        loaded = stock_mode(loaded)  # its cache stores (and is priced at) another dtype
    metrics = Metrics(loaded.model_id)
    meter = MemoryMeter() if memory_in_use is None else None
    store = store or make_bank(settings, loaded)
    publisher = attach_kv_events(settings, store)
    engine = make_engine(
        settings, loaded, store, metrics, route=route,
        memory_in_use=meter or memory_in_use or mx.get_active_memory,
        # The meter keeps the process-wide peak (reading it resets MLX's own counter).
        peak_memory=(lambda: meter.peak) if meter is not None else mx.get_peak_memory,
    )
    release_cpu_memory()  # after the engine's start-up checks (batched decode against the forward)
    serving = make_serving(settings, loaded, engine, metrics, verdict)
    rt = Runtime(settings, loaded, engine, metrics, verdict, serving, meter=meter, kv_events=publisher)
    metrics.set_state_source(serving.engine.state)
    metrics.set_settings(settings.model_dump())
    return rt
