"""The scheduler: the engine's rows turned into a pass plan.

Each pass it chooses every active row's draft length (a fixed number, or for
``auto`` rows the lengths :class:`~.draft_lengths.DraftLengths` chooses for
their group), lets the rows drafting with the model's MTP head draft
together (:class:`~mlx_spec.core.batch_mtp.MTPBatch`), has every row draft,
and weighs the copies found against a plain pass. After the pass it tells
each row's acceptance estimates and the choice what the pass found and what
it took.
"""

from dataclasses import replace
from typing import Collection, Dict, List, Optional, Tuple

from ..drafters import calls
from ..drafters.contract import HEAD_SOURCE
from .batch_mtp import MTPBatch, head_drafter
from .draft_lengths import (
    Candidate,
    DraftLengths,
    PassRequest,
    RowGroup,
    Verdict,
    group_of_source,
)
from .pass_cost import PassCost, PassShape
from .pass_plan import Forward, PassPlan
from .policy import RowAcceptance, expected_tokens, pass_cost_model
from .policy_tuning import PolicyTuning
from .verify_profile import cost_profile


class Scheduler:
    """Plans the passes of one engine (over ``model``; ``group``: the ranks of
    a pipeline; ``tuning``: the constants of ``auto``). Its cost model and
    choice exist once an ``auto`` row has joined (:meth:`price`)."""

    def __init__(self, model, max_draft: int, group, tuning: PolicyTuning):
        self.model, self.max_draft, self.group = model, max_draft, group
        self.tuning = tuning
        self.cost: Optional[PassCost] = None  # what its passes cost, fitted
        self.lengths: Optional[DraftLengths] = None  # the auto rows' lengths

    def price(self, verify_costs: Optional[List[float]], drafter):
        """The cost model and the choice of an engine with ``auto`` rows (one
        model prices every row's passes), ready for a row of ``drafter``:
        its profile covers the drafter's longest ``auto`` draft, and a draft
        forward of its own is priced."""
        tokens = 1 + min(self.max_draft, calls.max_auto_draft(drafter))
        if self.cost is None:
            self.cost = pass_cost_model(self.model, verify_costs, self.tuning, tokens)
            self.lengths = DraftLengths(self.cost, self.group)
        elif verify_costs is None and len(self.cost.profile) < tokens:
            cost_profile(self.model, self.tuning, tokens)  # extended in place
        if calls.forwards_to_draft(drafter):
            self.cost.price_draft_forward(calls.draft_forward_cost(drafter))

    def acceptance(self, drafter) -> RowAcceptance:
        """A new ``auto`` row's acceptance estimates (its drafter's longest
        ``auto`` draft, as far as the profile prices it)."""
        most = min(self.max_draft, calls.max_auto_draft(drafter))
        return RowAcceptance(min(most, len(self.cost.profile) - 1), self.tuning)

    # -- a pass --------------------------------------------------------------
    def plan(
        self,
        rows,
        active: List[int],
        heads: Optional[MTPBatch],
        queued: Optional[Forward] = None,
    ) -> PassPlan:
        """The next pass over ``rows`` (a
        :class:`~mlx_spec.core.batch.BatchDecoder`'s), ``active`` the indices
        of those decoding; ``heads``: the MTP heads the engine runs together;
        ``queued``: a plain pass's forward the pass before started (its rows
        then draft nothing, but the choice still counts the pass)."""
        edges = 0 if queued is None else 2  # a draft would break the queue
        ks, groups = self._lengths(rows, active, heads, edges)
        if queued is not None:  # it was started over every row's one token
            for g in {groups[b] for b in groups if ks[b] > 0}:
                self.lengths.dropped(g)
            ks = dict.fromkeys(active, 0)
        head_steps, catch_up = 0, 0
        if heads is not None:  # head rows first, all at once
            drafting = [(rows[b].decoder.drafter, k) for b, k in ks.items()]
            head_steps, catch_up = heads.draft_rows(drafting)
        else:  # a head of its own catches up on its rows as it drafts
            catch_up = head_catch_up(rows, [b for b in active if ks[b]])
        drafts = {b: rows[b].draft(ks[b], heads) for b in active}
        if heads is None:
            on_device = [d for d in drafts.values() if d.on_device]
            head_steps = max((len(d) for d in on_device), default=0)
            catch_up = catch_up if on_device else 0
        if not head_steps:  # the heads' upkeep, one row each, as it is priced
            catch_up = catch_up or head_upkeep(rows, active)
        context = sum(len(rows[b].decoder.history) for b in active) // len(active)
        forwards = sum(
            1
            for b, d in drafts.items()
            if len(d) and calls.forwards_to_draft(rows[b].decoder.drafter)
        )
        plan = PassPlan(
            drafts, len(rows), head_steps, catch_up, context, queued, groups, forwards
        )
        return plan if self.copies_pay(rows, plan) else plan.without_drafts()

    def _lengths(
        self,
        rows,
        active: List[int],
        heads: Optional[MTPBatch],
        queue_edges: int = 0,
    ) -> Tuple[Dict[int, int], Dict[int, RowGroup]]:
        """Each active row's draft length, and the group of each ``auto``
        row (``queue_edges``: 2 when this pass runs queued ahead, so a draft
        would end the queue and restart it after, else 0). A fixed number
        stays; ``auto`` rows take their group's length.
        Then a copy row drafting less than the longest draft drafts up to
        that length as far as it may: the pass computes every row over the
        same ``1 + longest`` positions, so those drafts cost nothing. A head
        row's would not: each of its drafts is a head step."""
        ks, caps, auto, head_rows, forwarding = {}, {}, [], set(), set()
        for b in active:
            row = rows[b]
            drafter = row.decoder.drafter
            room = min(row.max_draft, row.remaining - 1, row.decoder.draft_room())
            if drafter is None:
                ks[b] = caps[b] = 0
                continue
            caps[b] = room
            if calls.forwards_to_draft(drafter):
                forwarding.add(b)
            if row.acceptance is not None:
                caps[b] = min(room, row.decoder.max_draft, row.acceptance.max_draft)
                self._exchange(row)
            if not calls.can_draft(drafter):
                caps[b] = 0  # no copy, no head row: one token, whatever its acceptance
            # A head the engine runs with others is caught up later, with them;
            # one of its own may be run now to name the source.
            head = head_drafter(drafter)
            look = head is None or heads is None or head not in heads
            source = row.decoder.draft_source(caps[b], look=look)
            if head is not None and (source == HEAD_SOURCE or head is drafter):
                head_rows.add(b)
            if row.acceptance is None:
                ks[b] = caps[b]
            else:
                row.acceptance.select(source)
                auto.append(b)
        groups = {b: RowGroup.HEAD if b in head_rows else RowGroup.COPIES for b in auto}
        if auto:
            candidates = tuple(
                Candidate(
                    groups[b],
                    rows[b].acceptance.active.acceptance(),
                    rows[b].acceptance.active.drafted,
                    caps[b],
                    b in forwarding,
                )
                for b in auto
            )
            request = PassRequest(
                rows=len(rows),
                candidates=candidates,
                fixed=max(ks.values(), default=0),
                others=float(len(ks)),  # rows not auto: one token each, at least
                others_drafting=sum(1 for k in ks.values() if k > 0),
                others_forwarding=sum(
                    1 for b, k in ks.items() if k and b in forwarding
                ),
                head_fixed=max((ks[b] for b in head_rows if b in ks), default=0),
                head_catch_up=head_catch_up(rows, [b for b in auto if b in head_rows]),
                head_upkeep=head_upkeep(rows, active),
                context=sum(len(rows[b].decoder.history) for b in active)
                // len(active),
                queue_edges=queue_edges,
            )
            chosen = self.lengths.choose(request)
            ks.update({b: min(chosen[groups[b]], caps[b]) for b in auto})
            for b in auto:  # before any row drafts: a resumed head drafts current
                rest(rows[b].acceptance, self.lengths, rows[b].decoder.drafter)
        longest = max(ks.values())
        filled = {
            b: k if b in head_rows else max(k, min(longest, caps[b]))
            for b, k in ks.items()
        }
        return filled, groups

    def _exchange(self, row):
        exchange(row.acceptance, self.lengths, row.decoder.drafter)

    def copies_pay(self, rows, plan: PassPlan) -> bool:
        """Whether the copies the ``auto`` rows found are worth their pass
        (by the cost model) against a plain one. The length was chosen from
        each row's acceptance, which counts only the drafts a row made: a
        copy row finding no match drafts nothing, yet the pass is as long as
        its longest row. Drafts of the head (its steps are taken), of
        fixed-length rows and of a probe always pay; so do all drafts in a
        pipeline, whose ranks each fit their own cost model and would have to
        agree on every pass once more."""
        T = plan.T
        if T == 1 or self.lengths is None or self.group is not None:
            return True
        if self.lengths.exploring():
            return True
        tokens = 0.0
        for b, draft in plan.drafts.items():
            row = rows[b]
            if len(draft) and (row.acceptance is None or draft.on_device):
                return True
            acceptance = row.acceptance.active.acceptance() if row.acceptance else []
            tokens += expected_tokens(acceptance, len(draft))
        B, context = plan.rows, plan.context
        shape = PassShape(B, T, plan.drafting, 0, 0, context, plan.forwards)
        spec = self.cost.cost(shape)
        plain = self.cost.cost(PassShape(B, 1, 0, 0, 0, context))
        return tokens / spec >= len(plan.drafts) / plain

    def next_is_plain(self) -> bool:
        """Whether no ``auto`` row would draft or probe in the next pass."""
        return self.lengths is None or self.lengths.next_is_plain()

    # -- after a pass ----------------------------------------------------------
    def learn(self, rows, plan: PassPlan, verdicts: Dict[int, Tuple[int, int]]):
        """What the pass's ``auto`` rows found (``verdicts``: row index ->
        (drafts verified, accepted)): a probe's verdict for its group, then
        each row's acceptance."""
        for g in set(plan.groups.values()):
            found = [
                Verdict(rows[b].acceptance.active.drafted[0], verdicts[b][1] > 0)
                for b, group in plan.groups.items()
                if group is g and b in verdicts and verdicts[b][0] > 0
            ]
            self.lengths.probed(g, found)
        for b in plan.groups:
            if b in verdicts:
                rows[b].acceptance.update(*verdicts[b])

    def observe(
        self,
        plan: PassPlan,
        drafted: Dict[int, int],
        seconds: float,
        queue_edges: int = 0,
    ):
        """The pass took ``seconds``; ``queue_edges``: 1 when it ended or
        restarted the queue of plain passes (it did not time one forward:
        see :class:`~.pass_cost.PassShape`), else 0; ``drafted``: row index
        -> drafts it verified."""
        if self.lengths is None:
            return
        by_group = {g: 0 for g in set(plan.groups.values())}
        for b, g in plan.groups.items():
            by_group[g] += drafted.get(b, 0)
        shape = replace(plan.shape, queue_edges=queue_edges)
        self.lengths.observe(shape, seconds, by_group)


def exchange(acceptance: RowAcceptance, lengths: DraftLengths, drafter):
    """A row's drafter's first drafts judged in hindsight go to its
    ``acceptance`` (and stand in for its group's probes); the drafter is told
    which of its sources pay now (their group drafts or probes at its next
    choice)."""
    for source, trials in acceptance.learn_hindsight(drafter).items():
        if trials > 0:
            lengths.judged(group_of_source(source))
    for source in acceptance.by_source:
        if source is not None:
            paying = lengths.paying(group_of_source(source))
            calls.tell_paying(drafter, source, paying)


def rest(acceptance: RowAcceptance, lengths: DraftLengths, drafter):
    """After a choice: the row's drafter's sources whose group has drafted
    nothing for a while, this pass included, stop their upkeep; the others
    (drafting or probing now) resume theirs."""
    for source in acceptance.by_source:
        if source is not None:
            resting = lengths.resting(group_of_source(source))
            calls.rest(drafter, source, resting)


def head_catch_up(rows, drafting: Collection[int]) -> int:
    """Positions of the catch-up that runs before the rows ``drafting`` draft
    with their heads: every member head's row, padded to the longest of the
    drafting heads' deferred rows (see
    :meth:`~mlx_spec.core.batch_mtp.MTPBatch.catch_up`; a row alone: its own
    head's deferred rows). Rows without a head add nothing."""
    heads = [head_drafter(row.decoder.drafter) for row in rows]
    members = sum(1 for h in heads if h is not None)
    pending = (heads[b].rows.pending_rows for b in drafting if heads[b] is not None)
    return members * max(pending, default=0)


def head_upkeep(rows, active: Collection[int]) -> int:
    """Head rows a pass runs whatever it drafts, on average: one for each
    ``active`` row whose head's upkeep has not stopped (its accepted rows are
    run in batches, some pass or other); a suspended head's are not."""
    heads = (head_drafter(rows[b].decoder.drafter) for b in active)
    return sum(1 for h in heads if h is not None and not h.rows.suspended)
