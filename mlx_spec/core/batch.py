"""Batched speculative decoding: the active sequences verified in one target pass.

A :class:`BatchDecoder` decodes up to ``n_slots`` sequences. A sequence joins
(:meth:`add`) as a prefilled single-sequence :class:`SpeculativeDecoder` and
leaves (:meth:`take`) as one again, between passes, without changing the
others' tokens. The batched caches hold exactly the sequences present (rows
are appended and removed when they join and leave, so no pass computes an
empty slot). Each :meth:`step`:

1. every active row drafts with its own drafter and draft length (0 allowed);
   the rows drafting with the model's MTP head run its steps together
   (:class:`~mlx_spec.core.batch_mtp.MTPBatch`: one ``[B, 1]`` forward per
   step), each getting the draft its drafter computes alone, left on the
   device as the pass's input (the host waits once a pass, for the verdicts);
2. the target runs once over ``[B, T]`` tokens, ``T = 1 + the longest draft``;
   shorter rows are padded at the end and masked (attention: each row sees
   only its own positions; GDN: padded tokens leave the state unchanged);
3. each row verifies its own draft (its own logits processors, then greedy
   or rejection sampling with its own sampler) and commits its own accepted
   prefix: attention rows move their own offsets back, GDN rows take their
   own per-token state.

So each row's tokens are those it would get decoded alone.

A row whose own sampler or logits processor raises fails alone
(:mod:`.row_guard`): it keeps nothing of the pass, is stopped, and
:meth:`BatchDecoder.error` names what it raised; the other rows' pass goes on.
"""

import time
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Tuple

import mlx.core as mx

from ..models.packed import pack_positions
from ..models.pipeline import pipeline_group
from .batch_mtp import MTPBatch, head_drafter
from .batch_policy import PassLength, draft_lengths, expected_tokens
from .decode import NO_DRAFT, SpeculativeDecoder
from .policy import SourcePolicies, policies_by_source
from .verify_profile import head_step_cost, verify_cost_profile
from .ragged_cache import RaggedKVCache
from .row_guard import RowFailed, RowGuard
from .sampling import make_draft_sampler, make_sampler, scored_logprobs
from .state import GDNSlotCache, verifiable_gdn_layers
from .target import Target, queue_after
from .verify import verify_draft


@dataclass
class _Row:
    id: int
    decoder: SpeculativeDecoder  # its drafter, history and stats
    sampler: object
    policy: Optional[SourcePolicies]  # auto: a draft-length policy per source
    max_draft: int
    remaining: int  # tokens it may still emit
    stop_tokens: Collection[int] = field(default_factory=set)
    processors: list = field(default_factory=list)  # mlx-lm logits processors
    seen: List[int] = field(default_factory=list)  # the tokens processors see
    done: bool = False
    guard: RowGuard = field(default_factory=RowGuard)  # its callables' failure


class BatchDecoder:
    """Up to ``n_slots`` sequences decoded together, one target pass per step.

    Sequences are named by the id :meth:`add` returns."""

    def __init__(self, model, n_slots: int, max_draft: int, rollback: str = "store"):
        self.model, self.n_slots, self.max_draft = model, n_slots, max_draft
        self.caches, self.gdn, self.attention = [], [], []
        self.group = pipeline_group(model)
        pipelined = self.group is not None
        for gdn in verifiable_gdn_layers(model):
            if gdn:
                c = GDNSlotCache(max_draft + 1, rollback, pipelined=pipelined)
                self.gdn.append(c)
            else:
                c = RaggedKVCache()
                self.attention.append(c)
            self.caches.append(c)
        self.target = Target(model, self)
        self.positions = pack_positions(model)  # MLPs and head skip the padding
        self.rows: List[_Row] = []  # the batch's rows, in cache order
        self.heads: Optional[MTPBatch] = None  # the rows' MTP heads, run together
        self.lengths: Optional[PassLength] = None  # the auto rows' shared length
        self._queued = None  # (logits, hidden) of a plain pass queued ahead
        self._next_id = 0

    @property
    def active(self) -> List[int]:
        """Ids of the sequences still decoding."""
        return [r.id for r in self.rows if not r.done]

    @property
    def free(self) -> int:
        return self.n_slots - len(self.rows)

    def _index(self, id: int) -> int:
        for i, r in enumerate(self.rows):
            if r.id == id:
                return i
        raise KeyError(f"no sequence {id} in the batch")

    # -- joining and leaving -------------------------------------------------
    def add(
        self,
        decoder: SpeculativeDecoder,
        max_tokens: int,
        sampler=None,
        num_draft_tokens="auto",
        verify_costs: Optional[List[float]] = None,
        stop_tokens: Collection[int] = (),
        logits_processors: Optional[list] = None,
    ) -> int:
        """Move ``decoder`` (fed: one pending token) into the batch; its id.
        ``logits_processors`` (mlx-lm's) see the decoder's history and the
        row's tokens since, as mlx-lm's decoding of that history shows them."""
        if not decoder.pending:
            raise ValueError("the decoder has no pending token: feed it first")
        if self.free == 0:
            raise RuntimeError(f"all {self.n_slots} slots are in use")
        decoder.update_drafter()
        self._unqueue()
        for mine, theirs in zip(self.caches, decoder.cache.caches):
            if isinstance(mine, RaggedKVCache):
                mine.append_row(theirs)
            else:
                mine.append_row(theirs, len(self.rows))
        self._join_head(decoder.drafter)
        guard = RowGuard()
        sampler = guard.sampler(sampler or make_sampler(0.0))
        processors, seen = guard.processors(logits_processors), list(decoder.history)
        if decoder.drafter is not None:
            choose = make_draft_sampler(sampler, processors, seen)
            decoder.drafter.set_sampling(guard.chooser(choose))
        auto = num_draft_tokens == "auto"
        most = self.max_draft if auto else min(num_draft_tokens, self.max_draft)
        policy = None
        if auto and decoder.drafter is not None:  # one sequence's pass costs
            costs = verify_costs or verify_cost_profile(self.model)
            head = head_step_cost(self.model) or 0.0
            policy = policies_by_source(
                costs, self.max_draft, self.group, head_cost=head
            )
            self.lengths = self.lengths or PassLength(costs, self.group)
        id, self._next_id = self._next_id, self._next_id + 1
        stops = set(stop_tokens)
        row = _Row(id, decoder, sampler, policy, most, max_tokens, stops)
        row.processors, row.seen, row.guard = processors, seen, guard
        self.rows.append(row)
        return id

    def error(self, id: int) -> Optional[Exception]:
        """What sequence ``id``'s own sampler or logits processors raised
        (None: nothing). A failed sequence is stopped; take it out."""
        return self.rows[self._index(id)].guard.error

    def take(self, id: int) -> SpeculativeDecoder:
        """Remove sequence ``id``; it leaves as a single-sequence decoder whose
        caches hold exactly what it decoded."""
        b = self._index(id)
        self._unqueue()
        decoder = self.rows.pop(b).decoder
        mtp = head_drafter(decoder.drafter)
        if self.heads is not None and mtp in self.heads:
            self.heads.leave(mtp)
        for mine, theirs in zip(self.caches, decoder.cache.caches):
            mine.take_row(b, theirs)
        return decoder

    def _join_head(self, drafter):
        """The batch runs the drafter's MTP head with the other rows' (a head
        that is not the model's drafts alone)."""
        mtp = head_drafter(drafter)
        if mtp is None:
            return
        if self.heads is None:
            self.heads = MTPBatch(mtp.head)
        if mtp.head is self.heads.head:
            self.heads.join(mtp)

    def finish(self, id: int):
        """Stop sequence ``id`` (a client went away, a stop word): it stays
        until taken, and no longer decodes."""
        row = self.rows[self._index(id)]
        self._unqueue()
        row.done = True

    @property
    def queued(self) -> bool:
        """Whether the next pass, a plain one, is already running."""
        return self._queued is not None

    # -- one pass ------------------------------------------------------------
    def step(self, queue_ahead: bool = True) -> Dict[int, Tuple[List[int], mx.array]]:
        """One verify pass over the active rows: each one's emitted tokens
        and their log-probabilities [j, V]. ``queue_ahead=False``: never queue
        the next pass (a row joins before it, which would roll it back)."""
        active = [b for b, r in enumerate(self.rows) if not r.done]
        if len(active) < len(self.rows):
            self._unqueue()  # a row stopped in the pass that queued this one
        if not active:
            return {}
        tic = time.perf_counter()
        ks = draft_lengths(self.rows, active, self.lengths)  # counts this pass
        queued, self._queued = self._queued, None
        if queued is not None:  # it was started over every row's one token
            ks = dict.fromkeys(active, 0)
        head_steps, catch_up = 0, 0
        if self.heads is not None:  # head rows first, all at once
            drafting = [(self.rows[b].decoder.drafter, k) for b, k in ks.items()]
            head_steps, catch_up = self.heads.draft_rows(drafting)
        drafts, seconds = {}, {}  # b -> [m] draft; None: made on the device
        for b in active:
            drafts[b], seconds[b] = self._draft(self.rows[b], ks[b])
        on_device = {b for b in active if seconds[b] is None}  # heads' drafts
        if not self._copies_pay(drafts, on_device):
            drafts = dict.fromkeys(active, NO_DRAFT)
        T = 1 + max(len(d) for d in drafts.values())
        B = len(self.rows)
        lengths = [0] * B
        for b in active:
            lengths[b] = 1 + len(drafts[b])
        ragged = queued is None and any(n < T for n in lengths)  # some padding
        if queued is None:
            for c in self.gdn:
                c.capturing = True
                c.set_row_lengths(lengths if ragged else None)
        with self.positions.ragged(lengths if ragged else None, T):
            logits, hidden = queued or self.target.forward_rows(
                self._pass_inputs(drafts, seconds, T), self.positions
            )
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, T, V]
        ahead = queue_ahead and self._plain_ahead(active, T)
        plain = self._queue_plain(logprobs) if ahead else None
        kept, out = [0] * B, {}
        for b in active:
            row, draft = self.rows[b], drafts[b]
            try:
                n, token, scores = self._verify_row(
                    row,
                    draft,
                    logits[b, : lengths[b]],
                    logprobs[b, : lengths[b]],
                    plain,
                )
            except RowFailed:  # it keeps nothing of the pass; the others go on
                row.done = True
                continue
            if plain is not None:  # sampled as verify_draft samples a plain pass
                n, token = 0, plain[b]
            draft = draft.tolist()
            emitted = self._truncate(row, draft[:n] + [token])
            row.seen.extend(emitted)  # in place: the draft sampler reads it
            j = len(emitted)
            kept[b] = j + (row.done and j <= n)
            out[row.id] = (emitted, scores[:j])
            if row.policy:  # it learns what drafting costs, as alone
                row.policy.update(len(draft), n, seconds[b])
            h = None if hidden is None else hidden[b]
            row.decoder.advance(len(draft), n, emitted, kept[b], h)
        if plain is None:  # else committed before the next pass was queued
            self._commit_caches(kept, T)
        # A pass that queued the next one without running its own queued
        # forward, or the reverse, did not time one forward (see decode.py).
        if self.lengths is not None and (queued is None) == (plain is None):
            elapsed = time.perf_counter() - tic
            self.lengths.observe(B, T, elapsed, head_steps, catch_up)
        return out

    def _verify_row(self, row: _Row, draft, logits, logprobs, plain):
        """``(accepted, next token, scores)`` of a row's part of the pass
        (its ``logits`` and ``logprobs`` [1 + len(draft), V]; ``scores``:
        the log-probabilities it samples from); ``plain`` (the tokens of a
        plain pass queued ahead): the row's token is chosen already (None
        here). Raises :class:`RowFailed` when the row's own sampler or
        logits processors raise, now or while it drafted."""
        if row.guard.error is not None:
            raise RowFailed(row.guard.error)
        scores = logprobs
        if row.processors:
            drafted = draft.tolist()  # processors see host token lists
            scores = scored_logprobs(logits, row.seen, drafted, row.processors)
        if plain is not None:
            return 0, None, scores
        q = row.decoder.drafter.draft_probs if len(draft) else None
        n, token = verify_draft(draft, scores, row.sampler, q)
        return n, token, scores

    def _copies_pay(
        self, drafts: Dict[int, mx.array], on_device: Collection[int] = ()
    ) -> bool:
        """Whether the copies the ``auto`` rows found are worth their pass
        (by the batch's cost model) against a plain one. The length was
        chosen from each row's acceptance, which counts only the drafts a row
        made: a copy row finding no match drafts nothing, yet the pass is as
        long as its longest row. Drafts of the head (its steps are taken),
        of fixed-length rows and of a probe always pay; so do all drafts in
        a pipeline, whose ranks each fit their own cost model and would have
        to agree on every pass once more."""
        lengths, T = self.lengths, 1 + max(len(d) for d in drafts.values())
        pipelined = self.group is not None
        if T == 1 or lengths is None or lengths.probing or pipelined:
            return True
        if len(self.rows) < 2:
            return True  # alone, a pass is as long as its own draft
        tokens = 0.0
        for b, draft in drafts.items():
            row = self.rows[b]
            if len(draft) and (row.policy is None or b in on_device):
                return True
            acceptance = row.policy.active.acceptance() if row.policy else []
            tokens += expected_tokens(acceptance, len(draft))
        B, cost = len(self.rows), lengths.cost
        return tokens / cost(B, T) >= len(drafts) / cost(B, 1)

    def _commit_caches(self, kept: List[int], T: int):
        """Every row keeps ``kept[b]`` of the pass's ``T`` inputs (0: the row
        as before the pass)."""
        for c in self.attention:
            c.trim_rows([T - k for k in kept])
        for c in self.gdn:
            c.commit(kept)
            c.set_row_lengths(None)

    def _plain_ahead(self, active: List[int], T: int) -> bool:
        """Whether the pass after this plain one drafts nothing either: every
        row decodes on and none drafts or probes next (its policy said so
        before choosing), so it may be queued now. Never in a pipeline,
        whose ranks agree on every pass."""
        if T > 1 or len(active) < len(self.rows) or self.group is not None:
            return False
        alone = len(self.rows) == 1
        for row in self.rows:
            if row.remaining <= 1 or row.processors:
                return False  # it finishes with this pass, or needs its history
            if row.decoder.drafter is None or row.max_draft == 0:
                continue
            if row.policy is None:
                return False  # a fixed draft length
            policy = row.policy if alone else self.lengths
            if not policy.next_is_plain():
                return False
        return True

    def _queue_plain(self, logprobs: mx.array) -> Optional[List[int]]:
        """Each row's token of this plain pass (logprobs: [B, 1, V]). This
        pass is committed and the next one, over these tokens, queued before
        the host waits for them, as mlx-lm decodes: the device computes it
        while the host does this pass's bookkeeping. None (nothing queued)
        when a row's sampler fails."""
        try:
            choices = mx.concatenate(
                [row.sampler(logprobs[b]) for b, row in enumerate(self.rows)]
            )  # [B]
        except RowFailed:  # that row fails in the pass, which queues nothing
            return None
        self._queued = queue_after(choices, logprobs, lambda: self._start_next(choices))
        return choices.tolist()

    def _start_next(self, choices: mx.array):
        """This plain pass committed, the next one's forward over ``choices``
        [B], capturing (a row may join, leave or stop before it is read)."""
        self._commit_caches([1] * len(self.rows), 1)
        for c in self.gdn:
            c.capturing = True
        return self.target.forward_rows(choices[:, None])

    def _unqueue(self):
        """Roll a queued pass back (rows join, leave or stop): no row keeps a
        token it was not given."""
        if self._queued is not None:
            self._queued = None
            self._commit_caches([0] * len(self.rows), 1)

    def _draft(self, row: _Row, k: int) -> Tuple[mx.array, Optional[float]]:
        """The row's draft of up to ``k`` tokens ([m], lazy where drafted on
        the device) and the seconds drafting took on the host (deferred
        drafter work excluded, as for one sequence; None for a draft made on
        the device, whose work no host timer sees)."""
        d = row.decoder
        if k <= 0:
            return NO_DRAFT, 0.0
        if head_drafter(d.drafter) not in (self.heads or ()):
            d.drafter.catch_up()
        tic = time.perf_counter()
        draft = d.next_draft(k)
        on_device = draft.size > 0 and d.drafter.drafted_on_device
        return draft, None if on_device else time.perf_counter() - tic

    def _pass_inputs(
        self, drafts: Dict[int, mx.array], seconds: Dict[int, Optional[float]], T: int
    ) -> mx.array:
        """[B, T] uint32: each active row's pending token and its draft (one
        made on the device written in on the device), padded at the end
        with 0."""
        tokens = [[0] * T for _ in self.rows]
        for b, draft in drafts.items():
            tokens[b][0] = self.rows[b].decoder.history[-1]
            if seconds[b] is not None and draft.size:  # on the host already
                tokens[b][1 : 1 + draft.size] = draft.tolist()
        inputs = mx.array(tokens, mx.uint32)
        for b, draft in drafts.items():
            if seconds[b] is None and draft.size:
                inputs[b, 1 : 1 + draft.size] = draft
        return inputs

    def _truncate(self, row: _Row, emitted: List[int]) -> List[int]:
        """``emitted`` up to a stop token or the row's token budget."""
        stop = next((i for i, t in enumerate(emitted) if t in row.stop_tokens), None)
        if stop is not None:
            emitted, row.done = emitted[: stop + 1], True
        if len(emitted) >= row.remaining:
            emitted, row.done = emitted[: row.remaining], True
        row.remaining -= len(emitted)
        return emitted
