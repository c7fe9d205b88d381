"""What a verify pass costs: one fitted model for one sequence and for a batch.

A pass runs the target over ``rows`` rows of ``T`` positions each (every row
padded to ``1 +`` the longest draft), the MTP head's steps for the rows that
draft with it, the head's catch-up over the rows accepted since it last
ran, and the draft forwards of the rows whose drafter runs one (a block
drafter: one forward whatever its draft's length), and the edges of the
plain passes' queue it counts, if any. Its seconds are modelled as

    extra + scale * forward(rows * T, context) / forward(1)
          + per_row * (rows - 1) + per_drafting_row * D
          + per_head_step * S + per_catch_up * C
          + per_draft_forward * F + per_draft_forward_kilotoken * F * context / 1000
          + per_queue_edge * Q

``forward(n, context)`` is the measured verify profile of one sequence over
``n`` tokens (:class:`~mlx_spec.core.cost_profile.CostProfile`, corrected by
timed passes of one row), extended past its last length along its upper
slope: a forward computes about the same whatever rows its tokens belong to
(the matrix products see ``rows * T`` tokens; attention sees each token's
context). ``D`` rows draft, ``S`` head steps run (the longest head draft:
head rows step together), ``C`` catch-up positions run, ``F`` of the
drafting rows run a draft forward of their own (it attends to the row's
context, so it grows with it). ``Q`` counts the edges of the queue of plain
passes (:mod:`.queue_ahead`) a pass stands for. Timed, a pass is an edge (1)
when it ran a forward queued before its clock started and queues none (it
ends the queue: its forward was partly computed during the pass before) or
when it ran its own forward and queues the next (it restarts the queue: its
graph was built with the device idle, and where the backend makes the host
wait for most of a queued forward, as MLX's CPU backend does, it waits for
two); a queued pass in a run of them is not. Neither edge alone is one
forward, but each break of the queue has one of each, so their mean excess
over a queued pass is half of what a break costs. Priced, a draft that
breaks a running queue stands for both (2): the pass choosing it ends the
queue, and the pass after the draft restarts it.

The coefficients are a decayed least-squares fit over the passes timed here,
each pulled towards a prior with the weight of a few passes: ``scale``
towards the profile (one forward unit), ``per_head_step`` towards the
profiled step of the head, the two draft-forward terms towards the
drafter's measured forward (:meth:`PassCost.price_draft_forward`), the rest
(``per_queue_edge`` included) towards 0, ``extra`` free. Passes of one
shape alone then move only what they can tell apart (a run of one-token
passes moves ``extra``), and a coefficient no pass has told is the prior's.
The first pass of each shape is not counted (it pays the shape's warm-up),
and a pass of a shape counted before counts as at most
``tuning.stall_bound`` times its expected cost.
"""

from dataclasses import dataclass
from typing import List, Optional

from ..drafters.contract import NO_DRAFT_FORWARD, DraftForwardCost
from .cost_profile import SHORT_CONTEXT, CostProfile
from .least_squares import decayed, outer, solve_nonnegative
from .policy_tuning import DEFAULT_TUNING, PolicyTuning

FEATURES = ("extra", "scale", "per_row", "per_drafting_row", "per_head_step")
FEATURES += ("per_catch_up", "per_draft_forward", "per_draft_forward_kilotoken")
FEATURES += ("per_queue_edge",)


@dataclass(frozen=True)
class PassShape:
    """What a pass computes, as the cost model reads it."""

    rows: int = 1  # rows the target forward computes
    T: int = 1  # positions per row: 1 + the longest draft
    drafting: int = 0  # rows that draft
    head_steps: int = 0  # steps of the MTP head (its longest draft)
    catch_up: int = 0  # positions of the head's catch-up
    context: int = SHORT_CONTEXT  # tokens before the pass, averaged over rows
    draft_forwards: int = 0  # drafting rows whose draft ran a forward of its own
    # Edges of the plain passes' queue it stands for: timed, 1 for a pass that
    # ends the queue or restarts it; priced, 2 for a draft that breaks it.
    queue_edges: int = 0


def counted_seconds(
    seen: set, shape, seconds: float, expected: float, stall_bound: float
) -> float:
    """What the fit counts for a timed pass of ``shape`` that took
    ``seconds`` where it expected ``expected``: at most ``stall_bound``
    times that once a pass of the same shape was counted (``seen``,
    updated). A few passes the machine stalled on (85-100 ms among 20 ms
    ones) must not price every later pass, while a shape's first counted
    pass is news the fit needs whole; a lasting slowdown raises the bound
    with the fit."""
    if shape not in seen:
        seen.add(shape)
        return seconds
    return min(seconds, stall_bound * expected)


class PassCost:
    """The pass-cost model over ``profile``; ``head_step``: the profiled
    seconds of one MTP head step (the prior of ``per_head_step``);
    ``tuning``: its constants (and those of the policies it prices for).

    One instance is shared by whatever chooses draft lengths for the same
    passes (a sequence's per-source policies, a batch and its rows)."""

    def __init__(
        self,
        profile: CostProfile,
        head_step: float = 0.0,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ):
        self.profile = profile
        self.tuning = tuning
        self.head_step = head_step
        self.draft_forward = NO_DRAFT_FORWARD  # the prior of the F terms
        self._unit = max(profile.short[0], 1e-9)  # forward(1): scale's unit
        self._reset()
        self._warm: set = set()  # shapes past their first (warm-up) pass

    def _reset(self):
        n = len(FEATURES)
        self._A = [[0.0] * n for _ in range(n)]
        self._b = [0.0] * n
        self._counted: set = set()
        self._theta: Optional[List[float]] = None
        self._version = self.profile.version
        self.weight = 0.0  # decayed number of passes in the fit

    def _prior(self):
        """(means, weights) of the coefficients' pulls, in passes' worth."""
        forward = self.draft_forward
        means = [0.0, self._unit, 0.0, 0.0, self.head_step, 0.0]
        means += [forward.seconds, forward.per_kilotoken, 0.0]
        weights = [
            1e-6,  # extra: free (the pull only keeps the fit solvable)
            self.tuning.scale_prior_weight,
            self.tuning.row_prior_weight,
            self.tuning.fixed_prior_weight,
            self.tuning.slope_prior_weight,
            self.tuning.catch_up_prior_weight,
            self.tuning.draft_forward_prior_weight,
            self.tuning.draft_forward_prior_weight,
            self.tuning.queue_edge_prior_weight,
        ]
        return means, weights

    def coefficients(self) -> List[float]:
        """The fitted coefficients, in the order of :data:`FEATURES`."""
        if self.profile.version != self._version:
            # The profile was corrected (by a pass here or elsewhere): a fit
            # against the old forwards would price the correction twice.
            self._reset()
        if self._theta is None:
            means, weights = self._prior()
            A = [row[:] for row in self._A]
            b = self._b[:]
            for i, (m, w) in enumerate(zip(means, weights)):
                A[i][i] += w
                b[i] += w * m
            # A cost never shrinks as a pass computes more: a coefficient
            # noise would fit below 0 (a cheaper draft) is held at 0 and the
            # fit solved again (``extra`` alone is free).
            self._theta = solve_nonnegative(A, b, free=(0,))
        return self._theta

    def price_draft_forward(self, cost: DraftForwardCost):
        """Rows whose drafter runs a draft forward of its own decode here:
        its two terms start at ``cost`` (the dearest told, where rows of
        several drafters share the engine), as the head's step starts at
        its profiled cost, and the fit refines them."""
        before = self.draft_forward
        self.draft_forward = DraftForwardCost(
            max(before.seconds, cost.seconds),
            max(before.per_kilotoken, cost.per_kilotoken),
        )
        if self.draft_forward != before:
            self._theta = None

    def fitted(self) -> dict:
        """The coefficients by name (:data:`FEATURES`)."""
        return dict(zip(FEATURES, self.coefficients()))

    def forward(self, tokens: int, context: int = SHORT_CONTEXT) -> float:
        """Seconds of a target forward over ``tokens`` tokens after
        ``context`` (past the profile's end: along its upper half's slope)."""
        n = len(self.profile)
        if tokens <= n:
            return self.profile.verify_cost(tokens - 1, context)
        mid = n // 2
        top, below = (self.profile.verify_cost(k, context) for k in (n - 1, mid - 1))
        slope = max(top - below, 0.0) / max(n - mid, 1)
        return top + slope * (tokens - n)

    def features(self, shape: PassShape, forward: Optional[float] = None) -> list:
        if forward is None:
            forward = self.forward(shape.rows * shape.T, shape.context)
        return [
            1.0,
            forward / self._unit,
            float(shape.rows - 1),
            float(shape.drafting),
            float(shape.head_steps),
            float(shape.catch_up),
            float(shape.draft_forwards),
            shape.draft_forwards * shape.context / 1000.0,
            float(shape.queue_edges),
        ]

    def cost(self, shape: PassShape) -> float:
        """Expected seconds of a pass of ``shape``."""
        theta = self.coefficients()
        f = self.features(shape)
        return max(sum(a * b for a, b in zip(f, theta)), 1e-9)

    def observe(self, shape: PassShape, seconds: float) -> bool:
        """A pass of ``shape`` took ``seconds`` (one forward, or an edge of
        the queue its shape counts); False when it is not counted (a clock
        anomaly, a warm-up pass)."""
        if not 0 < seconds < 60:
            return False
        key = (shape.rows, shape.T, shape.head_steps > 0, shape.draft_forwards > 0)
        if key not in self._warm:  # it paid the shape's warm-up
            self._warm.add(key)
            return False
        if shape.rows == 1 and not shape.queue_edges:
            # A forward of one row, timed whole, bounds the profile's.
            self.profile.observe(shape.T - 1, shape.context, seconds, self.tuning)
        expected = self.cost(shape)
        bound = self.tuning.stall_bound
        seconds = counted_seconds(self._counted, key, seconds, expected, bound)
        f = self.features(shape)
        decay = self.tuning.cost_decay
        self._A = decayed(self._A, outer(f), decay)
        self._b = decayed(self._b, [x * seconds for x in f], decay)
        self.weight = decay * self.weight + 1
        self._theta = None
        return True
