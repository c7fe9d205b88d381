"""Choosing the draft length online: ``--num-draft-tokens auto``.

Each pass drafts the ``k`` that maximises expected tokens per second,
``E(k) / cost(k)``: ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from decayed
per-position acceptance estimates ``a_i`` (one policy per draft source), and
``cost(k)`` what a pass of ``1 + k`` tokens costs by the fitted
:class:`~mlx_spec.core.pass_cost.PassCost`, which the passes timed here
correct (a batch's rows share the batch's). ``k = 0`` is plain decoding;
exploration is a :class:`~mlx_spec.core.probe_schedule.ProbeSchedule` (one
draft now and then at ``k = 0``) and a depth probe (one draft more while the
next position is barely tested). Constants: :mod:`.policy_tuning`; the why
and the evidence: ``docs/auto_policy.md``.
"""

import math
from typing import List, Optional, Sequence, Tuple

from ..drafters.base import MAX_AUTO_DRAFT_TOKENS
from ..models.pipeline import from_rank0
from .cost_profile import SHORT_CONTEXT, as_cost_profile
from .pass_cost import PassCost, PassShape
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from .probe_schedule import ProbeSchedule, _ProbeFields
from .verify_profile import cost_profile, head_step_cost

HEAD_SOURCE = "mtp"  # the draft source of the model's MTP head


def most_drafts(num_draft_tokens) -> int:
    """The most tokens one pass drafts under ``num_draft_tokens`` ("auto"
    or a number)."""
    if num_draft_tokens == "auto":
        return MAX_AUTO_DRAFT_TOKENS
    return num_draft_tokens


def pass_cost_model(
    model,
    verify_costs: Optional[List[float]] = None,
    tuning: PolicyTuning = DEFAULT_TUNING,
) -> PassCost:
    """The pass-cost model of ``model``'s passes: over ``verify_costs`` (one
    profile, no growth with context) when given, else over the model's
    :class:`~mlx_spec.core.cost_profile.CostProfile` (measured or stored,
    corrected by the passes timed here), the MTP head's steps priced at
    first at their measured cost; its constants: ``tuning``."""
    if verify_costs is not None:
        return PassCost(as_cost_profile(verify_costs), tuning=tuning)
    profile = cost_profile(model, tuning)
    return PassCost(profile, head_step_cost(model) or 0.0, tuning)


def policies_by_source(
    costs,
    max_draft: int = MAX_AUTO_DRAFT_TOKENS,
    group=None,
    long_profile: Optional[Tuple[int, List[float]]] = None,
    tuning: PolicyTuning = DEFAULT_TUNING,
) -> "SourcePolicies":
    """A :class:`DraftLengthPolicy` per draft source, all pricing passes by
    one cost model (``costs``: a :class:`PassCost`, a :class:`CostProfile`,
    or a list of seconds with ``long_profile`` and ``tuning``); the MTP
    head's drafts are its steps."""
    if not isinstance(costs, PassCost):
        costs = PassCost(as_cost_profile(costs, long_profile), tuning=tuning)
    return SourcePolicies(
        lambda source: DraftLengthPolicy(
            costs, max_draft, group, steps=source == HEAD_SOURCE
        )
    )


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a pass with ``k`` drafts yields on average (accepted + 1):
    ``1 + sum_{j<=k} prod_{i<=j} a_i`` from per-position acceptance ``a_i``."""
    tokens, survive = 1.0, 1.0
    for a in acceptance[:k]:
        survive *= a
        tokens += survive
    return tokens


class DraftLengthPolicy(_ProbeFields):
    """Online choice of the number of drafts per verify pass.

    ``verify_costs``: the :class:`PassCost` that prices its passes (shared
    with the other sources' policies and a batch's), or what one is made
    over: a :class:`CostProfile`, or the profile after ``SHORT_CONTEXT``
    tokens of context (seconds, index 0 = 1 token) with ``long_profile``:
    (a longer context, its profile), without which the cost does not grow
    with context. ``steps``: its drafts are steps of a drafter the pass
    waits for (the MTP head's, priced per step; a copy's cost no step).
    ``group``: the ranks of a pipeline, which time their passes differently
    but must verify the same number of tokens: rank 0's choice is used.
    ``tuning``: its constants, when ``verify_costs`` is not a model with its
    own (a :class:`PassCost`'s or a :class:`CostProfile`'s)."""

    def __init__(
        self,
        verify_costs,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        group=None,
        long_profile: Optional[Tuple[int, List[float]]] = None,
        steps: bool = False,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ):
        self.group = group
        if not isinstance(verify_costs, PassCost):
            profile = as_cost_profile(verify_costs, long_profile)
            verify_costs = PassCost(profile, tuning=tuning)
        self.cost: PassCost = verify_costs
        self.tuning = self.cost.tuning
        self.steps = steps
        self.max_draft = min(max_draft, len(self.cost.profile) - 1)
        self.accepted = [0.0] * self.max_draft  # decayed counts per position
        self.drafted = [0.0] * self.max_draft
        self._plain_weight = 0.0  # decayed count of timed passes without drafts
        self.probes = ProbeSchedule(self.tuning)
        self.last_choice = self.best = 0

    def acceptance(self) -> List[float]:
        """Estimated conditional acceptance a_i per draft position.

        A position with little evidence borrows the estimate of the one before
        it (acceptance changes slowly with depth), so a deeper draft is tried
        once shallower drafts prove reliable.
        """
        t = self.tuning
        rates, prior = [], t.prior_acceptance
        for a, d in zip(self.accepted, self.drafted):
            prior = (a + prior * t.prior_weight) / (d + t.prior_weight)
            rates.append(prior)
        return rates

    def verify_cost(self, k: int, context: int) -> float:
        """Seconds of a verify forward over 1 + k tokens after ``context``."""
        return self.cost.profile.verify_cost(k, context)

    def shape(self, k: int, context: int = SHORT_CONTEXT, catch_up: int = 0):
        """The :class:`PassShape` of its pass with ``k`` drafts, alone."""
        steps = k if self.steps else 0
        return PassShape(1, 1 + k, int(k > 0), steps, catch_up if k else 0, context)

    def pass_cost(
        self, k: int, context: int = SHORT_CONTEXT, catch_up: int = 0
    ) -> float:
        """Expected seconds of a pass with ``k`` drafts after ``context``
        tokens, ``catch_up`` positions of the head's catch-up first."""
        return self.cost.cost(self.shape(k, context, catch_up))

    def expected_speed(
        self, k: int, context: int = SHORT_CONTEXT, catch_up: int = 0
    ) -> float:
        """Expected tokens per second with ``k`` drafts."""
        tokens = expected_tokens(self.acceptance(), k)
        return tokens / self.pass_cost(k, context, catch_up)

    def choose(
        self, limit: int, context: int = SHORT_CONTEXT, catch_up: int = 0
    ) -> int:
        """Drafts for the next pass (after ``context`` tokens; ``catch_up``:
        positions the head catches up on before it drafts), at most ``limit``."""
        limit = min(limit, self.max_draft)
        speeds = [self.expected_speed(k, context, catch_up) for k in range(limit + 1)]
        best = max(range(limit + 1), key=speeds.__getitem__)
        self.best = best
        if best == 0 and self.last_choice:
            # Drafting stopped (or a probe ran): the next probe waits by what
            # a draft costs, as fitted (a probe's own time: observe_pass).
            self.probes.space(
                self.pass_cost(1, context, catch_up), self.pass_cost(0, context)
            )
        best = self.probes.apply(best, limit)
        t = self.tuning
        if 0 < self.best < limit and self.drafted[best] < t.depth_evidence:
            # A depth probe: the next position is barely tested (its estimate
            # may be stale), likely reached, and one more draft looks nearly
            # as good.
            reach = math.prod(self.acceptance()[:best])
            near = speeds[best + 1] >= (1 - t.depth_margin) * speeds[best]
            best += reach >= t.depth_reach and near
        if best and self.cost.weight and self._plain_weight < t.plain_probe_weight:
            best, self.probes.probing = 0, False  # a cost probe: a plain pass now
        if self.group is not None:
            best = from_rank0(self.group, best)
        self.last_choice = best
        return best

    def next_is_plain(self) -> bool:
        """Whether the pass after a pass without drafts will draft nothing
        too (said before it is chosen): drafting did not pay at the last
        choice and no probe is due. A plain pass may then be queued while
        this one runs."""
        return self.best == 0 and self.probes.plain_next()

    def update(self, n_drafted: int, n_accepted: int):
        """Record a verify pass: ``n_accepted`` of ``n_drafted`` drafts kept."""
        if n_drafted == 0:
            return
        if self.probes.probing:
            self.probes.probed(n_accepted > 0, self.drafted[0])
        for i in range(self.max_draft):
            self.accepted[i] *= self.tuning.acceptance_decay
            self.drafted[i] *= self.tuning.acceptance_decay
        # Position i was tested only if drafts 0..i-1 were all accepted.
        for i in range(min(n_accepted + 1, n_drafted, self.max_draft)):
            self.drafted[i] += 1
            self.accepted[i] += i < n_accepted

    def observe_hindsight(self, hits: int, trials: int):
        """``trials`` first drafts judged without a verify pass, ``hits`` of
        them right: evidence for the first position, as from ``trials``
        one-draft passes (each decaying the older evidence). They count as a
        probe: the next one waits ``probe_every`` passes at k = 0 again."""
        if trials <= 0:
            return
        self.probes.restart()
        decay = self.tuning.acceptance_decay**trials
        # the sum of the trials' decayed weights
        weight = (1 - decay) / (1 - self.tuning.acceptance_decay)
        self.accepted[0] = self.accepted[0] * decay + weight * hits / trials
        self.drafted[0] = self.drafted[0] * decay + weight

    def observe_pass(
        self,
        n_drafted: int,
        seconds: float,
        context: int = SHORT_CONTEXT,
        shape: Optional[PassShape] = None,
    ):
        """Record what a whole pass with ``n_drafted`` drafts took (seconds);
        ``shape``: what it computed (default: this policy's pass of
        ``n_drafted`` drafts)."""
        if n_drafted > self.max_draft or not 0 < seconds < 60:
            return  # not a pass this policy chooses, or a clock anomaly
        if not self.cost.observe(shape or self.shape(n_drafted, context), seconds):
            return  # a warm-up pass
        if n_drafted and self.best == 0:  # what this probe took
            self.probes.space(seconds, self.pass_cost(0, context))
        plain = 1.0 if n_drafted == 0 else 0.0
        self._plain_weight = self.tuning.cost_decay * self._plain_weight + plain


class SourcePolicies:
    """One :class:`DraftLengthPolicy` per draft source (``mtp+ngram``: a
    copy's acceptance and cost are not the head's), ``make(source)`` creating
    each. Each pass is chosen, recorded and timed by its source's policy, so a
    head that does not pay is switched off where it would draft while copies
    keep their own, longer drafts. Source None: an unnamed one."""

    def __init__(self, make):
        self._make, self.by_source = make, {}
        self.active: Optional[DraftLengthPolicy] = None

    def _of(self, source: Optional[str]) -> DraftLengthPolicy:
        if source not in self.by_source:
            self.by_source[source] = self._make(source)
        return self.by_source[source]

    def select(self, source: Optional[str]) -> DraftLengthPolicy:
        """The policy of ``source``, which the next update goes to."""
        self.active = self._of(source)
        return self.active

    def choose(self, limit: int, context: int, source: Optional[str] = None) -> int:
        return self.select(source).choose(limit, context)

    def next_is_plain(self) -> bool:
        """Whether no source's policy would draft in the next pass: its
        source is not known before its input token is."""
        return all(p.next_is_plain() for p in self.by_source.values())

    def exchange(self, drafter) -> int:
        """Learn from the first drafts ``drafter`` judged in hindsight, then
        tell it which sources pay now: those whose policy drafts or probes at
        its next choice (a source without a policy yet does). Returns how
        many drafts were judged."""
        judged = 0
        if drafter is not None:
            for source, (hits, trials) in drafter.hindsight().items():
                self._of(source).observe_hindsight(hits, trials)
                judged += trials
            for source, policy in self.by_source.items():
                if source is not None:
                    drafter.set_source_paying(source, not policy.next_is_plain())
        return judged

    def update(self, *args):
        self.active.update(*args)

    def observe_pass(self, *args):
        self.active.observe_pass(*args)
