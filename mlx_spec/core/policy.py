"""What ``--num-draft-tokens auto`` learns of a row: how often its drafts are
accepted, per draft position and per draft source.

Each pass drafts the ``k`` that maximises expected tokens per second,
``E(k) / cost(k)`` (:mod:`.draft_lengths`: the one choice function, for one
row and for a batch): ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from the
decayed per-position acceptance estimates ``a_i`` kept here
(:class:`Acceptance`, one per draft source of a row: :class:`RowAcceptance`),
and ``cost(k)`` what a pass of ``1 + k`` tokens costs by the fitted
:class:`~mlx_spec.core.pass_cost.PassCost` (:func:`pass_cost_model`).
Constants: :mod:`.policy_tuning`; the why and the evidence:
``docs/auto_policy.md``.
"""

from typing import Dict, List, Optional, Sequence

from ..drafters import calls
from ..drafters.contract import MAX_AUTO_DRAFT_TOKENS
from .cost_profile import SHORT_CONTEXT, CostProfile, as_cost_profile
from .pass_cost import PassCost
from .policy_tuning import DEFAULT_TUNING, PolicyTuning
from . import verify_profile
from .verify_profile import cost_profile, head_step_cost

__all__ = [
    "Acceptance",
    "RowAcceptance",
    "SHORT_CONTEXT",
    "expected_tokens",
    "most_drafts",
    "pass_cost_model",
]


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
    tokens: int = MAX_AUTO_DRAFT_TOKENS + 1,
) -> PassCost:
    """The pass-cost model of ``model``'s passes: over ``verify_costs`` (one
    profile, no growth with context) when given, else over the model's
    :class:`~mlx_spec.core.cost_profile.CostProfile` (measured or stored,
    corrected by the passes timed here; covering T = 1..``tokens``), the
    MTP head's steps priced at first at their measured cost; its
    constants: ``tuning``. A stored profile of an implausible shape is
    measured again first
    (:meth:`~mlx_spec.core.cost_profile.CostProfile.check_shape`)."""
    if verify_costs is not None:
        return PassCost(as_cost_profile(verify_costs), tuning=tuning)
    profile = checked_cost_profile(model, tuning, tokens)
    return PassCost(profile, head_step_cost(model) or 0.0, tuning)


def checked_cost_profile(
    model,
    tuning: PolicyTuning = DEFAULT_TUNING,
    tokens: int = MAX_AUTO_DRAFT_TOKENS + 1,
) -> CostProfile:
    """``model``'s cost profile (measured or stored, covering T =
    1..``tokens``), measured again first
    where a stored one has an implausible shape
    (:meth:`~mlx_spec.core.cost_profile.CostProfile.check_shape`)."""
    profile = cost_profile(model, tuning, tokens)
    n = len(profile)
    profile.check_shape(
        lambda context: verify_profile.measure_verify_costs(model, n, context=context),
        tuning,
    )
    return profile


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a pass with ``k`` drafts yields on average (accepted + 1):
    ``1 + sum_{j<=k} prod_{i<=j} a_i`` from per-position acceptance ``a_i``."""
    tokens, survive = 1.0, 1.0
    for a in acceptance[:k]:
        survive *= a
        tokens += survive
    return tokens


class Acceptance:
    """How often one source's drafts are accepted, per draft position:
    decayed counts of drafts verified and accepted (``tuning``'s decay and
    prior)."""

    def __init__(
        self,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ):
        self.tuning = tuning
        self.accepted = [0.0] * max_draft  # decayed counts per position
        self.drafted = [0.0] * max_draft

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

    def update(self, n_drafted: int, n_accepted: int):
        """Record a verify pass: ``n_accepted`` of ``n_drafted`` drafts kept."""
        if n_drafted == 0:
            return
        decay = self.tuning.acceptance_decay
        for i in range(len(self.drafted)):
            self.accepted[i] *= decay
            self.drafted[i] *= decay
        # Position i was tested only if drafts 0..i-1 were all accepted.
        for i in range(min(n_accepted + 1, n_drafted, len(self.drafted))):
            self.drafted[i] += 1
            self.accepted[i] += 1.0 if i < n_accepted else 0.0

    def observe_hindsight(self, hits: int, trials: int):
        """``trials`` first drafts judged without a verify pass, ``hits`` of
        them right: evidence for the first position, as from ``trials``
        one-draft passes (each decaying the older evidence)."""
        if trials <= 0:
            return
        decay = self.tuning.acceptance_decay**trials
        # the sum of the trials' decayed weights
        weight = (1 - decay) / (1 - self.tuning.acceptance_decay)
        self.accepted[0] = self.accepted[0] * decay + weight * hits / trials
        self.drafted[0] = self.drafted[0] * decay + weight


class RowAcceptance:
    """A row's :class:`Acceptance` per draft source (``mtp+ngram``: a copy's
    acceptance is not the head's); each pass's verdict goes to the source
    that drafted it. Source None: an unnamed one."""

    def __init__(
        self,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ):
        self.max_draft, self.tuning = max_draft, tuning
        self.by_source: Dict[Optional[str], Acceptance] = {}
        self.active: Optional[Acceptance] = None

    def of(self, source: Optional[str]) -> Acceptance:
        if source not in self.by_source:
            self.by_source[source] = Acceptance(self.max_draft, self.tuning)
        return self.by_source[source]

    def select(self, source: Optional[str]) -> Acceptance:
        """The estimate of ``source``, which the next verdict goes to."""
        self.active = self.of(source)
        return self.active

    def learn_hindsight(self, drafter) -> Dict[Optional[str], int]:
        """Learn from the first drafts ``drafter`` judged in hindsight; how
        many were judged, per source."""
        judged = {}
        for source, (hits, trials) in calls.judged(drafter).items():
            self.of(source).observe_hindsight(hits, trials)
            judged[source] = trials
        return judged

    def update(self, n_drafted: int, n_accepted: int):
        self.active.update(n_drafted, n_accepted)
