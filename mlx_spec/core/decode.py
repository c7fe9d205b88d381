"""The speculative decode loop: draft, verify once, keep the agreed prefix."""

import time
from typing import Any, Callable, Collection, Generator, List, Optional, Tuple, Union

import mlx.core as mx

from ..drafters.base import MAX_AUTO_DRAFT_TOKENS, as_drafter
from ..drafters.contract import SelfJudging
from ..mlx_lm_compat import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache
from ..models.pipeline import pipeline_group
from .policy import make_policy, most_drafts
from .sampling import make_draft_sampler, make_sampler, scored_logprobs
from .state import SpeculativeCache
from .stats import PhaseClock, SpecStats
from .target import Target, queue_after
from .verify import verify_draft

NO_DRAFT = mx.array([], mx.uint32)  # [0]: a pass that drafts nothing


class SpeculativeDecoder:
    """Target caches, drafter and token history, advanced one verify pass at a time.

    It outlives a generation: ``feed`` appends new tokens (a first prompt, or a
    later chat turn) with one prefill, so the target's KV/GDN state, the
    drafter's state (n-gram index, MTP cache) and the history carry over.
    Usually the last token of the history is *pending*: known but not yet
    processed by the target (the first input of the next verify pass or
    prefill). ``flush`` processes it, which leaves the caches exactly as plain
    decoding of the same history does.
    """

    def __init__(
        self,
        model,
        drafter=None,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        rollback: str = "store",
        prompt_cache: Optional[List[Any]] = None,
        prefill_step_size: int = 2048,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        stats: Optional[SpecStats] = None,
    ):
        self.model, self.max_draft = model, max_draft
        self.drafter = as_drafter(drafter)
        self.cache = SpeculativeCache(model, max_draft, rollback, caches=prompt_cache)
        self.target = Target(model, self.cache)
        self.prefill_step_size = prefill_step_size
        self.kv = (kv_bits, kv_group_size, quantized_kv_start)
        self.stats = SpecStats() if stats is None else stats
        self.history: List[int] = []
        self.processed = 0  # history[:processed] is in the target's caches
        self.last_hidden = None  # [1, H]: hidden of history[-1] once processed
        self.drafted, self.draft_seconds = 0, 0.0
        self._held = []  # (tokens, hidden parts) fed, not yet given the drafter
        self._verified = None  # (drafted, accepted, hidden) until commit
        self._queued = None  # (logits, hidden) of a plain pass queued ahead
        # Whether the last pass's wall time is not one forward's: it queued
        # the next one without running its own queued forward (it also built
        # the next graph), or the reverse (its forward started a pass early):
        # the ends of a run of queued passes.
        self.timed_unfairly = False

    def _quantize(self):
        kv_bits, group_size, start = self.kv
        maybe_quantize_kv_cache(self.cache.caches, start, group_size, kv_bits)

    @property
    def pending(self) -> List[int]:
        return self.history[self.processed :]

    def feed(self, tokens: List[int], progress=None, more: bool = False):
        """Append ``tokens`` (non-empty): the target prefills the pending token
        and all new tokens but the last, which becomes pending.

        ``more``: the rest of the prompt follows (a prompt prefilled in
        chunks): the drafter gets the chunks in one piece, as from one
        ``feed`` of the whole (a windowed MTP head then skips the rows no
        later row attends to), at the last chunk or when next needed."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("cannot feed an empty list of tokens")
        self.settle_queued()
        inputs = self.pending + tokens[:-1]
        keep = self.drafter is not None and self.drafter.needs_hidden
        hidden = self.target.prefill(
            mx.array(inputs, mx.uint32),
            self.prefill_step_size,
            progress or (lambda n: None),
            self._quantize,
            keep_hidden=keep,
        )
        if self.drafter is not None:
            # row i: the hidden state of the token before tokens[i]
            if self.history and not self.pending and keep:
                hidden = [self.last_hidden] + (hidden or [])
            self._held.append((tokens, hidden or []))
        self.history += tokens
        self.processed = len(self.history) - 1
        if not more:
            self.update_drafter()

    def update_drafter(self):
        """Hand the drafter the tokens fed with ``more`` that it has not seen,
        in one piece (a ``reset`` when they are the whole history)."""
        if not self._held:
            return
        tokens = [t for part, _ in self._held for t in part]
        hidden = [h for _, parts in self._held for h in parts] or None
        if hidden:
            rows = sum(h.shape[0] for h in hidden)
            hidden = _blank_first(hidden, rows - self.drafter.rows_read(rows))
        self._held = []
        if len(tokens) == len(self.history):
            self.drafter.reset(tokens, hidden)
        else:
            self.drafter.accept(tokens, hidden)

    def flush(self):
        """Process the pending token: the caches then equal plain decoding's."""
        self.settle_queued()
        if self.pending:
            self.last_hidden = self.target.hidden(mx.array(self.pending, mx.uint32))
            mx.eval([c.state for c in self.cache.caches])
            self.processed = len(self.history)

    def draft_room(self) -> float:
        """Most drafts the next pass may verify (the KV quantization point)."""
        kv_bits, _, start = self.kv
        if kv_bits is None:
            return self.max_draft
        return min(self.max_draft, self.cache.tokens_before(start) - 1)

    def verify(
        self,
        k: int,
        sampler,
        processors=None,
        history: Optional[List[int]] = None,
        clock: Optional[PhaseClock] = None,
        queue_plain: bool = False,
    ) -> Tuple[List[int], mx.array, int]:
        """One verify pass with up to ``k`` drafts; :meth:`commit` must follow.

        Returns ``(emitted, logprobs [T, V], n_accepted)``: the accepted
        drafts and the target's next token. ``history`` (default: the whole
        history) is what logits processors see. ``queue_plain``: when this
        pass drafts nothing, the next one will not either; its forward over
        this pass's (lazy) token is queued before the host waits, as mlx-lm
        decodes, and the next call takes it whatever its ``k``.
        """
        if not self.pending:
            raise ValueError("nothing to decode from: feed tokens first")
        self.update_drafter()
        if self._verified is not None:
            raise RuntimeError("verify() called twice without commit()")
        clock = clock or PhaseClock(self.stats)
        tic = time.perf_counter()
        took_queued = self._queued is not None
        draft = NO_DRAFT if took_queued else self.next_draft(k)  # [m], maybe lazy
        self.drafted = draft.size
        # A draft made on the device: the host timer saw none of its work.
        on_device = draft.size > 0 and self.drafter.drafted_on_device
        self.draft_seconds = None if on_device else time.perf_counter() - tic
        clock.lap("draft", draft if on_device else None)

        inputs = mx.array(self.history[-1:], mx.uint32)
        if draft.size:
            self.cache.begin(1 + draft.size)
            logits, hidden = self.target.forward(mx.concatenate([inputs, draft]))
        else:  # one token: a plain decoding step, nothing to roll back
            logits, hidden = self._queued or self._plain_forward(inputs)
            self._queued = None
        clock.lap("verify", logits, hidden)
        seen = self.history if history is None else history
        # processors see host token lists
        drafted = draft.tolist() if processors and draft.size else []
        logprobs = scored_logprobs(logits, seen, drafted, processors)
        if queue_plain and not draft.size and not processors:
            choice = sampler(logprobs)  # [1], lazy
            self._queued = queue_after(
                choice, logprobs, lambda: self._plain_forward(choice)
            )
            n, token = 0, choice.item()  # the host waits here, the device goes on
        else:
            q = self.drafter.draft_probs if draft.size else None
            n, token = verify_draft(draft, logprobs, sampler, q)  # one host sync
        clock.lap("sampling")
        draft = draft.tolist()
        self._verified = (len(draft), n, hidden)
        self.timed_unfairly = took_queued != (self._queued is not None)
        return draft[:n] + [token], logprobs, n

    def _plain_forward(self, token: mx.array):
        """token: [1] -> (logits [1, V], hidden [1, H] or None), lazy, the
        caches advanced as by a plain decoding step (KV quantization included)."""
        logits, hidden = self.target.forward(token)
        self._quantize()
        return logits, hidden

    def settle_queued(self):
        """A queued plain pass that will not be verified has processed the
        last token: the caches hold the whole history."""
        if self._queued is not None:
            self.last_hidden, self._queued = self._queued[1], None
            self.processed = len(self.history)

    def draft_source(self, k: int, look: bool = True):
        """Which of the drafter's sources would draft ``k`` tokens next
        (None: a one-source drafter); see ``contract.SelfJudging``."""
        if not isinstance(self.drafter, SelfJudging):
            return None
        return self.drafter.draft_source(k, look)

    def next_draft(self, k: int) -> mx.array:
        """Up to ``k`` drafts for the next pass: [m] uint32, lazy where the
        drafter drafts on the device (no host synchronisation)."""
        if self.drafter is None or k == 0:
            return NO_DRAFT
        return self.drafter.draft_tokens(k)

    def commit(
        self,
        tokens: List[int],
        process_last: bool = False,
        clock: Optional[PhaseClock] = None,
    ):
        """Keep ``tokens``, a non-empty prefix of what :meth:`verify` emitted.

        Every layer, the drafter and the history are left as plain decoding
        leaves them after emitting ``tokens``; the last one stays pending,
        unless ``process_last`` and the pass already processed it (it was an
        accepted draft, as when a stop token ends the generation).
        """
        drafted, n, hidden = self._verified
        self._verified = None
        j = len(tokens)
        kept = j + (process_last and j <= n)  # inputs [pending, d1..] kept
        if drafted:  # a plain pass was a plain decoding step already
            self.cache.commit(kept)
            self._quantize()
        if clock is not None:
            clock.lap("commit", [c.state for c in self.cache.caches])
        self.advance(drafted, n, tokens, kept, hidden)
        if process_last:
            self.settle_queued()

    def advance(self, drafted: int, n: int, tokens: List[int], kept: int, hidden):
        """The bookkeeping of a pass whose caches kept ``kept`` inputs and
        which emitted ``tokens`` (``n`` of ``drafted`` drafts accepted):
        statistics, the drafter, the history. hidden: [T, H] of the pass or None."""
        j = len(tokens)
        self.stats.record(drafted, min(n, j), j)
        if self.drafter is not None:
            self.drafter.accept(tokens, None if hidden is None else hidden[:j])
        self.history += tokens
        self.processed = len(self.history) - (kept == j)
        if kept > j and hidden is not None:
            self.last_hidden = hidden[kept - 1 : kept]


def _blank_first(parts: List[mx.array], n: int) -> mx.array:
    """``parts`` ([L_i, H], lazy) concatenated, the first ``n`` rows zeros:
    a part wholly among them is never evaluated (in a prompt's prefill, the
    last layer's MLP and the final norm of rows no drafter reads)."""
    rows = []
    for part in parts:
        blank = min(n, part.shape[0])
        n -= blank
        if blank:
            rows.append(mx.zeros((blank,) + part.shape[1:], part.dtype))
        if blank < part.shape[0]:
            rows.append(part[blank:])
    return mx.concatenate(rows)


def speculative_generate_step(
    prompt: mx.array,
    model,
    drafter,
    *,
    num_draft_tokens: Union[int, str] = 3,
    verify_costs: Optional[List[float]] = None,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable]] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stop_tokens: Collection[int] = (),
    decoder: Optional[SpeculativeDecoder] = None,
    should_stop: Callable[[], bool] = lambda: False,
    flush: bool = False,
    timing: bool = False,
    stats: Optional[SpecStats] = None,
    **decoder_args,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs [V], from_draft)`` like mlx-lm's ``generate_step``.

    prompt: [N] token ids. Each iteration drafts up to ``num_draft_tokens``
    tokens (``"auto"``: chosen per pass by :class:`DraftLengthPolicy` from
    ``verify_costs``, else the measured profiles),
    verifies ``[last, *draft]`` in one target pass, yields the longest prefix
    the target agrees with plus the target's own next token, and rolls every
    cache back to what was yielded (also when the caller stops early).
    Generation stops after a ``stop_tokens`` token or ``max_tokens`` tokens,
    or after the pass during which ``should_stop()`` became true. ``decoder``
    continues an earlier generation (chat); ``flush`` processes the last
    token at the end, as mlx-lm does (the caches then hold every token);
    ``timing`` fills ``stats.phases`` (at the cost of extra syncs).
    """
    auto = num_draft_tokens == "auto"
    max_draft = most_drafts(num_draft_tokens)
    if decoder is None:
        decoder = SpeculativeDecoder(
            model, drafter, max_draft, stats=stats, **decoder_args
        )
    group = pipeline_group(model)
    policy = make_policy(model, verify_costs, group) if auto else None
    # Plain passes are queued ahead (mlx-lm's pipelining; the decoder skips
    # it for logits processors) unless timing syncs each phase or the ranks
    # of a pipeline must agree on each pass.
    pipelined = not timing and group is None
    sampler = sampler or make_sampler(0.0)
    stats, progress = decoder.stats, prompt_progress_callback or (lambda *_: None)

    tokens = prompt.tolist()
    history = list(tokens)  # what logits processors see: this call's tokens
    if decoder.drafter is not None:
        decoder.drafter.set_sampling(
            make_draft_sampler(sampler, logits_processors, history)
        )
    progress(0, len(tokens))
    if policy:  # the drafter judges in hindsight from the prompt's rows on
        policy.exchange(decoder.drafter)
    decoder.feed(tokens, lambda n: progress(n, len(tokens)))
    clock = PhaseClock(stats, timing)
    produced, done = 0, False
    try:  # a caller that stops early closes us at a yield: GeneratorExit
        while not done:
            clock.lap("host")
            room = min(max_draft, max_tokens - produced - 1, decoder.draft_room())
            context = len(decoder.history)
            if policy:
                policy.exchange(decoder.drafter)
            source = decoder.draft_source(room) if policy else None
            k = policy.choose(room, context, source) if policy else room
            plain_next = (
                policy.next_is_plain() if policy else decoder.drafter is None or k == 0
            )
            queue = pipelined and plain_next and produced + 1 < max_tokens
            tic = time.perf_counter()
            emitted, logprobs, n = decoder.verify(
                k, sampler, logits_processors, history, clock, queue
            )
            seconds = time.perf_counter() - tic  # the caller's time excluded
            if policy:
                policy.update(decoder.drafted, n, decoder.draft_seconds)
            if produced == 0:
                progress(len(tokens), len(tokens))
            stop = next((i for i, t in enumerate(emitted) if t in stop_tokens), None)
            emitted = emitted if stop is None else emitted[: stop + 1]
            produced += len(emitted)
            done = stop is not None or produced >= max_tokens or should_stop()
            yielded = []
            try:
                for i, token in enumerate(emitted):
                    yielded.append(token)
                    yield token, logprobs[i], i < n
            finally:  # also when the caller stops early: keep what it saw
                ends = done or len(yielded) < len(emitted)
                tic = time.perf_counter()
                decoder.commit(yielded, process_last=ends, clock=clock)
            if policy and not decoder.timed_unfairly:
                policy.observe_pass(
                    decoder.drafted, seconds + time.perf_counter() - tic, context
                )
            history += emitted
    except GeneratorExit:
        if flush:
            decoder.flush()
        raise
    if flush:
        decoder.flush()
