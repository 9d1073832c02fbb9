"""The model runner: executes a `StepPlan` on the model and returns a typed `StepOutput`.

Owns: `ModelRunner` and each running request's model-side state (its KV cache, sampler and
detokenizer). Engine thread only (the thread that owns MLX). It decides nothing: which
chunk runs, who decodes together and when a request ends come from the scheduler.

Per step: the planned prefill chunk runs through the model; the chunk that ends the prompt
seals the cache (turn boundary 1) and samples the first token. Then every request of the
decode batch feeds its last sampled token (one batched forward, B = 1 included, when the
model supports it) and samples the next. A token is never fed after the request ended, so
the stored snapshot holds the prompt and every generated token but the last.

Choices (`GenerationRequest.n` > 1): the prompt runs once into choice 0's cache; when its
last chunk is sealed, choices 1..n-1 get caches over that same sealed snapshot
(`_fork_choices`: segment refs, the prompt's rows are never copied in segmented mode), each
with its own tail, sampler (seed + i), detokenizer and a `copy()` of the grammar matcher;
all n sample their first token from the prompt's last logits and then decode as rows of the
same batch. `finish(rid, choice)` seals and returns choice 0's turn (the one stored); any
other choice's tail is dropped. A failure of any choice fails the request.

Sampling is per row (`_sample`): the request's logits processors (`Sampler.process`, only
when a parameter is on), then its grammar mask when it has a matcher
(`GenerationRequest.matcher`: disallowed tokens to -inf), then the seeded draw; the
matcher then `accept`s the token, and once it `is_finished()` the row ends with "stop"
(`Sampled.grammar_done`). A token the matcher rejects fails the request (phase "sample").

Pipelined decode steps (`pipeline_steps`, the `--pipeline-decode-steps` setting): while step
t's tokens are computing, the next step's graph is built on t's lazy sampled tokens and
started with `mx.async_eval`, as mlx-lm's generation loop does; the host work of building a
step (Python, the attention calls' planning) then overlaps the device's work instead of
adding to it. The runner keeps that step as `_inflight`; `execute` launches step t + 1, then
reads step t (its tokens go out one step late: stop strings, EOS and detokenizing read the
step that finished). Bookkeeping: a fed token is recorded in its cache at the start of the
next `execute` (it is known by then); a request that ended at step t already had its token
fed to step t + 1, and `finish` drops that speculative row (a trim of the row count, no copy),
so the stored cache equals the unpipelined one. Rows that need the token between steps take
the plain path: grammar, logits processors, log-probabilities, `n` > 1 and speculation; a
step whose batch holds one of them first reads the step in flight (no overlap that step).

Failure boundary: an exception while prefilling, decoding or sampling one request becomes a
`RunFailure` of that request; the others go on. A batched step that raises cannot say whose
request caused it: every cache is rewound to where the step began and each request is
retried alone, so only a request that also fails alone is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import mlx.core as mx

from segserve.kv.segmented import SegmentedCache
from segserve.kv.stock import StockCache
from segserve.server.runner.batched import batch_supported, decode_batch, decode_windows
from segserve.server.runner.forward import logits_last
from segserve.server.runner.model import LoadedModel
from segserve.server.runner.sampling import Sampler, SamplingParams
from segserve.server.runner.textstream import TextStream
from segserve.server.runner.warmup import WarmUpReport, warm_up
from segserve.server.scheduling import Phase, RunFailure, Sampled, StepOutput, StepPlan
from segserve.server.spec import (
    DraftBudget,
    IndexedSegment,
    IndexRegistry,
    TailIndex,
    accept_one,
    accept_sampled,
    logits_window,
    propose,
)

if TYPE_CHECKING:
    from segserve.kv.segment import Snapshot
    from segserve.server.scheduling import LookupHit

log = logging.getLogger("segserve.runner")

Route = Callable[..., mx.array]


class TokenMatcher(Protocol):
    """A request's grammar state (`segserve.server.chat.grammar.GrammarMatcher` fits): the mask of
    tokens allowed next, then the sampled token fed back."""

    def mask(self) -> mx.array: ...  # bool [vocab], True = allowed
    def accept(self, token_id: int) -> bool: ...
    def is_finished(self) -> bool: ...
    def copy(self) -> TokenMatcher: ...  # an independent state (for the other choices)


class RunRequest(Protocol):
    """What the runner reads of a request (`segserve.server.engine.GenerationRequest` fits)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt(self) -> tuple[int, ...]: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def stops(self) -> tuple[str, ...]: ...
    @property
    def matcher(self) -> TokenMatcher | None: ...
    @property
    def n(self) -> int: ...


class GrammarRejected(RuntimeError):
    """The sampled token is not in the request's grammar (the mask should have made that
    impossible): the request ends as a failure of its "sample" phase."""


@dataclass(eq=False)
class _Spec:
    """A speculating row's draft state: the turn's own index and the segment list's."""

    tail: TailIndex
    budget: DraftBudget
    synced: int = 0  # generated tokens already in `tail`
    segments: list[IndexedSegment] = field(default_factory=list)
    base_digest: str = ""  # the base the segment list was made for


@dataclass(eq=False)
class _Seq:
    req: RunRequest
    cache: SegmentedCache | StockCache
    sampler: Sampler
    text: TextStream
    matcher: TokenMatcher | None = None
    generated: list[int] = field(default_factory=list)
    choice: int = 0
    spec: _Spec | None = None  # None: this row never speculates


@dataclass(eq=False)
class _Inflight:
    """A launched decode step not read yet: `tokens` [B] (lazy) are `rows`' next tokens;
    `marks` each row's cache offset before the step (for a rewind)."""

    rows: list[_Seq]
    logits: mx.array  # [B, V], lazy
    tokens: mx.array  # [B], lazy
    marks: list[int]


@dataclass(frozen=True, slots=True)
class SpecCounts:
    """Draft tokens verified and accepted (a request's, or the runner's since start)."""

    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class TurnResult:
    """A finished choice: the snapshot to store (choice 0's turn; None for the others,
    whose tails are dropped) and the held-back text released at the end."""

    snapshot: Snapshot | None
    tail_text: str
    spec: SpecCounts = SpecCounts()


class ModelRunner:
    def __init__(
        self, loaded: LoadedModel, *, segmented: bool, route: Route | None = None,
        batch_decode: bool = True, speculative: bool = False, max_draft: int = 8,
        spec_max_batch: int = 1,
        index_registry: IndexRegistry | None = None, pipeline_steps: bool = False,
    ) -> None:
        if segmented and route is None:
            raise ValueError("segmented mode needs an attention route (segserve.kernels.factory)")
        self.loaded = loaded
        self.segmented = segmented
        self.route = route
        # Each layer's sliding window (None: global), as the model's own caches say.
        shape = loaded.shape
        if segmented and shape.cache_refusal:
            raise ValueError(f"segmented mode cannot serve this model: {shape.cache_refusal}")
        self._windows = shape.windows if segmented else None
        self._batching = batch_decode and batch_supported(loaded.decode)
        self._seqs: dict[str, dict[int, _Seq]] = {}  # request id -> its live rows by choice
        self.pipeline_steps = pipeline_steps
        self._inflight: _Inflight | None = None
        self.pipelined = 0  # decode steps launched pipelined (the rest ran step by step)
        # Speculative decoding (segserve.server.spec): segmented mode only, where rejected rows are
        # dropped by a trim of the private tail.
        self.speculative = speculative and segmented
        self.max_draft = max_draft
        self.spec_max_batch = spec_max_batch  # larger decode steps verify no drafts
        self.indexes = index_registry or IndexRegistry()
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_shared_steps = 0  # verify steps in which more than one row's drafts were verified
        self.seals = 0
        self.merges = 0

    # ---- request lifetime ------------------------------------------------------------
    def begin(self, req: RunRequest, hit: LookupHit, speculate: bool = True) -> None:
        """Make the request's cache over the reused snapshot. Everything that can fail for
        a bad request (the sampler's seed, its parameters) fails here, before any token.
        `speculate` False: admission priced the request without drafts (it never drafts)."""
        sampler = Sampler(req.sampling)
        if req.sampling.logit_bias:
            sampler.check_vocab(self._vocab_size())
        text = TextStream(self.loaded.tokenizer.decode, req.stops)
        base = hit.snapshot if hit.reused_tokens else None
        cache = self._new_cache(base)
        cache.reserve(len(req.prompt) - hit.reused_tokens)
        seq = _Seq(req, cache, sampler, text, req.matcher)
        if speculate and self._may_speculate(seq):
            seq.spec = self._new_spec(req)
        self._seqs[req.request_id] = {0: seq}

    def warm_up(self, max_batch: int, prefill_chunk: int,
                stopped: Callable[[], bool] = lambda: False) -> WarmUpReport:
        """Compile ahead (`segserve.server.runner.warmup`): a decode step at every batch
        size up to `max_batch` and the prefill chunks, on caches of its own."""
        report = warm_up(self.loaded.model, self.loaded.decode if self._batching else None,
                         self._new_cache, max_batch=max_batch, prefill_chunk=prefill_chunk,
                         vocab=self._vocab_size(), stopped=stopped)
        if report.error is None:
            log.info("warm-up: decode batches 1-%d and prefill chunks compiled in %.1f s",
                     max_batch, report.seconds)
        return report

    def _new_cache(self, base: Snapshot | None) -> SegmentedCache | StockCache:
        n = self.loaded.num_layers
        if self.segmented:
            return SegmentedCache(n, base, route=self.route, dtype=getattr(mx, self.loaded.kv_dtype),
                                  windows=self._windows)
        return StockCache(n, base)

    def finish(self, request_id: str, choice: int = 0) -> TurnResult:
        """A choice ended. Choice 0: turn boundary 2, seal after generation (its turn is
        the one stored); another choice's tail is dropped. The request leaves the runner
        with its last choice."""
        rows = self._seqs[request_id]
        seq = rows.pop(choice)
        if not rows:
            del self._seqs[request_id]
        self._leave_inflight(seq)
        counts = SpecCounts(seq.spec.budget.drafted, seq.spec.budget.accepted) if seq.spec else SpecCounts()
        if choice != 0:
            seq.cache.drop_tail()
            return TurnResult(None, seq.text.flush(), counts)
        self._seal(seq)
        return TurnResult(seq.cache.base, seq.text.flush(), counts)

    def abandon(self, request_id: str) -> Snapshot | None:
        """A cancelled or failed request leaves: its tails are dropped, what was sealed (the
        prompt, once prefilled) is returned for storing. None if it never began, or when
        choice 0 already ended (its turn was stored then)."""
        rows = self._seqs.pop(request_id, None)
        if rows is None:
            return None
        for seq in rows.values():
            self._leave_inflight(seq)
            seq.cache.drop_tail()
        first = rows.get(0)
        return first.cache.base if first is not None else None

    def tail_bytes(self) -> dict[str, int]:
        return {
            rid: sum(s.cache.tail_nbytes() for s in rows.values()) for rid, rows in self._seqs.items()
        }

    @property
    def inflight(self) -> bool:
        """A launched decode step waits to be read (the engine runs `execute` for it)."""
        return self._inflight is not None

    def _leave_inflight(self, seq: _Seq) -> None:
        """A row leaves while a step in flight fed it a token after its last one: that
        speculative row is dropped from its cache (its output is never read)."""
        step = self._inflight
        if step is None or seq not in step.rows:
            return
        i = step.rows.index(seq)
        _drop_unrecorded(seq.cache)
        del step.rows[i], step.marks[i]
        keep = [j for j in range(len(step.rows) + 1) if j != i]
        if not step.rows:
            self._inflight = None
        else:
            idx = mx.array(keep, dtype=mx.int32)
            step.tokens, step.logits = step.tokens[idx], step.logits[idx]

    # ---- one step --------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        sampled: list[Sampled] = []
        failed: list[RunFailure] = []
        prefilled = 0
        chunk = plan.prefill
        if chunk is not None and chunk.request_id in self._seqs:
            seq = self._seqs[chunk.request_id][0]
            phase: Phase = "prefill"
            try:
                logits = self._prefill(seq, chunk.start, chunk.tokens)
                prefilled = chunk.tokens
                if chunk.last:
                    self._seal(seq)  # turn boundary 1: the end of the prompt
                    phase = "sample"
                    for row in self._fork_choices(seq):
                        sampled.append(self._sample(row, logits))
            except Exception as exc:
                failed.append(RunFailure(chunk.request_id, phase, exc))
        batch = [s for r in plan.decode for s in self._seqs.get(r, {}).values()]
        step, self._inflight = self._inflight, None
        if step is not None:  # its fed tokens were read with the step before it
            for s in step.rows:
                s.cache.record_tokens([s.generated[-1]])
        launched = None
        if batch and self._pipelines(batch):
            launched = self._launch(batch, step)
        if step is not None:
            if not self._read(step, sampled, failed) and launched is not None:
                for s in launched.rows:  # built on tokens that never came: not run
                    _drop_unrecorded(s.cache)
                launched = None
        self._inflight = launched
        if launched is None:
            rest = [s for s in batch if step is None or s not in step.rows]
            if rest:
                self._decode(rest, sampled, failed)
        return StepOutput(tuple(sampled), tuple(failed), prefilled)

    def _pipelines(self, batch: list[_Seq]) -> bool:
        """Every row's next token can be drawn inside the step's graph (see the module
        docstring for the rows that cannot)."""
        return self.pipeline_steps and self._batching and all(
            s.req.n == 1 and s.spec is None and s.matcher is None and not s.sampler.processes
            and not s.req.sampling.logprobs for s in batch)

    def _launch(self, batch: list[_Seq], step: _Inflight | None) -> _Inflight | None:
        """Build the next decode step of `batch` and start it (`mx.async_eval`): rows of the
        step in flight feed its lazy tokens, the others their last sampled token. None
        (nothing left written) when building fails: the plain path then serves the batch."""
        cont = [s for s in step.rows if s in batch] if step is not None else []
        new = [s for s in batch if s not in cont]
        rows = cont + new
        marks = [s.cache.offset for s in rows]
        try:
            parts = []
            if cont:
                assert step is not None
                parts.append(step.tokens if cont == step.rows else
                             step.tokens[mx.array([step.rows.index(s) for s in cont], dtype=mx.int32)])
            if new:
                parts.append(mx.array([s.generated[-1] for s in new], dtype=mx.uint32))
            fed = parts[0] if len(parts) == 1 else mx.concatenate(parts)
            logits = decode_batch(self.loaded.decode, fed, [s.cache.layers for s in rows])
            greedy = mx.argmax(logits, axis=-1)
            # The sampler's own draw for the other rows: the same key split per step as
            # the plain path, so seeded requests draw the same tokens.
            tokens = greedy if all(self._plain_greedy(s) for s in rows) else mx.stack([
                greedy[i] if self._plain_greedy(s) else s.sampler(logits[i]).astype(greedy.dtype)
                for i, s in enumerate(rows)])
            mx.async_eval(tokens)  # type: ignore[no-untyped-call]  # unannotated in mlx's stub
        except Exception:
            log.warning("building a pipelined decode step of %d requests failed; decoding "
                        "them step by step", len(rows), exc_info=True)
            for s, mark in zip(rows, marks, strict=True):
                _trim_to(s.cache, mark)
            return None
        self.pipelined += 1
        return _Inflight(rows, logits, tokens, marks)

    def _read(self, step: _Inflight, sampled: list[Sampled], failed: list[RunFailure]) -> bool:
        """Wait for `step` and sample its rows (the tokens are drawn already). False when
        its evaluation raised: each row is then rewound and fed alone, as a failed batched
        step is, and the caller drops what was built on the step."""
        try:
            picks = cast(list[int], step.tokens.tolist())
        except Exception:
            log.warning("pipelined decode of %d requests failed; retrying them one by one",
                        len(step.rows), exc_info=True)
            for s, mark in zip(step.rows, step.marks, strict=True):
                try:
                    sampled.append(self._sample(s, self._retry_one(s, mark)))
                except Exception as exc:
                    failed.append(RunFailure(s.req.request_id, "decode", exc))
            return False
        for i, s in enumerate(step.rows):
            try:
                sampled.append(self._sample(s, step.logits[i], picks[i]))
            except Exception as exc:
                failed.append(RunFailure(s.req.request_id, "sample", exc))
        return True

    def _fork_choices(self, first: _Seq) -> list[_Seq]:
        """Choices 1..n-1 over the prompt choice 0 just sealed: its snapshot is shared by
        reference (segmented mode: no prompt row is copied; stock mode: a view that each
        choice's first write copies, as admission prices), everything else is their own.
        The matcher is copied before choice 0 accepts anything, so all start equal."""
        req = first.req
        rows = self._seqs[req.request_id]
        for i in range(1, req.n):
            m = first.matcher.copy() if first.matcher is not None else None
            text = TextStream(self.loaded.tokenizer.decode, req.stops)
            sampler = Sampler(req.sampling.for_choice(i))
            rows[i] = row = _Seq(req, self._new_cache(first.cache.base), sampler, text, m, choice=i)
            if first.spec is not None:  # each choice drafts from its own turn
                row.spec = self._new_spec(req)
        return list(rows.values())

    def _prefill(self, seq: _Seq, start: int, n: int) -> mx.array:
        tokens = seq.req.prompt[start : start + n]
        logits = logits_last(self.loaded.model, tokens, seq.cache.layers)
        mx.eval(logits)
        seq.cache.record_tokens(tokens)
        return logits

    def _vocab_size(self) -> int:
        """Width of the logits (the model's vocabulary; the tokenizer's if the model
        does not say)."""
        return self.loaded.shape.vocab_size or int(self.loaded.tokenizer.vocab_size)

    @staticmethod
    def _plain_greedy(seq: _Seq) -> bool:
        """Greedy with nothing between the logits and the argmax (no processor, no grammar)."""
        return seq.sampler.params.plain_argmax and seq.matcher is None

    @staticmethod
    def _shaped(seq: _Seq, logits: mx.array) -> mx.array:
        """The logits a row draws from: its logits processors (only built when a parameter
        is on), then its grammar mask (disallowed tokens to -inf)."""
        x = logits
        if seq.sampler.processes:
            x = seq.sampler.process(x, seq.req.prompt, seq.generated)
        if seq.matcher is not None:
            x = mx.where(seq.matcher.mask(), x, mx.array(-mx.inf, dtype=x.dtype))
        return x

    def _sample(self, seq: _Seq, logits: mx.array, pick: int | None = None) -> Sampled:
        """One row's next token: logits processors (only built when a parameter is on),
        the grammar mask, then the draw; the grammar sees the token and may end the row.
        Log-probabilities are read from the raw `logits` (the model's distribution).
        `pick`: the row's greedy token already drawn with the step (`_plain_greedy` rows)."""
        m = seq.matcher
        token = pick if pick is not None else int(seq.sampler(self._shaped(seq, logits)).item())  # type: ignore[arg-type]  # a 0-d uint32
        rid = seq.req.request_id
        done = False
        if m is not None:
            if not m.accept(token):
                reason = getattr(m, "error", None)
                log.warning("request %s: grammar rejected token %d: %s", rid, token, reason)
                raise GrammarRejected(f"grammar rejected token {token}: {reason}")
            done = m.is_finished()
        want_lp = seq.req.sampling.logprobs
        lp = seq.sampler.logprob(logits, token) if want_lp else None
        seq.generated.append(token)
        if token in self.loaded.tokenizer.eos_ids:
            return Sampled(rid, token, "", lp, eos=True, stop_string=False, choice=seq.choice)
        text = seq.text.push(token)
        return Sampled(rid, token, text, lp, eos=False, stop_string=seq.text.stopped,
                       grammar_done=done, choice=seq.choice)

    def _decode(self, batch: list[_Seq], sampled: list[Sampled], failed: list[RunFailure]) -> None:
        """Feed each request's last sampled token, then sample its next one. When rows that
        speculate find drafts (in a step of at most `spec_max_batch` rows), the step verifies
        them instead (`_speculate`): each such row feeds its window of 1 + K tokens, the
        others their one token, in one forward."""
        drafts = {i: d for i, s in enumerate(batch) if s.spec is not None and (d := self._drafts(s))
                  } if len(batch) <= self.spec_max_batch else {}
        if drafts:
            batch = self._speculate(batch, drafts, sampled, failed)
            if not batch:
                return
        fed: list[tuple[_Seq, mx.array]] = []
        picks: dict[int, int] = {}  # batch row -> its greedy token, drawn with the step
        if self._batching:
            marks = [s.cache.offset for s in batch]  # every layer is there between steps
            try:
                logits = decode_batch(
                    self.loaded.decode, [s.generated[-1] for s in batch], [s.cache.layers for s in batch]
                )
                # Plain greedy rows take their argmax in the step's own evaluation: one
                # synchronisation per step instead of one more per row (~0.3 ms of a ~16 ms
                # step on the 2-core CPU, bench/profile_decode.py `sample`). The sampler's
                # greedy draw is the same argmax of the same float32 row.
                plain = [i for i, s in enumerate(batch) if self._plain_greedy(s)]
                greedy = mx.argmax(logits, axis=-1) if plain else None
                mx.eval(logits if greedy is None else [logits, greedy])
                if greedy is not None:
                    row_picks = cast(list[int], greedy.tolist())  # [B] token ids
                    picks = {i: row_picks[i] for i in plain}
                for i, s in enumerate(batch):
                    s.cache.record_tokens([s.generated[-1]])
                    fed.append((s, logits[i]))
            except Exception:
                log.warning("batched decode of %d requests failed; retrying them one by one",
                            len(batch), exc_info=True)
                picks, fed = {}, []  # the retries draw their own tokens, row by row
                for s, mark in zip(batch, marks, strict=True):
                    try:
                        fed.append((s, self._retry_one(s, mark)))
                    except Exception as exc:
                        failed.append(RunFailure(s.req.request_id, "decode", exc))
        else:
            for s in batch:
                try:
                    fed.append((s, self._feed_one(s)))
                except Exception as exc:
                    failed.append(RunFailure(s.req.request_id, "decode", exc))
        for i, (s, row) in enumerate(fed):
            try:
                # `fed` follows `batch` row for row when the batched step succeeded.
                sampled.append(self._sample(s, row, picks.get(i)))
            except Exception as exc:
                failed.append(RunFailure(s.req.request_id, "sample", exc))

    def _retry_one(self, seq: _Seq, offset: int) -> mx.array:
        """Undo a failed batched step's writes to this request's cache, then feed the token
        alone."""
        self._rewind(seq, offset)
        return self._feed_one(seq)

    @staticmethod
    def _rewind(seq: _Seq, offset: int) -> None:
        """Undo a failed step's writes to this request's cache (the layers it reached), so
        it holds what it held before the step."""
        cache = seq.cache
        for layer in cache.layers:
            if layer.offset > offset:
                layer.trim(layer.offset - offset)
        # A trimmed last layer also drops its token record: put back what the cache held
        # before the step (the prompt and every generated token but the one being fed).
        expected = (*seq.req.prompt, *seq.generated[:-1])
        have = len(cache.tokens)
        if have < len(expected):
            cache.record_tokens(expected[have:])
        if cache.offset != len(expected) or cache.tokens != expected:
            raise RuntimeError("the cache could not be rewound after a failed step")

    def _feed_one(self, seq: _Seq) -> mx.array:
        token = seq.generated[-1]
        logits = logits_last(self.loaded.model, [token], seq.cache.layers)
        mx.eval(logits)
        seq.cache.record_tokens([token])
        return logits

    def _seal(self, seq: _Seq) -> None:
        before = seq.cache.merges
        seq.cache.seal()
        self.seals += 1
        self.merges += seq.cache.merges - before
        if seq.spec is not None:
            self._index_segments(seq.spec, seq.cache.base)

    # ---- speculative decoding ------------------------------------------------------
    def _may_speculate(self, seq: _Seq) -> bool:
        """Rows that speculate: a known token budget. A grammar and logits processors see
        each verified row in turn, as in plain decoding (`_accept`); log-probabilities are
        the model's per accepted token (each verify row's raw logits); each of `n` choices
        drafts from its own turn (a step verifies every row's drafts together,
        `_speculate`)."""
        return self.speculative and isinstance(getattr(seq.req, "max_tokens", None), int)

    def _new_spec(self, req: RunRequest) -> _Spec:
        """A row's draft state: an index of its turn (the prompt, then what it generates)."""
        return _Spec(TailIndex(req.prompt), DraftBudget(k_max=self.max_draft))

    def _index_segments(self, spec: _Spec, base: Snapshot) -> None:
        """The draft index of every segment of `base` (built once per segment content,
        at seal or the first time a restored one is seen; shared through the registry)."""
        if spec.base_digest == base.digest and len(spec.segments) == len(base.segments):
            return
        spec.segments = [
            IndexedSegment(self.indexes.ensure(s.owner.digest, s.owner.tokens), s.rows)
            for s in base.segments
        ]
        spec.base_digest = base.digest

    def _drafts(self, seq: _Seq) -> list[int]:
        """The tokens to verify this step (empty: decode plainly)."""
        spec = seq.spec
        assert spec is not None
        if spec.synced < len(seq.generated):
            spec.tail.extend(seq.generated[spec.synced :])
            spec.synced = len(seq.generated)
        max_tokens: int = getattr(seq.req, "max_tokens")  # noqa: B009 — checked at begin
        # The verify step also yields the model's own token after the drafts.
        k = min(spec.budget.want(), max_tokens - len(seq.generated) - 1)
        if k < 1:
            return []
        self._index_segments(spec, seq.cache.base)
        # One-token matches are mostly chance, and on the CPU a verify row costs nearly a
        # decode step (bench/speculative.py's docstring), so only 2- and 3-gram matches draft.
        found = propose(spec.segments, spec.tail, k, min_ngram=2)
        return list(found.tokens) if found is not None else []

    def _speculate(self, batch: list[_Seq], drafts: dict[int, list[int]], sampled: list[Sampled],
                   failed: list[RunFailure]) -> list[_Seq]:
        """Verify every row's drafts in one forward: row i feeds [last, *drafts[i]] (its
        last token alone when it drafted nothing), emits its accepted tokens and the
        model's next one (stopping at an end of the request), then drops the rows of its
        window past the last token fed (a trim of the tail, no copy). Returns the rows the
        caller still decodes plainly: none once verified; every row whose cache could be
        rewound when the forward failed (a row that could not is failed). Without batched
        layers (`_batching` off) only a batch of one speculates."""
        if not self._batching and len(batch) > 1:
            return batch
        if len(drafts) > 1:
            self.spec_shared_steps += 1
        windows = [[s.generated[-1], *drafts.get(i, [])] for i, s in enumerate(batch)]
        marks = [s.cache.offset for s in batch]
        try:
            if self._batching:  # the decode step's layers, every window's rows as the batch
                logits = decode_windows(self.loaded.decode, windows, [s.cache.layers for s in batch])
            else:
                logits = logits_window(self.loaded.model, windows[0], batch[0].cache.layers)
            logits = logits.astype(mx.float32)
            greedy = mx.argmax(logits, axis=-1)
            mx.eval(logits, greedy)
            picks = cast(list[int], greedy.tolist())
        except Exception:
            log.warning("speculative verify of %d requests failed; decoding them plainly",
                        len(batch), exc_info=True)
            plain = []
            for s, mark in zip(batch, marks, strict=True):
                try:
                    self._rewind(s, mark)
                    plain.append(s)
                except Exception as exc:
                    failed.append(RunFailure(s.req.request_id, "decode", exc))
            return plain
        at = 0
        for i, (s, window) in enumerate(zip(batch, windows, strict=True)):
            rows = logits[at : at + len(window)]
            row_picks = picks[at : at + len(window)]
            at += len(window)
            try:
                if i in drafts:
                    sampled.extend(self._accept(s, window, rows, row_picks))
                else:
                    s.cache.record_tokens(window)
                    sampled.append(self._sample(s, rows[0], row_picks[0] if self._plain_greedy(s) else None))
            except Exception as exc:
                failed.append(RunFailure(s.req.request_id, "sample", exc))
        return []

    def _accept(self, seq: _Seq, window: list[int], logits: mx.array, picks: list[int]) -> list[Sampled]:
        """One row's verified window: the accepted drafts and the model's next token, then
        the window's rows past the last token fed dropped from the tail.

        Greedy: row by row, each row's token drawn as a plain step would draw it after the
        tokens emitted before it (its logits processors and grammar see those), stopping at
        the first token that differs from its draft (the model's correction: later rows were
        computed after the wrong draft). Sampled: the rejection rule over the drafts, all
        rows at once for a row with nothing between the logits and the draw, else row by
        row on each row's processed and masked logits (`accept_one`), so every emitted
        token keeps the distribution the plain path draws from."""
        spec, cache = seq.spec, seq.cache
        assert spec is not None and isinstance(cache, SegmentedCache)
        drafts = window[1:]
        sampler = seq.sampler
        greedy = sampler.params.temperature == 0.0
        shaped = seq.matcher is not None or sampler.processes
        out = (accept_sampled(sampler.weights(logits), drafts, sampler.next_key)
               if not greedy and not shaped else None)
        plain = self._plain_greedy(seq)
        max_tokens: int = getattr(seq.req, "max_tokens")  # noqa: B009
        emitted: list[Sampled] = []
        accepted = 0
        try:
            for i in range(len(window) if out is None else len(out)):
                token: int | None
                if out is not None:
                    token = out[i]
                elif greedy:
                    token = picks[i] if plain else None
                elif i < len(drafts):  # sampled, shaped: this row's rule on its own logits
                    weights = sampler.weights(self._shaped(seq, logits[i]).astype(mx.float32).reshape(-1))
                    token, _ = accept_one(weights, drafts[i], sampler.next_key)
                else:
                    token = None  # after every draft: the plain draw
                s = self._sample(seq, logits[i], token)
                emitted.append(s)
                matched = i < len(drafts) and s.token_id == drafts[i]
                accepted += matched
                if s.eos or s.stop_string or s.grammar_done or len(seq.generated) >= max_tokens:
                    break
                if not matched:
                    break
        finally:  # the cache holds exactly the tokens fed, whatever the draw did
            kept = max(1, len(emitted))  # rows fed: window[0 .. kept - 1]
            cache.drop_rows(len(window) - kept)
            cache.record_tokens(window[:kept])
        spec.budget.update(len(drafts), accepted)
        self.spec_drafted += len(drafts)
        self.spec_accepted += accepted
        return emitted


def _drop_unrecorded(cache: SegmentedCache | StockCache) -> None:
    """Forget the rows written past the recorded tokens (a step that will not be read):
    the row count is trimmed, the buffers are not copied."""
    _trim_to(cache, len(cache.tokens))


def _trim_to(cache: SegmentedCache | StockCache, rows: int) -> None:
    """Trim every layer to `rows` rows; no recorded token goes (`rows` >= the recorded).
    A segmented cache's last layer drops token records when trimmed, so a step that
    reached it is dropped by row count (`drop_rows`) instead."""
    if isinstance(cache, SegmentedCache) and cache.offset > rows:
        cache.drop_rows(cache.offset - rows)
        return
    for layer in cache.layers:
        if layer.offset > rows:
            layer.trim(layer.offset - rows)
