"""One row's draft lengths, chosen pass by pass by a test: the engine's one
choice function (:class:`~mlx_spec.core.draft_lengths.DraftLengths`) over
one row's acceptance estimates, as a sequence decoded alone uses them, with
the test standing in for the passes (what was drafted, accepted and timed).
"""

from typing import Optional

from ..core.cost_profile import SHORT_CONTEXT, as_cost_profile
from ..core.draft_lengths import (
    Candidate,
    DraftLengths,
    PassRequest,
    RowGroup,
    group_of_source,
    Verdict,
)
from ..core.pass_cost import PassCost, PassShape
from ..core.policy import RowAcceptance
from ..core.policy_tuning import DEFAULT_TUNING, PolicyTuning
from ..core.scheduler import exchange
from ..drafters.contract import MAX_AUTO_DRAFT_TOKENS


class OneRow:
    """A lone row's choice of draft lengths. ``costs``: a :class:`PassCost`,
    or the verify profile it is made over (seconds for T = 1..n, with
    ``long_profile``: (a longer context, its profile)); ``source``: the
    draft source of its passes unless a call names another (the MTP head's
    drafts are head steps, in the head's group)."""

    def __init__(
        self,
        costs,
        long_profile=None,
        tuning: PolicyTuning = DEFAULT_TUNING,
        source: Optional[str] = None,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
    ):
        if not isinstance(costs, PassCost):
            costs = PassCost(as_cost_profile(costs, long_profile), tuning=tuning)
        self.cost, self.source = costs, source
        self.lengths = DraftLengths(costs)
        most = min(max_draft, len(costs.profile) - 1)
        self.estimates = RowAcceptance(most, costs.tuning)
        self.estimates.select(source)

    def _group(self, source=None) -> RowGroup:
        return group_of_source(self.source if source is None else source)

    @property
    def group(self) -> RowGroup:
        """The group of the source of the last choice."""
        return self._group(self._source)

    @property
    def _source(self):
        active = self.estimates.active
        return next(s for s, e in self.estimates.by_source.items() if e is active)

    # -- the choice, as the engine asks it -------------------------------------
    def choose(
        self,
        limit: int,
        context: int = SHORT_CONTEXT,
        source: Optional[str] = None,
        catch_up: int = 0,
    ) -> int:
        """Drafts for the next pass (after ``context`` tokens; ``catch_up``:
        positions the head catches up on before it drafts), at most ``limit``."""
        source = self.source if source is None else source
        estimate = self.estimates.select(source)
        group = self._group(source)
        cap = min(limit, len(estimate.drafted))
        candidate = Candidate(group, estimate.acceptance(), estimate.drafted, cap)
        head_catch_up = catch_up if group is RowGroup.HEAD else 0
        request = PassRequest(
            1, (candidate,), head_catch_up=head_catch_up, context=context
        )
        return self.lengths.choose(request)[group]

    def update(self, n_drafted: int, n_accepted: int):
        """The pass verified ``n_drafted`` drafts, accepted ``n_accepted``."""
        estimate = self.estimates.active
        if n_drafted:
            verdict = Verdict(estimate.drafted[0], n_accepted > 0)
            self.lengths.probed(self.group, [verdict])
        estimate.update(n_drafted, n_accepted)

    def observe_pass(self, n_drafted: int, seconds: float, context=SHORT_CONTEXT):
        """The pass with ``n_drafted`` drafts took ``seconds`` (after
        ``context`` tokens)."""
        shape = self.shape(n_drafted, context)
        self.lengths.observe(shape, seconds, {self.group: n_drafted})

    def observe_hindsight(self, hits: int, trials: int, source=None):
        """``trials`` first drafts judged without a verify pass, ``hits``
        right (of ``source``: by default the row's)."""
        source = self.source if source is None else source
        self.estimates.of(source).observe_hindsight(hits, trials)
        if trials > 0:
            self.lengths.judged(self._group(source))

    def exchange(self, drafter):
        """What the engine does with a drafter before each choice."""
        exchange(self.estimates, self.lengths, drafter)

    def next_is_plain(self) -> bool:
        return self.lengths.next_is_plain()

    # -- what it knows -----------------------------------------------------------
    def acceptance(self, source=None):
        source = self.source if source is None else source
        return self.estimates.of(source).acceptance()

    @property
    def best(self) -> int:
        return self.lengths.states[self.group].best

    @property
    def last_choice(self) -> int:
        return self.lengths.states[self.group].last_choice

    @property
    def probe_every(self) -> int:
        return self.lengths.states[self.group].probes.every

    def shape(self, k: int, context: int = SHORT_CONTEXT, catch_up: int = 0):
        """The shape of its pass with ``k`` drafts, alone."""
        head = self.group is RowGroup.HEAD
        drafting = 1 if k else 0
        return PassShape(
            1, 1 + k, drafting, k if head else 0, catch_up if k else 0, context
        )

    def pass_cost(self, k: int, context: int = SHORT_CONTEXT, catch_up: int = 0):
        return self.cost.cost(self.shape(k, context, catch_up))

    def verify_cost(self, k: int, context: int) -> float:
        return self.cost.profile.verify_cost(k, context)
