"""Choosing the draft length online: ``--num-draft-tokens auto``.

Each pass drafts the ``k`` that maximises expected tokens per second,
``E(k) / cost(k)``: ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from decayed
per-position acceptance estimates ``a_i`` (one policy per draft source), and
``cost(k)`` the verify forward over ``1 + k`` tokens at this context (the
:class:`~mlx_spec.core.cost_profile.CostProfile`, which timed passes correct)
plus what this generation's passes took beyond it (a decayed least-squares
fit of a constant, a fixed cost of drafting at all and a cost per draft).
``k = 0`` is plain decoding; exploration is a
:class:`~mlx_spec.core.probe_schedule.ProbeSchedule` (one
draft now and then at ``k = 0``) and a depth probe (one draft more while the
next position is barely tested). Constants: :mod:`.policy_tuning`; the why
and the evidence: ``docs/auto_policy.md``.
"""

import math
from typing import List, Optional, Sequence, Tuple

from ..drafters.base import MAX_AUTO_DRAFT_TOKENS
from ..models.pipeline import from_rank0
from .cost_profile import SHORT_CONTEXT, CostProfile, as_cost_profile
from .least_squares import decayed, outer, solve_linear
from .policy_tuning import TUNING
from .probe_schedule import ProbeSchedule, _ProbeFields
from .verify_profile import cost_profile, head_step_cost

HEAD_SOURCE = "mtp"  # the draft source of the model's MTP head


def most_drafts(num_draft_tokens) -> int:
    """The most tokens one pass drafts under ``num_draft_tokens`` ("auto"
    or a number)."""
    if num_draft_tokens == "auto":
        return MAX_AUTO_DRAFT_TOKENS
    return num_draft_tokens


def make_policy(
    model,
    verify_costs: Optional[List[float]] = None,
    group=None,
    max_draft: int = MAX_AUTO_DRAFT_TOKENS,
):
    """The auto policy for ``model`` (per draft source): from ``verify_costs``
    (one profile, no growth with context) when given, else from the model's
    :class:`~mlx_spec.core.cost_profile.CostProfile` (measured or stored, and
    corrected by the passes timed here), the MTP head's drafts starting from
    its measured step cost."""
    if verify_costs is not None:
        return policies_by_source(verify_costs, max_draft, group)
    head = head_step_cost(model) or 0.0
    return policies_by_source(cost_profile(model), max_draft, group, head_cost=head)


def policies_by_source(
    costs,
    max_draft: int = MAX_AUTO_DRAFT_TOKENS,
    group=None,
    long_profile: Optional[Tuple[int, List[float]]] = None,
    head_cost: float = 0.0,
) -> "SourcePolicies":
    """A :class:`DraftLengthPolicy` per draft source over one profile
    (``costs``: a :class:`CostProfile`, or a list of seconds with
    ``long_profile``), which every source's timed passes correct; the MTP
    head's drafts start from ``head_cost`` seconds each (a head draft is
    lazy, so no host timer sees its steps)."""
    profile = as_cost_profile(costs, long_profile)
    return SourcePolicies(
        lambda source: DraftLengthPolicy(
            profile,
            max_draft,
            group,
            draft_cost=head_cost if source == HEAD_SOURCE else 0.0,
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


def counted_seconds(seen: set, shape, seconds: float, expected: float) -> float:
    """What a cost fit counts for a timed pass of ``shape`` that took
    ``seconds`` where it expected ``expected``: at most ``TUNING.stall_bound`` times
    that once a pass of the same shape was counted (``seen``, updated). A few
    passes the machine stalled on (seen here: 85-100 ms among 20 ms ones) must
    not price every later pass, while a shape's first pass is news the fit
    needs whole (the MTP head's first drafting pass took twice what the
    profile said). A lasting slowdown is followed: the bound rises with the
    fit."""
    if shape not in seen:
        seen.add(shape)
        return seconds
    return min(seconds, TUNING.stall_bound * expected)


class DraftLengthPolicy(_ProbeFields):
    """Online choice of the number of drafts per verify pass.

    ``verify_costs``: a :class:`CostProfile` (shared, corrected by the
    passes this policy times), or the profile after ``SHORT_CONTEXT`` tokens
    of context (seconds, index 0 = 1 token) with ``long_profile``: (a longer
    context, its profile), without which the cost does not grow with context.
    ``draft_cost``: seconds a draft costs beyond its verify forward, until
    drafts are timed (the profiled step of the MTP head, whose lazy drafts a
    host timer does not see).
    ``group``: the ranks of a pipeline, which time their passes differently
    but must verify the same number of tokens: rank 0's choice is used."""

    def __init__(
        self,
        verify_costs,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        group=None,
        long_profile: Optional[Tuple[int, List[float]]] = None,
        draft_cost: float = 0.0,
    ):
        self.group = group
        self.profile: CostProfile = as_cost_profile(verify_costs, long_profile)
        self._profile_version = self.profile.version
        self.max_draft = min(max_draft, len(self.profile) - 1)
        self.accepted = [0.0] * self.max_draft  # decayed counts per position
        self.drafted = [0.0] * self.max_draft
        self.draft_cost = draft_cost  # seconds per drafted token (host-timed)
        # Normal equations of the decayed least squares over observed passes
        # of r = extra + fixed [k > 0] + slope k, r being a pass's seconds
        # beyond its verify forward (see fitted_costs).
        self._fit_A, self._fit_b = [[0.0] * 3 for _ in range(3)], [0.0] * 3
        self._fitted = None  # (extra, fixed, per draft) until a pass changes them
        self._plain_weight = 0.0  # decayed count of timed passes without drafts
        self._warm: set = set()  # draft counts past their first (warm-up) pass
        self._counted: set = set()  # draft counts with a pass in the cost fit
        self.probes = ProbeSchedule()
        self.last_choice = self.best = 0

    def acceptance(self) -> List[float]:
        """Estimated conditional acceptance a_i per draft position.

        A position with little evidence borrows the estimate of the one before
        it (acceptance changes slowly with depth), so a deeper draft is tried
        once shallower drafts prove reliable.
        """
        rates, prior = [], TUNING.prior_acceptance
        for a, d in zip(self.accepted, self.drafted):
            prior = (a + prior * TUNING.prior_weight) / (d + TUNING.prior_weight)
            rates.append(prior)
        return rates

    def verify_cost(self, k: int, context: int) -> float:
        """Seconds of a verify forward over 1 + k tokens after ``context``."""
        return self.profile.verify_cost(k, context)

    def pass_cost(self, k: int, context: int = SHORT_CONTEXT) -> float:
        """Expected seconds of a pass with ``k`` drafts after ``context`` tokens."""
        extra, fixed, slope = self.fitted_costs()
        drafting = fixed + slope * k if k else 0.0
        return max(self.verify_cost(k, context) + extra + drafting, 1e-9)

    def fitted_costs(self) -> Tuple[float, float, float]:
        """(extra, fixed, per-draft) seconds of a pass beyond its verify
        forward: ``extra`` for every pass, ``fixed`` once for a pass that
        drafts at all (the drafter catching up on the last pass's tokens),
        ``per_draft`` for each draft (its own forward).

        A decayed least-squares fit through the observed passes. Passes of
        one or two draft lengths do not tell ``fixed`` from ``per_draft``:
        the per-draft cost is pulled towards the host-timed drafting cost and
        the fixed one, more weakly, towards 0, so what a first draft costs
        more is mostly taken as fixed and a longer draft gets tried (and
        timed). Before any pass: (0, 0, the host-timed cost).
        """
        if self._fitted is not None:
            return self._fitted
        lam_f, lam_s, b0 = (
            TUNING.fixed_prior_weight,
            TUNING.slope_prior_weight,
            self.draft_cost,
        )
        if self._fit_A[0][0] == 0:
            return 0.0, 0.0, b0  # not kept: the host-timed cost may change
        A = [row[:] for row in self._fit_A]  # plus the priors' pulls
        A[1][1] += lam_f
        A[2][2] += lam_s
        b = self._fit_b[:2] + [self._fit_b[2] + lam_s * b0]
        extra, fixed, slope = solve_linear(A, b)
        self._fitted = extra, max(fixed, 0.0), max(slope, 0.0)
        return self._fitted

    @property
    def extra(self) -> Optional[float]:
        """Learned seconds a pass takes beyond verify and drafting (None: no pass yet)."""
        return self.fitted_costs()[0] if self._fit_A[0][0] else None

    def expected_speed(self, k: int, context: int = SHORT_CONTEXT) -> float:
        """Expected tokens per second with ``k`` drafts."""
        return expected_tokens(self.acceptance(), k) / self.pass_cost(k, context)

    def choose(self, limit: int, context: int = SHORT_CONTEXT) -> int:
        """Drafts for the next pass (after ``context`` tokens), at most ``limit``."""
        limit = min(limit, self.max_draft)
        speeds = [self.expected_speed(k, context) for k in range(limit + 1)]
        best = max(range(limit + 1), key=speeds.__getitem__)
        self.best = best
        if best == 0 and self.last_choice:
            # Drafting stopped (or a probe ran): the next probe waits by what
            # a draft costs, as fitted (a probe's own time: observe_pass).
            self.probes.space(self.pass_cost(1, context), self.pass_cost(0, context))
        best = self.probes.apply(best, limit)
        if 0 < self.best < limit and self.drafted[best] < TUNING.depth_evidence:
            # A depth probe: the next position is barely tested (its estimate
            # may be stale), likely reached, and one more draft looks nearly
            # as good.
            reach = math.prod(self.acceptance()[:best])
            near = speeds[best + 1] >= (1 - TUNING.depth_margin) * speeds[best]
            best += reach >= TUNING.depth_reach and near
        if (
            best
            and self._fit_A[0][0]
            and self._plain_weight < TUNING.plain_probe_weight
        ):
            best, self.probes.probing = 0, False  # a cost probe: a plain pass now
        if self.group is not None:
            best = from_rank0(self.group, best)
        self.last_choice = best
        return best

    def next_is_plain(self) -> bool:
        """Whether the pass after a pass without drafts will draft nothing
        too (said before it is chosen): drafting did not pay at the last
        choice and no probe is due. A plain pass may then be queued while
        this one runs (see ``SpeculativeDecoder.verify``)."""
        return self.best == 0 and self.probes.plain_next()

    def update(
        self, n_drafted: int, n_accepted: int, draft_seconds: Optional[float] = None
    ):
        """Record a verify pass: ``n_accepted`` of ``n_drafted`` drafts kept."""
        if n_drafted == 0:
            return
        if self.probes.probing:
            self.probes.probed(n_accepted > 0, self.drafted[0])
        for i in range(self.max_draft):
            self.accepted[i] *= TUNING.acceptance_decay
            self.drafted[i] *= TUNING.acceptance_decay
        # Position i was tested only if drafts 0..i-1 were all accepted.
        for i in range(min(n_accepted + 1, n_drafted, self.max_draft)):
            self.drafted[i] += 1
            self.accepted[i] += i < n_accepted
        if draft_seconds is not None:
            per_token = draft_seconds / n_drafted
            w = TUNING.draft_cost_update
            self.draft_cost = (1 - w) * self.draft_cost + w * per_token
            self._fitted = None

    def observe_hindsight(self, hits: int, trials: int):
        """``trials`` first drafts judged without a verify pass, ``hits`` of
        them right: evidence for the first position, as from ``trials``
        one-draft passes (each decaying the older evidence). They count as a
        probe: the next one waits ``probe_every`` passes at k = 0 again."""
        if trials <= 0:
            return
        self.probes.restart()
        decay = TUNING.acceptance_decay**trials
        # the sum of the trials' decayed weights
        weight = (1 - decay) / (1 - TUNING.acceptance_decay)
        self.accepted[0] = self.accepted[0] * decay + weight * hits / trials
        self.drafted[0] = self.drafted[0] * decay + weight

    def observe_pass(
        self, n_drafted: int, seconds: float, context: int = SHORT_CONTEXT
    ):
        """Record what a whole pass with ``n_drafted`` drafts took (seconds)."""
        if n_drafted > self.max_draft or not 0 < seconds < 60:
            return  # not a pass this policy chooses, or a clock anomaly
        if n_drafted not in self._warm:  # the first pass of a shape pays warm-up
            self._warm.add(n_drafted)
            return
        self.profile.observe(n_drafted, context, seconds)
        if self.profile.version != self._profile_version:
            # The profile was corrected (by this pass or another source's):
            # residuals fitted against the old one would price it twice.
            self._profile_version = self.profile.version
            self._fit_A, self._fit_b = [[0.0] * 3 for _ in range(3)], [0.0] * 3
            self._counted.clear()
        if n_drafted and self.best == 0:  # what this probe took
            self.probes.space(seconds, self.pass_cost(0, context))
        self._plain_weight = TUNING.cost_decay * self._plain_weight + (n_drafted == 0)
        expected = self.pass_cost(n_drafted, context)
        seconds = counted_seconds(self._counted, n_drafted, seconds, expected)
        k, r = n_drafted, seconds - self.verify_cost(n_drafted, context)
        x = [1.0, float(k > 0), float(k)]
        self._fit_A = decayed(self._fit_A, outer(x), TUNING.cost_decay)
        self._fit_b = decayed(self._fit_b, [a * r for a in x], TUNING.cost_decay)
        self._fitted = None


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
