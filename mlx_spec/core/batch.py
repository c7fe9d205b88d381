"""The decode engine: the active sequences drafted, verified and committed in one pass.

One sequence decoded alone is a batch of one. A :class:`BatchDecoder` decodes
up to ``n_slots`` sequences; a sequence joins (:meth:`~BatchDecoder.add`) as a
prefilled :class:`~mlx_spec.core.sequence.SpeculativeDecoder` (which owns its
history, prefill and drafter) and leaves (:meth:`~BatchDecoder.take`) as one
again, between passes, without changing the others' tokens. Its rows live in
:mod:`.row_caches`: side by side in a batch's caches (rows are appended and
removed as they join and leave, so no pass computes an empty slot), or, for
a sequence alone (:meth:`BatchDecoder.alone`), in its own caches. Each pass
(:meth:`~BatchDecoder.step`, or :meth:`~BatchDecoder.verify` then
:meth:`~BatchDecoder.commit`):

1. every active row drafts with its own drafter and draft length (0 allowed);
   in a batch, the rows drafting with the model's MTP head run its steps
   together (:class:`~mlx_spec.core.batch_mtp.MTPBatch`: one ``[B, 1]`` forward
   per step), each getting the draft its drafter computes alone, left on the
   device as the pass's input (the host waits once a pass, for the verdicts);
2. the target runs once over ``[B, T]`` tokens, ``T = 1 + the longest draft``;
   shorter rows are padded at the end and masked (attention: each row sees
   only its own positions; GDN: padded tokens leave the state unchanged);
3. each row verifies its own draft (its own logits processors, then greedy
   or rejection sampling with its own sampler), stops at a stop token or its
   token budget, and commits its own accepted prefix: attention rows move
   their own offsets back, GDN rows take their own per-token state.

So each row's tokens are those it would get decoded alone.

A row whose own sampler or logits processor raises fails alone
(:mod:`.row_guard`): it keeps nothing of the pass, is stopped, and
:meth:`BatchDecoder.error` names what it raised; the other rows' pass goes on.
"""

import time
from dataclasses import dataclass
from typing import Collection, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

from ..models.packed import pack_positions
from ..models.pipeline import pipeline_group
from .batch_mtp import MTPBatch, head_drafter
from .batch_row import BatchRow
from .batch_policy import (
    PassLength,
    copies_pay,
    draft_lengths,
    head_catch_up,
    plain_ahead,
)
from .sequence import NO_DRAFT, SpeculativeDecoder
from .pass_cost import PassCost, PassShape
from .policy import pass_cost_model, policies_by_source
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from .row_caches import BatchCaches, RowCaches, SequenceCaches
from .row_guard import RowFailed, RowGuard
from .sampling import make_draft_sampler, make_sampler
from .stats import PhaseClock, SpecStats
from .target import Target, queue_after


class _Verdict(NamedTuple):
    """A row's part of a verified pass, until :meth:`BatchDecoder.commit`."""

    drafted: int  # drafts verified
    accepted: int  # of them, accepted
    emitted: List[int]  # accepted drafts and the target's token, truncated


@dataclass
class _Verified:
    """A verified pass awaiting :meth:`BatchDecoder.commit`."""

    started: float  # perf_counter at the start of the pass
    T: int
    hidden: Optional[mx.array]  # [B, T, H]
    verdicts: Dict[int, _Verdict]  # row index -> its part
    contexts: Dict[int, int]  # row index -> tokens before the pass
    took_queued: bool  # its forward was queued by the pass before
    queued_next: bool  # it queued the next pass (its caches committed)
    shape: PassShape  # what it computed, for the cost model


class BatchDecoder:
    """Up to ``n_slots`` sequences decoded together, one target pass per step.

    Sequences are named by the id :meth:`add` returns. ``row_caches``: where
    the rows live (default: a batch's own, :class:`BatchCaches`);
    ``tuning``: the constants of its ``auto`` rows' policies."""

    def __init__(
        self,
        model,
        n_slots: int,
        max_draft: int,
        rollback: str = "store",
        row_caches: Optional[RowCaches] = None,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ):
        self.model, self.n_slots, self.max_draft = model, n_slots, max_draft
        self.tuning = tuning
        self.group = pipeline_group(model)
        if row_caches is None:
            row_caches = BatchCaches(model, max_draft, rollback, self.group is not None)
        self.row_caches = row_caches
        self.target = Target(model, row_caches)
        self.positions = pack_positions(model)  # MLPs and head skip the padding
        self.rows: List[BatchRow] = []  # the batch's rows, in cache order
        self.heads: Optional[MTPBatch] = None  # the rows' MTP heads, run together
        self.cost: Optional[PassCost] = None  # what its passes cost, fitted
        self.lengths: Optional[PassLength] = None  # the auto rows' shared length
        self.clock = PhaseClock(SpecStats())  # phase timings, off by default
        self._queued = None  # (logits, hidden) of a plain pass queued ahead
        self._verified: Optional[_Verified] = None
        self._next_id = 0

    @classmethod
    def alone(
        cls, decoder: SpeculativeDecoder, tuning: PolicyTuning = DEFAULT_TUNING
    ) -> "BatchDecoder":
        """A batch of one decoding ``decoder`` in its own caches (its KV
        quantization and prompt cache included)."""
        caches = SequenceCaches(decoder.cache, decoder.kv)
        return cls(
            decoder.model, 1, decoder.max_draft, row_caches=caches, tuning=tuning
        )

    @property
    def caches(self) -> list:
        return self.row_caches.caches

    @property
    def gdn(self) -> list:
        """The GDN layers' caches."""
        return self.row_caches.gdn

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
        seen: Optional[List[int]] = None,
    ) -> int:
        """Move ``decoder`` (fed: one pending token) into the batch; its id.
        ``logits_processors`` (mlx-lm's) see ``seen`` (default: the
        decoder's history) and the row's tokens since, as mlx-lm's decoding
        shows them."""
        if not decoder.pending:
            raise ValueError("the decoder has no pending token: feed it first")
        if self.free == 0:
            raise RuntimeError(f"all {self.n_slots} slots are in use")
        decoder.update_drafter()
        self._unqueue()
        self.row_caches.join(decoder.cache, len(self.rows))
        if self.row_caches.shared:
            self._join_head(decoder.drafter)
        guard = RowGuard()
        sampler = guard.sampler(sampler or make_sampler(0.0))
        processors = guard.processors(logits_processors)
        seen = list(decoder.history if seen is None else seen)
        if decoder.drafter is not None:
            choose = make_draft_sampler(sampler, processors, seen)
            decoder.drafter.set_sampling(guard.chooser(choose))
        auto = num_draft_tokens == "auto"
        most = self.max_draft if auto else min(num_draft_tokens, self.max_draft)
        policy = None
        if auto and decoder.drafter is not None:
            if self.cost is None:  # one model prices every row's passes
                self.cost = pass_cost_model(self.model, verify_costs, self.tuning)
            policy = policies_by_source(self.cost, self.max_draft, self.group)
            if self.lengths is None and self.n_slots > 1:
                self.lengths = PassLength(self.cost, self.group)
        id, self._next_id = self._next_id, self._next_id + 1
        stops = set(stop_tokens)
        row = BatchRow(id, decoder, sampler, policy, most, max_tokens, stops)
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
        self.row_caches.leave(b, decoder.cache)
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
        if self._verified is None:  # else the pass's commit sees it stop
            self._unqueue()
        row.done = True

    def accepted(self, id: int) -> int:
        """How many drafts of sequence ``id`` the pass being verified
        accepted (its first emitted tokens)."""
        b = self._index(id)
        return self._verified.verdicts[b].accepted

    @property
    def queued(self) -> bool:
        """Whether the next pass, a plain one, is already running."""
        return self._queued is not None

    # -- one pass ------------------------------------------------------------
    def step(self, queue_ahead: bool = True) -> Dict[int, Tuple[List[int], mx.array]]:
        """One pass over the active rows, committed: each one's emitted tokens
        and their log-probabilities [j, V]. ``queue_ahead=False``: never queue
        the next pass (a row joins before it, which would roll it back)."""
        out = self.verify(queue_ahead)
        self.commit()
        return out

    def verify(self, queue_ahead: bool = True) -> Dict[int, Tuple[List[int], mx.array]]:
        """Draft, run the target once and verify each active row: what each
        one emits (accepted drafts, then the target's token; up to a stop
        token or its budget) and their log-probabilities [j, V].
        :meth:`commit` must follow before anything else changes the batch."""
        if self._verified is not None:
            raise RuntimeError("verify() called twice without commit()")
        active = [b for b, r in enumerate(self.rows) if not r.done]
        if len(active) < len(self.rows):
            self._unqueue()  # a row stopped in the pass that queued this one
        if not active:
            return {}
        started, clock = time.perf_counter(), self.clock
        # counts this pass
        ks = draft_lengths(self.rows, active, self.lengths, self.heads or ())
        queued, self._queued = self._queued, None
        if queued is not None:  # it was started over every row's one token
            ks = dict.fromkeys(active, 0)
        head_steps, catch_up = 0, 0
        if self.heads is not None:  # head rows first, all at once
            drafting = [(self.rows[b].decoder.drafter, k) for b, k in ks.items()]
            head_steps, catch_up = self.heads.draft_rows(drafting)
        else:  # a head of its own catches up on its rows as it drafts
            catch_up = head_catch_up(self.rows, [b for b in active if ks[b]])
        drafts, seconds = {}, {}  # b -> [m] draft; None: made on the device
        for b in active:
            drafts[b], seconds[b] = self.rows[b].draft(ks[b], self.heads)
        on_device = {b for b in active if seconds[b] is None}  # heads' drafts
        if self.heads is None:
            head_steps = max((len(drafts[b]) for b in on_device), default=0)
            catch_up = catch_up if on_device else 0
        if not copies_pay(self, drafts, on_device):
            drafts = dict.fromkeys(active, NO_DRAFT)
        clock.lap("draft", *(drafts[b] for b in on_device))

        T = 1 + max(len(d) for d in drafts.values())
        lengths = [0] * len(self.rows)
        for b in active:
            lengths[b] = 1 + len(drafts[b])
        ragged = queued is None and any(n < T for n in lengths)  # some padding
        if queued is None:
            self.row_caches.begin(lengths if ragged else None, T)
        with self.positions.ragged(lengths if ragged else None, T):
            logits, hidden = queued or self.target.forward_rows(
                self._pass_inputs(drafts, seconds, T), self.positions
            )
        clock.lap("verify", logits, hidden)

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, T, V]
        ahead = queue_ahead and plain_ahead(self, active, T)
        plain = self._queue_plain(logprobs) if ahead else None
        verdicts, out = {}, {}
        for b in active:
            row, draft = self.rows[b], drafts[b]
            try:
                n, token, scores = row.verify(
                    draft,
                    logits[b, : lengths[b]],
                    logprobs[b, : lengths[b]],
                    plain is not None,
                )
            except RowFailed:  # it keeps nothing of the pass; the others go on
                row.done = True
                continue
            if plain is not None:  # sampled as verify_draft samples a plain pass
                n, token = 0, plain[b]
            draft = draft.tolist()
            emitted = row.truncate(draft[:n] + [token])
            verdicts[b] = _Verdict(len(draft), n, emitted)
            out[row.id] = (emitted, scores[: len(emitted)])
        clock.lap("sampling")
        contexts = {b: len(self.rows[b].decoder.history) for b in active}
        drafting = sum(len(d) > 0 for d in drafts.values())
        context = sum(contexts.values()) // len(contexts)
        self._verified = _Verified(
            started,
            T,
            hidden,
            verdicts,
            contexts,
            queued is not None,
            plain is not None,
            PassShape(len(self.rows), T, drafting, head_steps, catch_up, context),
        )
        return out

    def commit(self, kept_tokens: Optional[Dict[int, int]] = None):
        """Keep what :meth:`verify` emitted. ``kept_tokens``: id -> how many
        of its emitted tokens a row keeps (at least one; fewer ends the row:
        its caller stopped reading). Every layer, the drafters and the
        histories are left as plain decoding leaves them after those tokens;
        a row's last token stays pending unless the row ended and the pass
        processed it already."""
        p, self._verified = self._verified, None
        if p is None:
            return
        kept = [0] * len(self.rows)
        for b, v in p.verdicts.items():
            row, emitted = self.rows[b], v.emitted
            j = (kept_tokens or {}).get(row.id, len(emitted))
            if j < len(emitted):
                emitted, row.done = emitted[:j], True
            row.seen.extend(emitted)  # in place: the draft sampler reads it
            kept[b] = j + (row.done and j <= v.accepted)  # inputs kept
            if row.policy:  # it learns what drafting costs, as alone
                row.policy.update(v.drafted, v.accepted)
            h = None if p.hidden is None else p.hidden[b]
            row.decoder.advance(v.drafted, v.accepted, emitted, kept[b], h)
        if not p.queued_next:  # else committed before the next was queued
            self._commit_caches(kept, p.T)
        if self.clock.enabled:
            self.clock.lap("commit", [c.state for c in self.row_caches.caches])
        # A pass that queued the next one without running its own queued
        # forward, or the reverse, did not time one forward.
        if p.took_queued == p.queued_next:
            self._observe(p, time.perf_counter() - p.started)

    def _observe(self, p: _Verified, seconds: float):
        """What the pass cost, for the model that prices the ``auto`` rows'
        passes; a row alone tells its own policy, which chose the draft
        length as one sequence does (and spaces its probes by it)."""
        if self.cost is None:
            return
        if len(self.rows) == 1 and self.rows[0].policy is not None:
            if 0 in p.verdicts:
                drafted = p.verdicts[0].drafted
                self.rows[0].policy.observe_pass(
                    drafted, seconds, p.contexts[0], p.shape
                )
            return
        self.cost.observe(p.shape, seconds)

    def settle(self):
        """A pass queued ahead that will not be verified processed each
        row's last token: keep it, so the caches hold every row's whole
        history (as mlx-lm's do after its decoding; a row's drafter never
        saw that token's hidden row, as after a stop token)."""
        if self._queued is None:
            return
        (_, hidden), self._queued = self._queued, None
        self._commit_caches([1] * len(self.rows), 1)
        for b, row in enumerate(self.rows):
            row.decoder.processed = len(row.decoder.history)
            if hidden is not None:
                row.decoder.last_hidden = hidden[b]

    def _commit_caches(self, kept: List[int], T: int):
        """Every row keeps ``kept[b]`` of the pass's ``T`` inputs (0: the row
        as before the pass)."""
        self.row_caches.commit(kept, T)

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
        self.row_caches.begin(None, 1)
        return self.target.forward_rows(choices[:, None])

    def _unqueue(self):
        """Roll a queued pass back (rows join, leave or stop): no row keeps a
        token it was not given. A sequence's own caches took it as a plain
        decoding step, which does not roll back: it is kept (:meth:`settle`)."""
        if self._queued is None:
            return
        if not self.row_caches.shared:
            self.settle()
        else:
            self._queued = None
            self._commit_caches([0] * len(self.rows), 1)

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
