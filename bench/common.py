"""Shared helpers of the in-process benchmarks (`bench/followup.py`, `bench/resume.py`,
the direct-model loop of `bench/cpu_speed.py` and `bench/qmm_cpu.py`).

Owns: building the model under test (the embedded GGUF or a random-weight llama), an engine
over a given session store, one measured turn (`run_turn`), calls onto the engine thread
(`on_engine`), synthetic conversations (chat text or raw token ids), medians and ratios,
JSON output and a PNG plot helper. Nothing in the server imports this module.

How a turn is timed: the benches drive `segserve.server.engine.Engine` in-process (no HTTP, so no
SSE or socket time). Each event is stamped with `time.perf_counter()` on the engine thread
at the moment it is emitted (`TimedHandle`), so the hop to the asyncio collector is not
counted. TTFT = submit -> first `Token`; a decode step = the mean gap between `Token`s;
peak memory above the turn start = `mx.get_peak_memory()` after `Done` minus
`mx.get_active_memory()` taken right after `mx.reset_peak_memory()`, before the submit.
Only one request runs at a time, so these numbers belong to that turn alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

from segserve.bank import Bank
from segserve.config.settings import load_settings
from segserve.kernels import qmv_cuda
from segserve.kernels.factory import current_backend, select_route
from segserve.kernels.hook import Route, support_check
from segserve.server.engine import (
    Done,
    Engine,
    Event,
    Failed,
    GenerationRequest,
    NullObserver,
    RequestHandle,
    Started,
    Token,
)
from segserve.server.runner import (
    ChatTokenizer,
    LoadedModel,
    SamplingParams,
    apply_cpu_layout,
    kv_bytes_per_token,
    load_model,
    model_shape,
)
from segserve.server.runner.gpu_layout import fuse_projections
from segserve.server.runtime import make_engine, namespace_for

T = TypeVar("T")
UserChunk = str | tuple[int, ...]  # chat text (embedded model) or raw ids (random models)
MODELS = ("embedded", "random8l", "random8b", "random8b-q4", "tiny")
TURN_TIMEOUT_S = 1800.0  # one 8K cold prefill on a slow shared CPU stays well under this

# Random-weight llamas: "random8l" is the larger model of the follow-up issue; "tiny" is
# for the smoke test. Weights are scaled like tests/conftest.py's tiny model (x4) so that
# greedy choices are well separated and cannot flip on float rounding.
_RANDOM: dict[str, dict[str, Any]] = {
    "random8l": dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                     vocab_size=32000, max_position_embeddings=8192, scale=1.0),
    # The H200 model of the GPU benchmarks: a Llama-3-8B shape in bfloat16 (random weights, small
    # vocabulary: the head is not what is measured).
    "random8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=32000, max_position_embeddings=140000, scale=1.0,
                     dtype="bfloat16"),
    # The same shape with its linear layers in MLX's 4-bit affine format (group 64, bfloat16
    # scales): what a served mlx-community 4-bit model runs through on the GPU.
    "random8b-q4": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        vocab_size=32000, max_position_embeddings=140000, scale=1.0,
                        dtype="bfloat16", quantize=4),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 vocab_size=1024, max_position_embeddings=4096, scale=4.0),
}
_WORDS = (
    "memory segment tail snapshot river mountain lantern copper garden window violet harbor "
    "engine signal orbit ladder meadow thunder pocket silver marble canyon falcon compass "
    "winter quartz timber ember saddle beacon glacier velvet anchor cobalt prairie"
).split()


class BenchError(RuntimeError):
    """A turn failed or the engine broke: the benchmark cannot go on."""


# ---- model and engine ------------------------------------------------------------------
class _IdCodec:
    """Random models have no vocabulary: a token's text is its id."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return str(int(token_id)).encode()

    @property
    def backend(self) -> None:  # no `tokenizers` form: no constrained decoding
        return None


def load_bench_model(name: str, seed: int = 0, fuse: bool = True, small_qmm: bool = True) -> LoadedModel:
    """The model under test, with EOS disabled: every turn decodes exactly max_tokens
    tokens, so each measured turn has the same number of decode steps to time. `fuse`
    False: a random model on a GPU keeps mlx-lm's own layout (no fused projections), for
    mlx-lm's own loops and the A/B of the fusion. `small_qmm` False: quantized products of a
    few rows stay MLX's own on a GPU (the server's `--gpu-small-qmm off`), for its A/B."""
    if name == "embedded":
        loaded = load_model(load_settings({}, environ={}))
        tok = dataclasses.replace(loaded.tokenizer, eos_ids=frozenset())
        return dataclasses.replace(loaded, tokenizer=tok)
    if name not in _RANDOM:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    shape = dict(_RANDOM[name])
    scale = float(shape.pop("scale"))
    dtype_name = str(shape.pop("dtype", "float32"))
    bits = int(shape.pop("quantize", 0))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, **shape))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    if dtype_name != "float32":
        model.set_dtype(getattr(mx, dtype_name))  # lazy: never materialized in float32
    if bits:
        # Layer by layer, each evaluated as made: the bfloat16 copy of the whole model never
        # coexists with its quantized one.
        for layer in model.layers:
            mx.eval(layer.parameters())
            nn.quantize(layer, group_size=64, bits=bits)
            mx.eval(layer.parameters())
    mx.eval(model.parameters())
    if mx.default_device() == mx.cpu:
        apply_cpu_layout(model, model_shape(model))  # what load_model does on CPU: pre-transposed weights
    else:
        if fuse:
            fuse_projections(model)  # what load_model does on a GPU
        if small_qmm:
            qmv_cuda.install(model)  # likewise (`--gpu-small-qmm on`)
    dims = model_shape(model)
    tok = ChatTokenizer(_IdCodec(), "", frozenset(), "", "", dims.vocab_size)
    flat: Any = tree_flatten(model.parameters())  # [(name, array)]; its stub says str too
    weights = sum(int(v.nbytes) for _, v in flat)
    size = 2 if dtype_name != "float32" else 4
    return LoadedModel(model, tok, f"{name}-random", "random", f"seed{seed}", dtype_name,
                       dims, int(shape["max_position_embeddings"]), dtype_name,
                       kv_bytes_per_token(dims.num_layers, dims.n_kv_heads, dims.head_dim, size), weights)


def bench_route(loaded: LoadedModel) -> tuple[str, Route]:
    """The attention route the server would pick for this model, and its name."""
    sup = support_check(loaded.model, loaded.shape)
    if not sup.ok:
        raise BenchError(f"segmented KV cannot serve this model: {sup.reason}")
    dtype = getattr(mx, loaded.kv_dtype)
    choice = select_route(current_backend(), head_dim=sup.head_dim, n_q_heads=sup.n_q_heads,
                          n_kv_heads=sup.n_kv_heads, dtype=dtype, softcap=sup.softcap)
    return choice.name, choice.route


def model_info(loaded: LoadedModel, route: str) -> dict[str, Any]:
    return {
        "id": loaded.model_id, "quantization": loaded.quantization, "layers": loaded.num_layers,
        "kv_heads": loaded.n_kv_heads, "head_dim": loaded.head_dim, "kv_dtype": loaded.kv_dtype,
        "kv_bytes_per_token": loaded.kv_bytes_per_token, "weights_bytes": loaded.weights_bytes,
        "context_length": loaded.context_length, "route": route,
        "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", "?"),
    }


def bank_store(loaded: LoadedModel, max_bytes: int, cold_dir: Path | None = None) -> Bank:
    """The server's session bank, the engine's store; with `cold_dir`, an SSD tier there (no
    free-disk floor: the bench writes little and must not be refused on a nearly full
    scratch disk)."""
    return Bank.open(namespace_for(loaded), max_bytes, cold_dir, max_disk_bytes=64 << 30,
                     min_free_disk_bytes=0)


def start_engine(
    loaded: LoadedModel, store: Bank, *, segmented: bool, prefill_chunk: int
) -> Engine:
    """An engine built by the server's own factory (`segserve.server.runtime.make_engine`: same
    limits, scheduler and runner), no metrics; segmented mode carries the server's route."""
    settings = load_settings({"prefill_chunk": str(prefill_chunk)}, environ={})
    route = bench_route(loaded)[1] if segmented else None
    eng = make_engine(settings, loaded, store, NullObserver(), route=route)
    eng.start()
    return eng


# ---- one turn --------------------------------------------------------------------------
@dataclass(eq=False)
class TimedHandle(RequestHandle):
    """A request handle that stamps every event on the engine thread as it is emitted, with
    MLX's peak memory so far (the first token's peak is the prefill's)."""

    stamps: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    def emit(self, event: Event) -> None:
        self.stamps.append(time.perf_counter())
        self.peaks.append(mx.get_peak_memory())
        super().emit(event)


@dataclass(frozen=True, slots=True)
class TurnResult:
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    session_id: str | None
    ttft_s: float
    decode_step_s: float | None  # None with fewer than two tokens
    peak_above_start_bytes: int
    # The peak when the first token was emitted: prefill only (decode and the turn's seal,
    # merges included, come after it).
    prefill_peak_above_start_bytes: int

    def row(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "decode_step_s": self.decode_step_s,
                "peak_above_start_bytes": self.peak_above_start_bytes,
                "prefill_peak_above_start_bytes": self.prefill_peak_above_start_bytes,
                "cached_tokens": self.cached_tokens, "prompt_tokens": self.prompt_tokens,
                "tokens": self.tokens}


def greedy(prompt: Sequence[int], max_tokens: int, tag: str, *, session_id: str | None = None,
           salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(f"bench-{tag}", tuple(prompt), max_tokens,
                             SamplingParams(temperature=0.0), session_id=session_id, salt=salt)


def run_turn(engine: Engine, req: GenerationRequest) -> TurnResult:
    """Submit one request and wait for it; see the module docstring for what is timed."""

    async def go() -> tuple[list[Event], TimedHandle, float, int, int]:
        handle = TimedHandle(req, asyncio.get_running_loop())
        gc.collect()  # garbage from the last turn must not be freed inside this one
        mx.reset_peak_memory()
        start = mx.get_active_memory()
        t0 = time.perf_counter()
        engine.submit(handle)
        events: list[Event] = []
        while not events or not isinstance(events[-1], Done | Failed):
            events.append(await asyncio.wait_for(handle.queue.get(), TURN_TIMEOUT_S))
        return events, handle, t0, start, mx.get_peak_memory()

    events, handle, t0, start, peak = asyncio.run(go())
    stamps = handle.stamps
    if isinstance(events[-1], Failed):
        raise BenchError(f"turn {req.request_id} failed: {events[-1].error}")
    started = next(e for e in events if isinstance(e, Started))
    done = events[-1]
    assert isinstance(done, Done)
    times = [t for e, t in zip(events, stamps, strict=True) if isinstance(e, Token)]
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    if not times:
        raise BenchError(f"turn {req.request_id} produced no token")
    first_peak = next(p for e, p in zip(events, handle.peaks, strict=True) if isinstance(e, Token))
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return TurnResult(tokens, started.prompt_tokens, started.cached_tokens, done.session_id,
                      times[0] - t0, step, max(0, peak - start), max(0, first_peak - start))


def on_engine(engine: Engine, fn: Callable[[], T]) -> T:
    """Run `fn` on the engine thread (the bank is engine-thread only) and return its value."""

    async def go() -> T:
        result: T = await engine.call(fn)
        return result

    return asyncio.run(go())


# ---- conversations ---------------------------------------------------------------------
class ChatConversation:
    """Chat messages as an OpenAI client keeps them; every prompt re-renders the whole
    history through the model's chat template (assistant replies as decoded text), so a
    re-encoded reply may match the stored generated tokens only in part.

    `exact=True` is a client that keeps token ids instead: each reply's generated ids are
    spliced in where its text sits in the re-rendered prompt, so the stored history is
    always a whole prefix of the next prompt (no partial match inside a stored segment).
    """

    def __init__(self, tok: ChatTokenizer, seed: int = 0, *, exact: bool = False) -> None:
        self.tok = tok
        self.seed = seed
        self.exact = exact
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a concise assistant."}]
        self._ids: list[int] = []  # exact mode: ids through the last reply ...
        self._text = ""  # ... and the rendered text they stand for

    def user(self, n_tokens: int, key: str) -> UserChunk:
        rng = random.Random(f"{self.seed}/{key}")  # str seed: same text in every process
        words = " ".join(rng.choice(_WORDS) for _ in range(2 * n_tokens + 8))
        return self.tok.decode(self.tok.encode(f"Note {key}: {words}")[:n_tokens])

    def prompt(self, user: UserChunk) -> list[int]:
        assert isinstance(user, str)
        text = self.tok.render([*self.messages, {"role": "user", "content": user}])
        if self.exact and self._ids and text.startswith(self._text):
            return self._ids + self.tok.encode(text[len(self._text):])
        return self.tok.encode(text)

    def add(self, user: UserChunk, reply: Sequence[int]) -> None:
        assert isinstance(user, str)
        reply_text = self.tok.decode(reply)
        if self.exact:
            rendered = self.tok.render([*self.messages, {"role": "user", "content": user}])
            self._ids = self.prompt(user) + [int(t) for t in reply]
            self._text = rendered + reply_text
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": reply_text}]


class IdConversation:
    """Raw token ids for random-weight models: history = prompt + reply + next user ids."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.seed = seed
        self.history: list[int] = []

    def user(self, n_tokens: int, key: str) -> UserChunk:
        rng = random.Random(f"{self.seed}/{key}")
        return tuple(rng.randrange(4, self.vocab) for _ in range(n_tokens))

    def prompt(self, user: UserChunk) -> list[int]:
        assert isinstance(user, tuple)
        return self.history + list(user)

    def add(self, user: UserChunk, reply: Sequence[int]) -> None:
        self.history = self.prompt(user) + [int(t) for t in reply]


Conversation = ChatConversation | IdConversation


def new_conversation(loaded: LoadedModel, seed: int = 0, *, exact: bool = False) -> Conversation:
    if loaded.tokenizer.chat_template:
        return ChatConversation(loaded.tokenizer, seed, exact=exact)
    return IdConversation(loaded.tokenizer.vocab_size, seed)


def grow_to(
    conv: Conversation, target: int, *, chunk: int, reserve: int,
    step: Callable[[list[int]], list[int]], label: str,
) -> int | None:
    """Add turns (user chunk of <= `chunk` tokens -> `step` -> reply) until `reserve` more
    tokens would bring the prompt to about `target` (chat templates add a few per message).
    Returns the last prompt's length (reusable by the next turn), or None when no turn ran."""
    last: int | None = None
    turn = 0
    while True:
        have = len(conv.prompt(conv.user(0, "probe")))
        n = min(chunk, target - reserve - have)
        if n < 8:  # close enough: a tiny turn would add a segment and measure nothing
            return last
        user = conv.user(n, f"{label}-{turn}")
        prompt = conv.prompt(user)
        conv.add(user, step(prompt))
        last, turn = len(prompt), turn + 1
        log(f"{label}: grew to {len(prompt)} prompt tokens")


# ---- numbers and output ----------------------------------------------------------------
def prefill_decode(loaded: LoadedModel, prompt_tokens: int, decode_tokens: int,
                   chunk: int = 256) -> dict[str, Any]:
    """The direct-model timing loop of bench/cpu_speed.py and bench/qmm_cpu.py (no engine):
    prefill a synthetic `prompt_tokens` prompt in `chunk`-token pieces, then decode
    `decode_tokens` greedy tokens at that context, each step evaluated alone. Returns
    prefill tok/s, decode tok/s (1 / median step) and the greedy tokens."""
    from segserve.kernels.hook import install
    from segserve.kv.segmented import SegmentedCache
    from segserve.server.runner import logits_last

    install(loaded.model)
    route = select_route("cpu", head_dim=loaded.head_dim, n_q_heads=9, n_kv_heads=3, dtype=mx.float32).route
    prompt = [(7 * i) % 5000 + 10 for i in range(prompt_tokens)]
    cache = SegmentedCache(loaded.num_layers, route=route)
    logits: Any = None
    t = time.perf_counter()
    for s in range(0, prompt_tokens, chunk):
        logits = logits_last(loaded.model, prompt[s : s + chunk], cache.layers)
        mx.eval(logits)
        cache.record_tokens(prompt[s : s + chunk])
    prefill = time.perf_counter() - t
    cache.seal()
    steps, tokens = [], []
    for _ in range(decode_tokens):
        tok = int(mx.argmax(logits).item())  # type: ignore[arg-type]  # item() of a 0-d integer array
        tokens.append(tok)
        t = time.perf_counter()
        logits = logits_last(loaded.model, [tok], cache.layers)
        mx.eval(logits)
        steps.append(time.perf_counter() - t)
        cache.record_tokens([tok])
    return {"prefill_tok_s": prompt_tokens / prefill, "decode_tok_s": 1.0 / statistics.median(steps),
            "tokens": tokens}


def median(values: Sequence[float | int | None]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    return a / b if a is not None and b else None


def summarize(runs: Sequence[TurnResult]) -> dict[str, Any]:
    """Medians over repeats, plus every run as measured."""
    return {
        "ttft_s": median([r.ttft_s for r in runs]),
        "decode_step_s": median([r.decode_step_s for r in runs]),
        "peak_above_start_bytes": median([r.peak_above_start_bytes for r in runs]),
        "prefill_peak_above_start_bytes": median([r.prefill_peak_above_start_bytes for r in runs]),
        "cached_tokens": [r.cached_tokens for r in runs],
        "runs": [r.row() for r in runs],
    }


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the JSON report."""
    print(message, file=sys.stderr, flush=True)


def exit_now(code: int) -> NoReturn:
    """End a finished bench process without C++ static destructors: MLX 0.32.4 used from a
    sub-thread (the engine thread) sometimes aborts at exit ("terminate called without an
    active exception", mlx issue #3126), which would turn a good run's exit code into 134.
    Everything worth keeping is written and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cpu_model() -> str:
    """The CPU's model name and the SIMD flags the kernels pick their bodies by."""
    name, flags = platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == platform.machine():
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                             "avx512_vnni", "amx_int8") if f in have)
    except OSError:
        pass
    return f"{name} ({flags})" if flags else name


def emit_json(report: dict[str, Any], path: str | None) -> None:
    text = json.dumps(report, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)


def plot_panels(
    path: str, x: Sequence[float], xlabel: str,
    panels: Sequence[tuple[str, Mapping[str, Sequence[float | None]]]], title: str,
) -> None:
    """One PNG, one panel per (ylabel, {series name: y values}), shared x axis.
    Figure + Agg canvas directly: no pyplot global state, no display needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (ylabel, series) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for name, ys in series.items():
            pts = [(xv, yv) for xv, yv in zip(x, ys, strict=True) if yv is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
