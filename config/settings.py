"""The one typed settings object, read once at start-up.

Owns: `Settings` (frozen pydantic model), the `SEGSERVE_*` environment reading and the
`serve` CLI flags. Nothing else in the code base reads `os.environ`; `main()` builds a
`Settings` and passes it down explicitly.

Precedence: CLI flag > `SEGSERVE_<NAME>` environment variable > default.
Booleans accept only true/false/1/0 (case-insensitive); sizes (`64MB`, `8GiB`, `40%`) are
parsed here, before anything heavy runs; every error is one line naming the flag or the
variable the value actually came from (`--memory-budget` or `SEGSERVE_MEMORY_BUDGET`).
The prefix is `SEGSERVE_`, not the bare service name, so Kubernetes' injected
`<SERVICE>_PORT`-style variables for a service called "segserve" cannot collide.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from segserve.config.launcher import REEXEC_MARK

ENV_PREFIX = "SEGSERVE_"
# Every SEGSERVE_ variable the settings loader passes over: the launcher's mark.
_NOT_SETTINGS = frozenset({REEXEC_MARK})
# Settings that the CPU extension (kernels/native) reads from its own variables when it
# first runs an op: segserve.config.launcher.apply_native_settings exports them before the model loads.
NATIVE_KNOBS = {
    "segattn_isa": "SEGATTN_ISA", "segattn_threads": "SEGATTN_THREADS", "qmm_isa": "QMM_ISA",
    "qmm_threads": "QMM_THREADS", "qmm_spin_us": "QMM_SPIN_US", "qmm_gemm_min_rows": "QMM_GEMM_MIN_ROWS",
    "qmm_x8": "QMM_X8",
}
_AUTO_NONE = ("max_connections", "fused_inflight", "cuda_sm_count", *NATIVE_KNOBS)
# A replica id names a directory (segserve.bank.shared.REPLICA_ID checks the same).
_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SettingsError(ValueError):
    """A setting could not be parsed; the message names the key."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind.")
    model: str | None = Field(
        None,
        description="GGUF file, mlx-lm model directory or hub id; unset: the embedded "
        "SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Model id reported by /v1/models (default: derived from --model)."
    )
    api_key: str | None = Field(
        None,
        description="Require 'Authorization: Bearer KEY' on every endpoint but a minimal "
        "/health. A key given as a flag is visible to other local users (ps, /proc): prefer "
        "the SEGSERVE_API_KEY variable or --api-key-file.",
    )
    api_key_file: str | None = Field(
        None,
        description="File of API keys, one per line: 'KEY' (the shared default tenant) or "
        "'TENANT KEY' (a tenant of its own: its sessions and cache are apart); '#' starts a "
        "comment. Combines with --api-key.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve on an address beyond loopback (--host) with no API key. Without "
        "it, such a server refuses to start: anyone who can reach the address could use it.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template file to use instead of the model's: a jinja file, or a "
        "JSON string / tokenizer_config.json (its chat_template, bos_token, eos_token). "
        "Checked at start-up.",
    )
    tool_parser: str = Field(
        "auto",
        description="Tool-call markup to parse (and force with tool_choice): auto = detect "
        "from the chat template (hermes when it shows none), or hermes, qwen, qwen2_5, "
        "qwen3, llama3_json, llama3, llama.",
    )
    tool_prompt: Literal["auto", "none"] = Field(
        "auto",
        description="Tools for a chat template that does not present them (the embedded "
        "model's): auto = a system block listing them in Hermes syntax (<tools>, answers in "
        "<tool_call>); none = tools are left out of the prompt (logged).",
    )
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3"] = Field(
        "auto",
        description="Split a reasoning model's thinking (<think>...</think>) from its answer "
        "(message.reasoning_content, Responses reasoning items): auto = from the chat "
        "template (one that mentions <think> gets qwen3 when thinking is switchable or the "
        "template is ChatML, else deepseek_r1); none = the thinking stays in the content.",
    )
    cors_allow_origins: str | None = Field(
        None,
        description="Comma-separated origins allowed by CORS ('*' for any); unset: no CORS "
        "headers.",
    )
    segmented_kv: bool = Field(
        True, description="Segmented KV memory (true) or mlx-lm's contiguous cache (false)."
    )
    weights: Literal["auto", "float32", "q4", "q8", "quantized"] = Field(
        "auto",
        description="Weight format at load: q4/q8 = 4/8-bit affine weights, on CPU through "
        "the quantized matmul extension (kernels/native); float32 = dequantized + BLAS; "
        "quantized = the file's quantization through MLX's own kernels. auto = q4 on CPU "
        "where the extension is built (else float32), quantized elsewhere. Where the "
        "extension is missing or fails its start-up self-check, q4/q8 run on MLX's own "
        "(slow) kernels, with the reason logged.",
    )
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="Sampling defaults for requests that leave a field out: auto = the "
        "model's own (generation_config.json of an mlx-lm directory: temperature, top_p, "
        "top_k, min_p, repetition_penalty); none = the OpenAI defaults (temperature 1, "
        "filters off). A value in the request always wins.",
    )
    cpu_layout: bool = Field(
        True, description="CPU: store float32 weights pre-transposed (2x decode; +head copy)."
    )
    cpu_native_layers: bool = Field(
        True, description="CPU, 4/8-bit weights through the extension: each decode layer "
        "outside attention runs as two native ops (kernels/native block_op) instead of ~70 "
        "MLX ops; false keeps MLX's ops (for comparison).",
    )
    compile: bool = Field(True, description="mx.compile the decode attention route.")
    pipeline_layers: int = Field(
        4, ge=0, le=1024,
        description="GPU: layers of a prefill chunk between asynchronous evaluations (the GPU "
        "starts while the host builds the next layers); 0 = one evaluation per forward.",
    )
    pipeline_decode: bool = Field(
        False, description="GPU: pipeline decode steps too (--pipeline-layers per evaluation).",
    )
    pipeline_decode_steps: Literal["auto", "on", "off"] = Field(
        "auto", description="Build each decode step on the previous step's lazy tokens while "
        "that step computes (tokens stream one step behind); grammar, logprob, logits-"
        "processor, n > 1 and speculative requests decode step by step. auto = on on a GPU "
        "(an 8B model on an H100: 1.39x decode at one session, 1.04x at eight), off on the "
        "CPU (measured no faster there).",
    )
    warmup_batch: int | None = Field(
        None, ge=0, le=1024,
        description="Before serving, run one decode step at every batch size 1..N (sessions "
        "sharing a history and sessions with their own) and a prefill chunk, so that MLX's "
        "graphs and GPU kernels for those shapes are compiled before the first request "
        "(/health says ready once done). Unset = auto: 32 on a GPU, where an unseen batch size "
        "cost a step 0.07-2.8 s through the server (an 8B model on an H100), 0 (off) on the CPU.",
    )
    fused_wide: Literal["paired", "single", "off"] = Field(
        "paired",
        description="GPU fused attention, prefill chunks: paired = two query windows per "
        "block (where its start-up check passes), single = one window per block, off = the "
        "narrow decode kernel (the last two for comparison).",
    )
    fused_owned: Literal["on", "off"] = Field(
        "on",
        description="GPU batched decode: on = sessions whose histories differ share attention "
        "launches (each block reads its own session's segments; checked against SDPA at "
        "start-up, off where the check disagrees; an 8B model on an H200, 32 sessions of "
        "their own 2K histories: 1,502 tok/s against 339), off = one attention call per "
        "history and layer.",
    )
    gpu_small_qmm: Literal["on", "off"] = Field(
        "on",
        description="GPU, 4/8-bit weights: on = products of 2-7 rows (batched decode of a few "
        "sessions, verify windows) in one pass over the weights (segserve.kernels.qmv_cuda), more "
        "rows handed to MLX's op as one matrix; off = MLX's own quantized matmul as the model "
        "calls it (its GEMM from two rows on; a decode batch as one-row products).",
    )
    fused_inflight: int | None = Field(
        None, ge=0, le=64,
        description="GPU fused attention: prefill calls queued on the GPU at once (auto = 2; "
        "0 = unpaced).",
    )
    cuda_sm_count: int | None = Field(
        None, ge=1, le=4096,
        description="GPU: streaming multiprocessors the fused kernel's launch planner fills "
        "(auto = read from the device through the CUDA driver, else 132, an H200's).",
    )
    segattn_isa: Literal["avx512", "avx2", "generic"] | None = Field(
        None, description="CPU fused attention kernel body (auto = the widest this CPU runs)."
    )
    segattn_threads: int | None = Field(
        None, ge=1, le=1024, description="CPU fused attention: threads one op uses (auto = min(2, cores))."
    )
    qmm_isa: Literal["avx512", "avx2", "generic"] | None = Field(
        None, description="CPU quantized matmul kernel body (auto = the widest this CPU runs)."
    )
    qmm_threads: int | None = Field(
        None, ge=1, le=1024, description="CPU quantized matmul: threads (auto = min(2, cores))."
    )
    qmm_spin_us: int | None = Field(
        None, ge=0, le=1_000_000,
        description="CPU quantized matmul: microseconds a worker spins for the next job "
        "before it sleeps (auto = 50; 0 = never spins).",
    )
    qmm_gemm_min_rows: int | None = Field(
        None, ge=2, le=1_000_000,
        description="CPU quantized matmul: rows from which the packed-panel GEMM serves a "
        "product instead of the register-tile paths (auto = 24).",
    )
    qmm_x8: Literal["on", "off"] | None = Field(
        None, description="CPU quantized matmul: products of Q6_K weights round x to 8 bits (per "
        "256 values in decode rows, per 32 in prefill) and use integer dot products, as llama.cpp "
        "does (decode 1.0-1.4x per product, prefill ~2.2x; about 0.5-1 % of the output's scale "
        "per product); on: 4-bit and "
        "8-bit weights too (prefill 1.7-2.3x; the embedded model's perplexity +0.2-0.3 %); off: "
        "x stays float32 everywhere. auto: Q6_K; a GGUF whose main type is Q4_K, Q5_K, Q6_K or "
        "Q8_0 as on (llama.cpp's arithmetic for those files); Q4_0/Q4_1/Q5_x files and mlx-lm "
        "directories keep float x.",
    )
    speculative: Literal["auto", "off"] = Field(
        "off", description="Speculative decoding from the conversation's own tokens: an "
        "n-gram index of each sealed segment and of the running turn proposes the tokens "
        "that followed the best-agreeing match, verified in one forward (greedy output identical, "
        "sampled output keeps the model's distribution). auto = on for segmented KV in "
        "decode steps of up to --speculative-max-batch sessions, each session (each of n "
        "choices, with or without a grammar or logits processors) "
        "drafting from its own recent acceptance (down to no drafts); a window of 1 + K rows runs through the decode step's layers with its "
        "rows as the batch (on the CPU 1.7-4.1 decode steps for K = 1..8); admission prices "
        "a request that may speculate for a full window's step scratch and its draft "
        "index, and starts one that fits only without them without drafts. off (the default) = never.",
    )
    speculative_max_draft: int = Field(
        8, ge=1, le=32, description="Most draft tokens verified in one speculative step.",
    )
    speculative_max_batch: int = Field(
        0, ge=0, le=1024, description="Most sessions in a decode step that still verifies "
        "drafts (every row its own window, in one forward); a larger step decodes plainly. "
        "0 = auto: 2 on the CPU, where 4 sessions verifying 5-row windows together cost 3.5x "
        "their plain step (2 cores), more than the drafts' ~0.5 acceptance gives back; 32 on a "
        "GPU, where the same cost 1.15x (an 8B model on an H100).",
    )
    prefill_order: Literal["shortest", "round-robin"] = Field(
        "shortest",
        description="Which prompt gets each step's prefill chunk. shortest = the one with the "
        "fewest prompt tokens left (every 4th chunk to the oldest prompt, so a long one keeps "
        "advancing): a burst of prompts ends one after another and a short prompt never waits "
        "behind a long one; round-robin = prompts take turns chunk by chunk (each prompt of a "
        "burst waits for nearly all the others).",
    )
    prefill_chunk: int = Field(
        256, ge=16, le=8192, description="Prompt tokens per prefill step (chunked prefill)."
    )
    max_tokens_default: int = Field(
        512, ge=1, description="max_tokens when a request gives none (capped by the context)."
    )
    max_request_bytes: int = Field(
        4_000_000, ge=1024,
        description="Largest accepted request body in bytes (413 above, checked from "
        "Content-Length and while reading).",
    )
    header_timeout: float = Field(
        10.0, gt=0, le=3600,
        description="Seconds a connection may take to send a request's headers (idle "
        "keep-alive time included) before it is closed.",
    )
    body_timeout: float = Field(
        30.0, gt=0, le=3600,
        description="Seconds a client may take to send a request body (408 after).",
    )
    max_connections: int | None = Field(
        None, ge=16,
        description="Open connections at most; past it the oldest connection still waiting "
        "for a request is closed. auto = what the open-file limit leaves (limit - listen "
        "backlog - 256).",
    )
    memory_budget: str | None = Field(
        None, description="KV memory budget: bytes, e.g. 64MB, 8GiB, or 40% of device memory."
    )
    dense_decode_ram_percent: float = Field(
        15.0, gt=0, le=100, description="Stock mode: largest contiguous slab, % of memory."
    )
    bank_max_bytes: str | None = Field(
        None, description="RAM tier cap of the session bank (default: from free memory)."
    )
    bank_dir: str = Field(
        "auto",
        description="SSD cold tier directory, where sessions survive restarts: auto = "
        "$XDG_CACHE_HOME/segserve/bank (else ~/.cache/segserve/bank); none = RAM only.",
    )
    bank_disk_max_bytes: str = Field("8GiB", description="Cold tier disk cap.")
    bank_shared: bool = Field(
        False,
        description="The --bank-dir directory is shared by several replicas (one shared SSD "
        "tier): a replica restores what another stored, e.g. after it died. Each replica "
        "keeps its manifest and lock in DIR/replicas/<replica id>/.",
    )
    bank_replica_id: str | None = Field(
        None,
        description="This replica's id in a shared --bank-dir (letters, digits, '.', '_', "
        "'-'); default: HOSTNAME-PORT, so two replicas on one machine never collide.",
    )
    bank_min_free_disk: str = Field(
        "1GiB", description="Never write to the cold tier below this much free disk (0 = no floor)."
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="Publish the bank's KV block events for KV-aware routers (vLLM's format: "
        "ZeroMQ PUB, msgpack) at this endpoint, e.g. tcp://*:5557 (bound; tcp://HOST:PORT "
        "connects); replay requests at the port + 1. Unset: off. Needs pyzmq and msgspec "
        "(the kv-events extra). Neither socket authenticates: see --kv-events-allow-remote.",
    )
    kv_events_token_ids: bool = Field(
        False,
        description="Put each stored block's token ids in the KV events (and replay): the "
        "prompts, readable by every subscriber. Off: block hashes only (empty token_ids).",
    )
    kv_events_allow_remote: bool = Field(
        False,
        description="Accept KV-event sockets listening beyond loopback (tcp://*:PORT, or a "
        "replay socket on a non-loopback address) although an --api-key-file names tenants; "
        "without this such a server refuses to start (without tenants it logs a warning).",
    )
    max_queue: int = Field(64, ge=0, description="Requests allowed to wait for memory.")
    queue_timeout_s: float = Field(
        30.0, gt=0, description="Longest wait for memory before a 503."
    )
    blas: Literal["auto", "blis", "openblas", "none"] = Field(
        "auto",
        description="Linux CPU: BLAS to preload (auto = BLIS, else OpenBLAS, when installed).",
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, le=3600,
        description="On SIGTERM/SIGINT: seconds in-flight requests get to finish before "
        "they are ended with an error.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    def cors_origins(self) -> tuple[str, ...]:
        """`--cors-allow-origins` as a list; empty: CORS is off."""
        raw = self.cors_allow_origins or ""
        return tuple(o.strip() for o in raw.split(",") if o.strip())

    @field_validator(*_AUTO_NONE, mode="before")
    @classmethod
    def _auto_connections(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() == "auto" else v

    @field_validator("bank_dir")
    @classmethod
    def _bank_dir(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("empty; give a directory, 'auto' or 'none'")
        return v.lower() if v.lower() in ("auto", "none") else v

    @field_validator("bank_replica_id")
    @classmethod
    def _replica_id(cls, v: str | None) -> str | None:
        if v is not None and not _REPLICA_ID.fullmatch(v):
            raise ValueError(f"{v!r}: use 1-128 letters, digits, '.', '_' or '-'")
        return v

    def bank_replica(self) -> str | None:
        """This replica's id in a shared SSD tier; None when the tier is not shared."""
        if not self.bank_shared:
            return None
        if self.bank_replica_id is not None:
            return self.bank_replica_id
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()).lstrip("._-") or "host"
        # Port 0 binds a random port: the process id keeps two such replicas apart.
        return f"{host[:100]}-{self.port or f'pid{os.getpid()}'}"

    def cold_tier_dir(self) -> Path | None:
        """The SSD tier's directory, or None for `--bank-dir none` (RAM only)."""
        if self.bank_dir == "none":
            return None
        if self.bank_dir == "auto":
            return default_bank_dir(os.environ)
        return Path(self.bank_dir).expanduser()


def default_bank_dir(environ: Mapping[str, str]) -> Path:
    """Per-user cache directory (XDG base directory spec): relative XDG paths are ignored."""
    xdg = environ.get("XDG_CACHE_HOME", "")
    if xdg and Path(xdg).is_absolute():
        base = Path(xdg)
    elif environ.get("HOME"):
        base = Path(environ["HOME"]) / ".cache"
    else:
        base = Path.home() / ".cache"
    return base / "segserve" / "bank"


_BOOL_TRUE = {"true", "1"}
_BOOL_FALSE = {"false", "0"}


def _parse_bool(key: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _BOOL_TRUE:
        return True
    if low in _BOOL_FALSE:
        return False
    raise SettingsError(f"{key}: expected true/false/1/0, got {raw!r}")


def _field_is_bool(name: str) -> bool:
    return Settings.model_fields[name].annotation is bool


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The settings given as `SEGSERVE_*` variables (unknown SEGSERVE_ keys are errors)."""
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _NOT_SETTINGS:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in Settings.model_fields:
            raise SettingsError(f"{key}: unknown setting")
        out[name] = _parse_bool(key, raw) if _field_is_bool(name) else raw
    return out


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, documented from the field description."""
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        default = "auto" if name in _AUTO_NONE else info.default
        help_text = f"{info.description} [env {env}; default {default!r}]".replace("%", "%%")
        parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def load_settings(
    cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Build the settings from CLI values (None = not given) over the environment.

    Every error is a `SettingsError` naming the flag or variable the bad value came from."""
    env = os.environ if environ is None else environ
    values = env_overrides(env)
    sources = {name: ENV_PREFIX + name.upper() for name in values}
    for name, raw in (cli or {}).items():
        if raw is None or name not in Settings.model_fields:
            continue
        values[name] = _parse_bool(flag_of(name), str(raw)) if _field_is_bool(name) else raw
        sources[name] = flag_of(name)
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else ""
        key = sources.get(name, ENV_PREFIX + name.upper()) if name else "settings"
        raise SettingsError(f"{key}: {first['msg'].removeprefix('Value error, ')}") from exc
    _check_sizes(settings, sources)
    if settings.bank_shared and settings.bank_dir == "none":
        key = sources.get("bank_shared", flag_of("bank_shared"))
        raise SettingsError(f"{key}: a shared SSD tier needs a --bank-dir, not 'none'")
    if settings.bank_dir == "auto":  # resolved once, from the same environment
        settings = settings.model_copy(update={"bank_dir": str(default_bank_dir(env))})
    return settings


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def label_of(name: str, cli: Mapping[str, Any] | None, environ: Mapping[str, str]) -> str:
    """How the user gave setting `name`: its flag, its variable, or its flag (default)."""
    if cli and cli.get(name) is not None:
        return flag_of(name)
    if ENV_PREFIX + name.upper() in environ:
        return ENV_PREFIX + name.upper()
    return flag_of(name)


# (setting, smallest value allowed, whether a percent of device memory is allowed)
_SIZES = (
    ("memory_budget", 1, True),
    ("bank_max_bytes", 1, False),
    ("bank_disk_max_bytes", 1, False),
    ("bank_min_free_disk", 0, False),
)


def _check_sizes(settings: Settings, sources: Mapping[str, str]) -> None:
    from segserve.config.sizes import parse_memory_budget

    for name, minimum, percent_ok in _SIZES:
        raw = getattr(settings, name)
        if raw is None:
            continue
        key = sources.get(name, flag_of(name))
        if raw.strip().endswith("%") and not percent_ok:
            raise SettingsError(f"{key}: a size is needed here (bytes or 64MB, 8GiB), got {raw!r}")
        try:  # a percent is checked against a nominal total: only its form matters here
            parse_memory_budget(raw, device_total_bytes=1 << 40, what=key, minimum=minimum)
        except ValueError as exc:
            raise SettingsError(f"{key}: {exc}") from None
