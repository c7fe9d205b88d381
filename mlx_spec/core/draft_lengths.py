"""The draft lengths of a pass's ``auto`` rows: one choice function for one
row and for many.

Every row of a pass is computed over the same ``T = 1 + the longest draft``
positions, and the rows drafting with the model's MTP head run its steps
together, so one row's longer draft makes every row pay. So ``auto`` rows
share draft lengths, one per :class:`RowGroup`: ``k`` for the rows whose
drafts cost nothing per token (copies, and a block drafter's block: one
draft forward whatever ``k``, priced per drafting row), ``k_h`` for the rows
drafting with the head, the pair maximising

    sum over auto rows of E_b(k or k_h)  /  cost(pass)

``E_b(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from each row's acceptance
estimates (:class:`~mlx_spec.core.policy.Acceptance`), and ``cost`` the
engine's :class:`~mlx_spec.core.pass_cost.PassCost` of ``B`` rows over ``T``
positions, ``k_h`` head steps, the catch-up the head rows' drafts run, the
draft forwards of the drafting rows whose drafter runs one, and, while plain
passes run queued ahead, the break of that queue a draft causes. A
sequence decoded alone is a batch of one: its one row is the whole of its
group, and the pair is its own best length.

Each group then explores as ``docs/auto_policy.md`` describes, with its own
state (:class:`GroupState`): a probe at ``k = 0`` now and then
(:class:`~mlx_spec.core.probe_schedule.ProbeSchedule`, spaced by what probes
cost), a depth probe (one draft more while the next position is barely
tested and nearly as good), and a cost probe (a plain pass now and then
while drafting, so the cost of ``k = 0`` is measured, not extrapolated).
Constants: the engine's :class:`~mlx_spec.core.policy_tuning.PolicyTuning`.
"""

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Sequence, Tuple

from ..drafters.contract import HEAD_SOURCE
from ..models.pipeline import from_rank0
from .cost_profile import SHORT_CONTEXT
from .pass_cost import PassCost, PassShape
from .probe_schedule import ProbeSchedule


class RowGroup(Enum):
    """The rows sharing a draft length: copies (a block drafter's rows too:
    each draft position costs the verify pass alone), or the MTP head's
    drafts."""

    COPIES = "copies"
    HEAD = "head"


Pair = Tuple[int, int]  # the lengths (k, k_h) of the copy rows and the head rows
_INDEX = {RowGroup.COPIES: 0, RowGroup.HEAD: 1}


def _with(pair: Pair, g: RowGroup, k: int) -> Pair:
    """``pair`` with group ``g``'s length ``k``."""
    return (k, pair[1]) if g is RowGroup.COPIES else (pair[0], k)


def group_of_source(source) -> RowGroup:
    """The group drafts of a named source belong to."""
    return RowGroup.HEAD if source == HEAD_SOURCE else RowGroup.COPIES


@dataclass(frozen=True)
class Candidate:
    """An ``auto`` row as the choice sees it."""

    group: RowGroup
    acceptance: Sequence[float]  # a_i of its active source, per position
    evidence: Sequence[float]  # its decayed trials per position
    cap: int  # the most drafts it may make this pass
    forwards: bool = False  # its draft runs a forward of its own (any length)


@dataclass(frozen=True)
class PassRequest:
    """What the choice of a pass's draft lengths reads."""

    rows: int  # rows the pass computes
    candidates: Tuple[Candidate, ...]  # the auto rows
    fixed: int = 0  # the longest draft of the other rows (the pass computes 1 + it)
    others: float = 0.0  # the other rows' expected tokens
    others_drafting: int = 0  # of them, rows that draft
    head_fixed: int = 0  # head steps the other rows run
    head_catch_up: int = 0  # positions of the catch-up head rows' drafts would run
    context: int = SHORT_CONTEXT  # tokens before the pass, averaged over rows
    # Positions a pass without head drafts runs anyway: one a pass for each
    # head whose upkeep has not stopped (its deferred rows, run in batches).
    head_upkeep: int = 0
    others_forwarding: int = 0  # other rows whose draft runs a forward of its own
    # Edges of the plain passes' queue a draft causes: 2 while plain passes
    # run queued ahead (this pass is one: a draft ends the queue here and the
    # pass after it restarts it), else 0 (no queue to break).
    queue_edges: int = 0


@dataclass(frozen=True)
class Verdict:
    """What one row's verified drafts said of its group's first position."""

    evidence: float  # its decayed trials there before the pass
    accepted: bool  # its first draft was accepted


@dataclass
class GroupState:
    """A group's exploration: its probes, its decayed count of timed plain
    passes, its last best length and its last choice."""

    probes: ProbeSchedule
    plain_weight: float = 0.0
    best: int = 0  # the last best length, before exploring
    last_choice: int = 0
    deepened: bool = False  # the last choice was a depth probe
    chosen: bool = False  # it has chosen for a pass (it has had rows)
    plain_run: int = 0  # choices in a row whose best length was 0

    def next_is_plain(self) -> bool:
        """Whether its next choice will draft nothing (said before it is
        made): drafting did not pay at the last choice, no probe is due."""
        return self.best == 0 and self.probes.plain_next()


@dataclass
class _Table:
    """The pass's expected tokens and seconds for every pair (k, k_h). It is
    filled before every pass, for up to 16 x 9 pairs, so each length's forward
    and the fitted coefficients are looked up once."""

    request: PassRequest
    tokens: Dict[RowGroup, List[float]]  # group -> expected tokens per length
    drafting: Dict[RowGroup, List[int]]  # group -> rows drafting per length
    forwarding: Dict[RowGroup, List[int]]  # of them, rows running a draft forward
    theta: List[float]  # the cost model's coefficients
    forward: Dict[int, float] = field(default_factory=dict)  # T -> forward seconds
    seconds: Dict[Pair, float] = field(default_factory=dict)


class DraftLengths:
    """The shared draft lengths of an engine's ``auto`` rows, its passes
    priced by ``cost``; ``group``: the ranks of a pipeline, which must
    verify the same number of tokens (rank 0's choice is used)."""

    def __init__(self, cost: PassCost, group=None):
        self.cost, self.group, self.tuning = cost, group, cost.tuning
        self.states = {g: GroupState(ProbeSchedule(self.tuning)) for g in RowGroup}

    # -- choosing ------------------------------------------------------------
    def choose(self, request: PassRequest) -> Dict[RowGroup, int]:
        """Each group's draft length for the pass ``request`` describes (0
        for a group without rows)."""
        members = {g: [c for c in request.candidates if c.group is g] for g in RowGroup}
        limits = {g: max((c.cap for c in members[g]), default=0) for g in RowGroup}
        table = _Table(
            request,
            {g: _group_tokens(members[g], limits[g] + 1) for g in RowGroup},
            {g: _drafting(members[g], limits[g] + 1) for g in RowGroup},
            {g: _forwarding(members[g], limits[g] + 1) for g in RowGroup},
            self.cost.coefficients(),
        )
        best, best_speed = (0, 0), None  # (k, k_h)
        for k in range(limits[RowGroup.COPIES] + 1):
            for kh in range(limits[RowGroup.HEAD] + 1):
                speed = self._speed(table, (k, kh))
                if best_speed is None or speed > best_speed:
                    best, best_speed = (k, kh), speed
        chosen = dict(zip(RowGroup, best))
        for g in RowGroup:
            if members[g]:
                chosen[g] = self._explore(g, best, members[g], limits[g], table)
        if self.group is not None:
            chosen = {g: from_rank0(self.group, k) for g, k in chosen.items()}
        for g in RowGroup:
            if members[g]:
                state = self.states[g]
                state.last_choice, state.chosen = chosen[g], True
                state.plain_run = state.plain_run + 1 if state.best == 0 else 0
        return chosen

    def _explore(self, g, best: Pair, members, limit: int, table: _Table) -> int:
        """Group ``g``'s length: its best (in ``best``, the other group at
        its own) or a probe of one draft, a depth probe or a cost probe."""
        t, state = self.tuning, self.states[g]
        k = state.best = best[_INDEX[g]]
        if k == 0 and state.last_choice:
            # Drafting stopped (or a probe ran): the next probe waits by what
            # a draft costs, as fitted (a probe's own time: observe).
            probe = self.cost.cost(self._probe_shape(table, best, g, members))
            state.probes.space(probe, self._seconds(table, _with(best, g, 0)))
        k = state.probes.apply(k, limit)
        state.deepened = False
        if 0 < state.best < limit and sum(c.evidence[k] for c in members) < (
            t.depth_evidence
        ):
            # A depth probe: the next position is barely tested by the group
            # (its estimates may be stale; the rows' trials pooled, as a
            # probe's), likely reached, and one more draft looks nearly as
            # good.
            reach = sum(math.prod(c.acceptance[:k]) for c in members) / len(members)
            deeper = self._speed(table, _with(best, g, k + 1))
            near = deeper >= (1 - t.depth_margin) * self._speed(table, best)
            if reach >= t.depth_reach and near:
                k, state.deepened = k + 1, True
        if k and self.cost.weight and state.plain_weight < t.plain_probe_weight:
            k, state.probes.probing = 0, False  # a cost probe: a plain pass now
            state.deepened = False
        return k

    def _shape(self, table: _Table, ks: Pair) -> PassShape:
        r = table.request
        k, kh = ks
        copies, head = RowGroup.COPIES, RowGroup.HEAD
        drafting = table.drafting[copies][k] + table.drafting[head][kh]
        forwarding = table.forwarding[copies][k] + table.forwarding[head][kh]
        T = 1 + max(k, kh, r.fixed)
        return PassShape(
            r.rows,
            T,
            drafting + r.others_drafting,
            max(kh, r.head_fixed),
            r.head_catch_up if kh else r.head_upkeep,
            r.context,
            forwarding + r.others_forwarding,
            r.queue_edges if T > 1 else 0,  # a plain pass keeps the queue
        )

    def _probe_shape(self, table: _Table, ks, g: RowGroup, members) -> PassShape:
        """The pass with group ``g``'s rows ``members`` drafting one token
        each, the other group at its length."""
        shape = self._shape(table, _with(ks, g, 0))
        head = g is RowGroup.HEAD
        return PassShape(
            shape.rows,
            max(shape.T, 2),
            shape.drafting + len(members),
            max(shape.head_steps, 1) if head else shape.head_steps,
            table.request.head_catch_up if head else shape.catch_up,
            shape.context,
            shape.draft_forwards + sum(1 for c in members if c.forwards),
            table.request.queue_edges,  # a probe drafts: it breaks the queue
        )

    def _seconds(self, table: _Table, ks: Pair) -> float:
        """The pass's cost with lengths ``ks`` (``PassCost.cost``'s
        arithmetic, over the table's forwards and coefficients)."""
        seconds = table.seconds.get(ks)
        if seconds is None:
            shape = self._shape(table, ks)
            forward = table.forward.get(shape.T)
            if forward is None:
                forward = self.cost.forward(shape.rows * shape.T, shape.context)
                table.forward[shape.T] = forward
            f = self.cost.features(shape, forward)
            seconds = max(sum(a * b for a, b in zip(f, table.theta)), 1e-9)
            table.seconds[ks] = seconds
        return seconds

    def _speed(self, table: _Table, ks: Pair) -> float:
        """Expected tokens a second of the pass with lengths ``ks``."""
        copies, head = table.tokens[RowGroup.COPIES], table.tokens[RowGroup.HEAD]
        tokens = table.request.others + copies[ks[0]] + head[ks[1]]
        return tokens / self._seconds(table, ks)

    # -- learning ------------------------------------------------------------
    def judged(self, g: RowGroup):
        """First drafts of group ``g`` were judged without a verify pass:
        they stand in for its probes (the next waits a full interval)."""
        self.states[g].probes.restart()

    def probed(self, g: RowGroup, verdicts: Sequence[Verdict]):
        """The rows of group ``g`` that verified drafts, each a
        :class:`Verdict`: a probe, if the last choice was one, says what it
        found for the group as a whole. Its first position's evidence is the
        group's, pooled: in a batch some row of many accepts nearly every
        probe, and a new row always has little evidence of its own, so a
        row's verdict would keep every probe of the batch in a streak."""
        probes = self.states[g].probes
        if probes.probing and verdicts:
            accepted = any(v.accepted for v in verdicts)
            probes.probed(accepted, sum(v.evidence for v in verdicts))

    def observe(self, shape: PassShape, seconds: float, drafted: Dict[RowGroup, int]):
        """A pass of ``shape`` took ``seconds`` (one forward, or an edge of
        the queue its shape counts); ``drafted``: the drafts each group that
        chose lengths for it made."""
        if not 0 < seconds < 60:
            return  # a clock anomaly
        if not self.cost.observe(shape, seconds):
            return  # a warm-up pass
        plain = PassShape(shape.rows, 1, 0, 0, 0, shape.context)
        for g, n in drafted.items():
            state = self.states[g]
            if n and state.best == 0:  # what this probe took
                state.probes.space(seconds, self.cost.cost(plain))
            counted = 0.0 if n else 1.0
            state.plain_weight = self.tuning.cost_decay * state.plain_weight + counted

    def dropped(self, g: RowGroup):
        """Group ``g`` chose to draft in a pass that ran a forward queued
        ahead, so nothing was drafted: its next pass drafts at least a probe.
        Else a fit that prices drafting as paying only at queued passes would
        choose drafts that are never made, and the rows would never be
        verified, their acceptance never learnt."""
        self.states[g].probes.due()

    def exploring(self) -> bool:
        """Whether the last choice was a probe or a depth probe (its drafts
        are tried for what they teach, not for what they are expected to
        yield)."""
        return any(s.probes.probing or s.deepened for s in self.states.values())

    def next_is_plain(self) -> bool:
        """Whether the next pass drafts nothing (said before it is chosen):
        no group that has chosen would draft or probe (a group without rows
        yet drafts nothing), so a plain pass may be queued now. Unknown, so
        False, before any choice."""
        chosen = [s for s in self.states.values() if s.chosen]
        return bool(chosen) and all(s.next_is_plain() for s in chosen)

    def paying(self, g: RowGroup) -> bool:
        """Whether group ``g`` drafts or probes at its next choice."""
        return not self.states[g].next_is_plain()

    def resting(self, g: RowGroup) -> bool:
        """Whether group ``g``'s drafters may stop their upkeep (asked after
        a choice): its best length has been 0 for ``tuning.suspend_after``
        choices and it drafts nothing now (a probe resumes them)."""
        state = self.states[g]
        return state.plain_run >= self.tuning.suspend_after and state.last_choice == 0


def _drafting(members: List[Candidate], n: int) -> List[int]:
    """``rows[k]`` for ``k < n``: how many rows of ``members`` draft at all
    with ``k`` drafts each (those that may draft)."""
    return [sum(1 for c in members if min(k, c.cap) > 0) for k in range(n)]


def _forwarding(members: List[Candidate], n: int) -> List[int]:
    """Of :func:`_drafting`'s rows, those whose draft runs a forward."""
    return _drafting([c for c in members if c.forwards], n)


def _group_tokens(members: List[Candidate], n: int) -> List[float]:
    """``tokens[k]`` for ``k < n``: what ``members`` yield together with
    ``k`` drafts each, the sum over rows of
    :func:`~mlx_spec.core.policy.expected_tokens` of ``min(k, cap)``. Each
    row's running sums are taken once, with that function's arithmetic (the
    same floats), instead of once for every ``k``."""
    running = []
    for c in members:
        tokens, survive, sums = 1.0, 1.0, [1.0]
        for a in c.acceptance[: min(c.cap, n - 1)]:
            survive *= a
            tokens += survive
            sums.append(tokens)
        running.append(sums)
    return [sum(r[min(k, len(r) - 1)] for r in running) for k in range(n)]
