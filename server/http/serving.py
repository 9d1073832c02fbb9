"""What a route is given: the serving context, narrower than the composition root.

Owns: `Serving` (the engine client, the prompt builder, the settings that bound requests,
the model card, metrics, the Responses store, and the event-loop-side serving state:
requests in flight, draining), `ModelCard` (what clients and `/health` are told about the
model) and `PromptBuilder` (chat template and tokenizer: messages -> token ids, the grammar
vocabulary). `segserve.server.runtime` builds one `Serving` per server; routes read it from
`request.app.state.serving`, and nothing here reaches the bank, the runner or MLX: engine
state comes only from `EngineClient.state()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from segserve.config.settings import Settings
from segserve.server.chat.grammar import GrammarVocab
from segserve.server.chat.template import TemplateRenderError
from segserve.server.chat.tool_calls import ToolFamily, resolve_family
from segserve.server.engine.client import EngineClient
from segserve.server.engine.state import EngineState
from segserve.server.http.errors import ContextLengthExceeded, InvalidRequest
from segserve.server.http.metrics import Metrics
from segserve.server.http.responses_store import ResponseStore
from segserve.server.version import __version__


class Tokenizer(Protocol):
    """What the HTTP side uses of the model's tokenizer (`segserve.server.runner.ChatTokenizer`)."""

    @property
    def chat_template(self) -> str: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_token_chars(self) -> int | None: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def backend(self) -> Any: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def char_limit(self, tokens: int) -> int | None: ...
    def render(
        self, messages: Sequence[Mapping[str, Any]], *,
        tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any,
    ) -> str: ...


class SamplingDefaultsView(Protocol):
    """The model's generation-config defaults (`segserve.server.runner.SamplingDefaults`)."""

    def as_dict(self) -> dict[str, float | int]: ...
    def pick(self, name: str, requested: float | None, fallback: float) -> float: ...


@dataclass(frozen=True, slots=True)
class KvMode:
    """Segmented or stock, and why (the start-up support check and self-check)."""

    mode: str
    requested_mode: str
    supported: bool
    reason: str
    route: str
    self_check_ok: bool | None
    self_check_detail: str


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str
    source: str
    quantization: str | None
    context_length: int
    vocab_size: int  # width of the logits: token ids (prompts, logit_bias) stay under it
    kv_bytes_per_token: int
    sampling_defaults: SamplingDefaultsView
    batched_decode: Mapping[str, Any]
    kv: KvMode


class PromptBuilder:
    """Messages -> prompt token ids through the chat template; worker threads only (a long
    prompt costs seconds to tokenize)."""

    def __init__(self, tokenizer: Tokenizer, context_length: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._vocab: GrammarVocab | None = None
        self._vocab_lock = threading.Lock()

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Messages in template shape (+ tools, + extra template variables such as a
        request's `chat_template_kwargs`) -> prompt token ids."""
        try:
            text = self.tokenizer.render(messages, tools=tools, **dict(variables or {}))
        except TemplateRenderError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        return self.encode_prompt(text, "messages")

    def encode_prompt(self, text: str, param: str) -> list[int]:
        """Prompt text -> token ids. A text with more characters than the context could
        hold in tokens is refused before tokenizing (a multi-megabyte prompt costs seconds
        of CPU to tokenize and would be refused afterwards anyway)."""
        tok = self.tokenizer
        limit = tok.char_limit(self.context_length)
        if limit is not None and len(text) > limit:
            raise ContextLengthExceeded(
                f"the prompt is {len(text)} characters, more than the model's context of "
                f"{self.context_length} tokens can hold (a token here stands for at most "
                f"{tok.max_token_chars} characters)",
                param=param,
            )
        return list(tok.encode(text))

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary for llguidance, built on first use (~0.4 s; off the event loop).
        Raises InvalidRequest when the tokenizer has no `tokenizers` form."""
        with self._vocab_lock:
            if self._vocab is None:
                backend = self.tokenizer.backend
                if backend is None:
                    raise InvalidRequest(
                        "constrained decoding needs a fast (tokenizers) tokenizer; this model "
                        "has none", param="response_format", code="unsupported_parameter",
                    )
                self._vocab = GrammarVocab.from_tokenizer(
                    backend, vocab_size=self.vocab_size, eos_ids=self.tokenizer.eos_ids
                )
            return self._vocab


@dataclass(eq=False)
class Serving:
    engine: EngineClient
    prompts: PromptBuilder
    model: ModelCard
    settings: Settings  # request bounds, tool and reasoning options, keys, CORS
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    # Event-loop side only: HTTP requests being served, and whether a shutdown began
    # (`segserve.server.lifecycle`): then new generation requests get 503 and /health says so.
    inflight: int = 0
    draining: bool = False
    cpu_limiter: Any = None  # anyio.CapacityLimiter for tokenizing, made on the event loop
    _responses: ResponseStore | None = None

    # ---- what routes read of the model ------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.model.id

    @property
    def context_length(self) -> int:
        return self.model.context_length

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prompts.tokenizer

    @property
    def tool_family(self) -> ToolFamily:
        """The tool-call markup: `--tool-parser`, else detected from the chat template,
        else Hermes (`<tool_call>` JSON, the most common form)."""
        fam = resolve_family(self.tokenizer.chat_template, self.settings.tool_parser)
        return fam if fam is not None else ToolFamily.HERMES

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.prompts.encode_chat(messages, tools, variables)

    def encode_prompt(self, text: str, param: str) -> list[int]:
        return self.prompts.encode_prompt(text, param)

    def grammar_vocab(self) -> GrammarVocab:
        return self.prompts.grammar_vocab()

    def responses(self) -> ResponseStore:
        """The Responses store, opened on first use: `responses.sqlite3` next to the bank's
        SSD tier when it has one (records survive a restart with the sessions), else in
        memory."""
        if self._responses is None:
            self._responses = ResponseStore(self.engine.cold_root())
        return self._responses

    # ---- /health ----------------------------------------------------------------------
    def health_minimal(self) -> dict[str, Any]:
        """What `/health` tells a client without the key: alive and ready, nothing else."""
        alive = self.engine.alive
        return {"status": self._status(alive), "alive": alive, "ready": self.ready}

    def health(self) -> dict[str, Any]:
        st = self.engine.state()
        m, kv = self.model, self.model.kv
        return {
            "status": self._status(st.alive),
            "alive": st.alive,
            "ready": self.ready,
            "version": __version__,
            "engine": {"alive": st.alive, "error": st.error, "running": st.running,
                       "warming": st.warming, "warm_up": dict(st.warm_up) if st.warm_up else None},
            "model": {
                "id": m.id,
                "source": m.source,
                "quantization": m.quantization,
                "context_length": m.context_length,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "sampling_defaults": m.sampling_defaults.as_dict(),
                "batched_decode": dict(m.batched_decode),
            },
            "kv": {
                "mode": kv.mode,
                "requested_mode": kv.requested_mode,
                "supported": kv.supported,
                "reason": kv.reason,
                "route": kv.route,
                "self_check": {"ok": kv.self_check_ok, "detail": kv.self_check_detail},
                **st.kv,
            },
            "admission": st.admission.as_dict(),
            "bank": _bank_health(st),
            "uptime_s": int(time.time()) - self.started,
        }

    @property
    def ready(self) -> bool:
        """Serving requests now: the engine lives, its warm-up is over, no shutdown began
        (`/health`'s status code and `ready` field)."""
        return self.engine.alive and not self.engine.warming and not self.draining

    def _status(self, alive: bool) -> str:
        if self.draining:
            return "shutting_down"
        if not alive:
            return "engine_dead"
        return "warming" if self.engine.warming else "ok"


_BANK_HEALTH_KEYS = (
    "sessions", "entries", "segments", "bytes_by_tier", "max_bytes", "hits_by_kind", "misses",
    "evictions_by_reason", "spills", "spills_refused", "spill_failures", "restores_by_tier",
    "quarantined_blocks", "writes_pending", "writes_lost", "last_miss_reason",
    "disk_faults", "last_fault", "cold_tier",
)


def _bank_health(st: EngineState) -> dict[str, Any]:
    return {k: st.bank[k] for k in _BANK_HEALTH_KEYS if k in st.bank}
