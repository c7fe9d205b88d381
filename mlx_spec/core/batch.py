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

from ..drafters import calls
from ..models.packed import pack_positions
from ..models.pipeline import pipeline_group
from .batch_mtp import MTPBatch, head_drafter
from .batch_row import BatchRow
from .pass_plan import Forward, PassPlan
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from .queue_ahead import QueueAhead, plain_tokens
from .row_caches import BatchCaches, RowCaches, SequenceCaches
from .row_guard import RowFailed, RowGuard
from .sampling import make_draft_sampler, make_sampler, verification_of
from .scheduler import Scheduler
from .sequence import SpeculativeDecoder
from .stats import PhaseClock, SpecStats
from .target import Target


class _Verdict(NamedTuple):
    """A row's part of a verified pass, until :meth:`BatchDecoder.commit`."""

    drafted: int  # drafts verified
    accepted: int  # of them, accepted
    emitted: List[int]  # accepted drafts and the target's token, truncated


@dataclass
class _Verified:
    """A verified pass awaiting :meth:`BatchDecoder.commit`."""

    started: float  # perf_counter at the start of the pass
    plan: PassPlan
    hidden: Optional[mx.array]  # [B, T, H]
    verdicts: Dict[int, _Verdict]  # row index -> its part
    queued_next: bool  # it queued the next pass (its caches committed)


@dataclass(frozen=True)
class RowOptions:
    """How a sequence joining the engine decodes: its token budget, sampler
    (None: greedy), draft length (``"auto"`` or a number), stop tokens and
    mlx-lm logits processors (they see ``seen``, default: the decoder's
    history, and the row's tokens since); ``verify_costs``: the verify
    profile ``auto`` prices passes by (None: the model's measured one)."""

    max_tokens: int
    sampler: Optional[object] = None
    num_draft_tokens: object = "auto"
    verify_costs: Optional[List[float]] = None
    stop_tokens: Collection[int] = ()
    logits_processors: Optional[list] = None
    seen: Optional[List[int]] = None


class BatchDecoder:
    """Up to ``n_slots`` sequences decoded together, one target pass per step.

    Sequences are named by the id :meth:`add` returns. ``row_caches``: where
    the rows live (default: a batch's own, :class:`BatchCaches`);
    ``tuning``: the constants of its ``auto`` rows' choice."""

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
        self.group = pipeline_group(model)
        if row_caches is None:
            row_caches = BatchCaches(model, max_draft, rollback, self.group is not None)
        self.row_caches = row_caches
        self.target = Target(model, row_caches)
        self.positions = pack_positions(model)  # MLPs and head skip the padding
        self.rows: List[BatchRow] = []  # the batch's rows, in cache order
        self.heads: Optional[MTPBatch] = None  # the rows' MTP heads, run together
        self.scheduler = Scheduler(model, max_draft, self.group, tuning)
        self.ahead = QueueAhead(self)  # a plain pass queued ahead, if any
        self.clock = PhaseClock(SpecStats())  # phase timings, off by default
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
    def cost(self):
        """The model pricing its passes (None before an ``auto`` row joins)."""
        return self.scheduler.cost

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

    @property
    def queued(self) -> bool:
        """Whether the next pass, a plain one, is already running."""
        return self.ahead.queued

    def _index(self, id: int) -> int:
        for i, r in enumerate(self.rows):
            if r.id == id:
                return i
        raise KeyError(f"no sequence {id} in the batch")

    # -- joining and leaving -------------------------------------------------
    def add(self, decoder: SpeculativeDecoder, options: RowOptions) -> int:
        """Move ``decoder`` (fed: one pending token) into the batch to decode
        as ``options`` say; its id."""
        if not decoder.pending:
            raise ValueError("the decoder has no pending token: feed it first")
        if self.free == 0:
            raise RuntimeError(f"all {self.n_slots} slots are in use")
        decoder.update_drafter()
        self.ahead.unqueue()
        self.row_caches.join(decoder.cache, len(self.rows))
        if self.row_caches.shared:
            self._join_head(decoder.drafter)
        guard = RowGuard()
        raw = options.sampler or make_sampler(0.0)
        verification = verification_of(raw)
        sampler = guard.sampler(raw)
        processors = guard.processors(options.logits_processors)
        seen = list(decoder.history if options.seen is None else options.seen)
        if decoder.drafter is not None:
            choose = make_draft_sampler(sampler, processors, seen, verification)
            calls.set_sampling(decoder.drafter, guard.chooser(choose))
        k = options.num_draft_tokens
        auto = k == "auto"
        most = self.max_draft if auto else min(k, self.max_draft)
        acceptance = None
        if auto and decoder.drafter is not None:
            self.scheduler.price(options.verify_costs, decoder.drafter)
            acceptance = self.scheduler.acceptance(decoder.drafter)
        id, self._next_id = self._next_id, self._next_id + 1
        stops = set(options.stop_tokens)
        row = BatchRow(
            id, decoder, sampler, acceptance, most, options.max_tokens, stops
        )
        row.processors, row.seen, row.guard = processors, seen, guard
        row.verification = verification
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
        self.ahead.unqueue()
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
            self.ahead.unqueue()
        row.done = True

    def accepted(self, id: int) -> int:
        """How many drafts of sequence ``id`` the pass being verified
        accepted (its first emitted tokens)."""
        b = self._index(id)
        return self._verified.verdicts[b].accepted

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
            self.ahead.unqueue()  # a row stopped in the pass that queued this one
        if not active:
            return {}
        started = time.perf_counter()
        plan = self.scheduler.plan(self.rows, active, self.heads, self.ahead.take())
        self.clock.lap(
            "draft", *(d.tokens for d in plan.drafts.values() if d.on_device)
        )
        logits, hidden = plan.queued or self.forward(plan)
        self.clock.lap("verify", logits, hidden)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, T, V]
        plain = None
        if queue_ahead and self.ahead.pays(plan, active):
            plain = self.ahead.queue(logprobs)
        queued_next = plain is not None
        if plan.T == 1 and plain is None:
            plain = plain_tokens(self.rows, active, logprobs)
        out = self.accept(plan, logits, logprobs, plain)
        self._verified = _Verified(started, plan, hidden, out.verdicts, queued_next)
        self.clock.lap("sampling")
        return out.emitted

    def forward(self, plan: PassPlan) -> Forward:
        """The target over the plan's ``[B, T]`` inputs: each active row's
        pending token and its draft, padded at the end (rows not active are
        padding throughout)."""
        lengths = plan.padded
        self.row_caches.begin(lengths, plan.T)
        with self.positions.ragged(lengths, plan.T):
            return self.target.forward_rows(self._inputs(plan), self.positions)

    def accept(self, plan: PassPlan, logits, logprobs, plain: Optional[Dict[int, int]]):
        """Each active row's verdict on its draft: greedy or rejection
        sampling against its own sampler and processors, then what it emits
        (up to a stop token or its budget); ``plain``: row index -> its token
        of a plain pass, sampled for every row at once. A row whose sampler
        or processors raise keeps nothing of the pass and stops."""
        verdicts, emitted = {}, {}
        lengths = plan.lengths
        for b, draft in plan.drafts.items():
            row = self.rows[b]
            n = lengths[b]
            try:
                accepted, token, scores = row.verify(
                    draft, logits[b, :n], logprobs[b, :n], plain is not None
                )
            except RowFailed:  # it keeps nothing of the pass; the others go on
                row.done = True
                continue
            if plain is not None:  # sampled as verify_draft samples a plain pass
                accepted, token = 0, plain[b]
            tokens = row.truncate(draft.tokens.tolist()[:accepted] + [token])
            verdicts[b] = _Verdict(len(draft), accepted, tokens)
            emitted[row.id] = (tokens, scores[: len(tokens)])
        return _Accepted(verdicts, emitted)

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
            kept[b] = j + (1 if row.done and j <= v.accepted else 0)  # inputs kept
            h = None if p.hidden is None else p.hidden[b]
            row.decoder.advance(v.drafted, v.accepted, emitted, kept[b], h)
        verdicts = {b: (v.drafted, v.accepted) for b, v in p.verdicts.items()}
        self.scheduler.learn(self.rows, p.plan, verdicts)
        if not p.queued_next:  # else committed before the next was queued
            self.row_caches.commit(kept, p.plan.T)
        if self.clock.enabled:
            self.clock.lap("commit", [c.state for c in self.row_caches.caches])
        # A pass that queued the next one without running its own queued
        # forward (it restarts the queue), or the reverse (it ends it), did
        # not time one forward: it is counted as an edge of the queue.
        drafted = {b: v.drafted for b, v in p.verdicts.items()}
        seconds = time.perf_counter() - p.started
        edges = 1 if (p.plan.queued is not None) != p.queued_next else 0
        self.scheduler.observe(p.plan, drafted, seconds, edges)

    def settle(self):
        """A pass queued ahead that will not be verified processed each
        row's last token: keep it (see :meth:`QueueAhead.settle`)."""
        self.ahead.settle()

    def _inputs(self, plan: PassPlan) -> mx.array:
        """[B, T] uint32: each active row's pending token and its draft (one
        made on the device written in on the device), padded at the end
        with 0."""
        T = plan.T
        tokens = [[0] * T for _ in self.rows]
        for b, draft in plan.drafts.items():
            tokens[b][0] = self.rows[b].decoder.history[-1]
            if len(draft) and not draft.on_device:  # on the host already
                tokens[b][1 : 1 + len(draft)] = draft.tokens.tolist()
        inputs = mx.array(tokens, mx.uint32)
        for b, draft in plan.drafts.items():
            if draft.on_device:
                inputs[b, 1 : 1 + len(draft)] = draft.tokens
        return inputs


class _Accepted(NamedTuple):
    """The verdicts of a pass (row index -> its part) and what each row
    emits (id -> tokens and their log-probabilities)."""

    verdicts: Dict[int, _Verdict]
    emitted: Dict[int, Tuple[List[int], mx.array]]
