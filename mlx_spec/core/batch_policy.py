"""Draft lengths for the ``auto`` rows of a batch pass.

Alone, a sequence's ``auto`` policy weighs a pass of ``1 + k`` tokens by the
single-sequence verify profile. In a batch every row is computed over the
same ``T = 1 + the longest draft`` positions, and the rows drafting with the
model's MTP head run its steps together, so a pass costs about

    alpha + beta * B * T + gamma * S + delta * C

(measured on CPU: the forward grows with the tokens it computes, ``B * T``,
over a fixed part; ``S`` head steps, the longest head draft, each one
forward of the head for all its rows; ``C`` positions of the head's catch-up
over the rows accepted since it last ran). One row's longer draft makes
every row pay, which a row's own profile undercounts. So with two or more
rows the ``auto`` rows share draft lengths: ``k`` for the rows whose drafts cost nothing to make
(copies), ``k_h`` for the rows drafting with the head, the pair maximising

    sum over auto rows of E_b(k or k_h)  /  cost(B, 1 + max(k, k_h), k_h, C)

(``C``: the catch-up the head rows' drafts run, 0 when ``k_h = 0``. Their
deferred rows need not run otherwise: a request that ends keeps them unrun
in its state. In the fit, ``delta`` keeps a probe after a long stretch
without drafts, which catches up many rows, from making a head step look
dear).
``E_b(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from each row's own acceptance
estimates (its :class:`~mlx_spec.core.policy.DraftLengthPolicy`, which keeps
learning from the row's passes). The cost starts from the single-sequence
profile (a line through it, gamma = 0) and is refitted from the batch's own
timed passes (decayed least squares, the profile as prior passes, a few at
first and never fewer than ``PRIOR_FLOOR``: passes that all have one shape,
all at ``k = 0`` say, determine only one combination of the costs; a pass
of a shape seen before counts as at most ``STALL_BOUND`` times its expected
cost). After
``TUNING.probe_every`` passes at ``k = 0``, one pass drafts one token, so
acceptance that improves is noticed.
"""

from typing import Collection, Dict, List, Sequence, Tuple

import mlx.core as mx

from ..models.pipeline import from_rank0
from .batch_mtp import head_drafter
from .least_squares import decayed, outer, solve_linear
from .policy import counted_seconds, expected_tokens
from .policy_tuning import TUNING
from .probe_schedule import ProbeSchedule, _ProbeFields

# expected_tokens: the batch reads a row's expected tokens from here too
__all__ = [
    "PassLength",
    "copies_pay",
    "draft_lengths",
    "expected_tokens",
    "plain_ahead",
]


def _features(rows: int, T: int, head_steps: int, catch_up: int) -> List[float]:
    return [1.0, float(rows * T), float(head_steps), float(catch_up)]


class PassLength(_ProbeFields):
    """The shared draft length of a batch's ``auto`` rows, and the batch's
    pass-cost model. ``verify_costs``: the single-sequence profile
    (seconds, index 0 = 1 token)."""

    def __init__(self, verify_costs: Sequence[float], group=None):
        self.group = group
        verify_costs = list(verify_costs)  # the prior: the costs as they are now
        n = len(verify_costs)
        beta = max((verify_costs[-1] - verify_costs[0]) / max(n - 1, 1), 1e-6)
        prior = [max(verify_costs[0] - beta, 0.0), beta, 0.0, 0.0]
        # Normal equations of the decayed least squares. The prior, per pass
        # of weight: the profile's line spread over T = 1..n, plus a pull of
        # gamma and delta towards 0 (while every pass drafts, gamma and alpha
        # are told apart only by it and the prior).
        A0 = [[float(i == j >= 2) for j in range(4)] for i in range(4)]
        b0 = [0.0] * 4
        for T in range(1, n + 1):
            f = _features(1, T, 0, 0)
            y = sum(a * b for a, b in zip(f, prior))
            A0 = [[a + c for a, c in zip(r, o)] for r, o in zip(A0, outer(f, 1 / n))]
            b0 = [b + x * y / n for b, x in zip(b0, f)]
        self._A = [[TUNING.batch_prior_weight * a for a in r] for r in A0]
        self._b = [TUNING.batch_prior_weight * b for b in b0]
        # What each pass adds so that the prior never weighs less than
        # TUNING.batch_prior_floor passes (gamma's pull: batch_gamma_pull): passes of one shape
        # alone let noise fit a negative alpha and a steep beta, with which
        # no draft ever looked affordable.
        floor = [
            [(1 - TUNING.batch_decay) * TUNING.batch_prior_floor * a for a in r]
            for r in A0
        ]
        floor[2][2] = floor[3][3] = (1 - TUNING.batch_decay) * TUNING.batch_gamma_pull
        self._floor = (
            floor,
            [(1 - TUNING.batch_decay) * TUNING.batch_prior_floor * b for b in b0],
        )
        self._theta = None  # the fitted (alpha, beta, gamma, delta)
        self._counted: set = set()  # (rows, T, head steps) of passes fitted
        self.probes = ProbeSchedule()
        self.last = None  # the last (k, k_h) chosen

    def cost(self, rows: int, T: int, head_steps: int = 0, catch_up: int = 0) -> float:
        """Seconds of a pass over ``rows`` rows of ``T`` positions, with
        ``head_steps`` steps of the MTP head and ``catch_up`` positions of
        its catch-up."""
        if self._theta is None:
            self._theta = solve_linear(self._A, self._b)
        f = _features(rows, T, head_steps, catch_up)
        return max(sum(a * b for a, b in zip(f, self._theta)), 1e-9)

    def observe(
        self, rows: int, T: int, seconds: float, head_steps: int = 0, catch_up: int = 0
    ):
        """A pass over ``rows`` rows of ``T`` positions with ``head_steps``
        head steps and ``catch_up`` catch-up positions took ``seconds``."""
        if not 0 < seconds < 60:
            return  # a clock anomaly
        expected = self.cost(rows, T, head_steps, catch_up)
        seconds = counted_seconds(
            self._counted, (rows, T, head_steps), seconds, expected
        )
        f = _features(rows, T, head_steps, catch_up)
        self._theta = None  # refitted when next needed
        self._A = decayed(self._A, outer(f), TUNING.batch_decay, self._floor[0])
        self._b = decayed(
            self._b, [x * seconds for x in f], TUNING.batch_decay, self._floor[1]
        )

    def choose(
        self,
        rows: int,
        auto: List[Tuple[Sequence[float], int]],
        fixed: int = 0,
        others: float = 0.0,
        head: List[Tuple[Sequence[float], int]] = (),
        head_fixed: int = 0,
        head_catch_up: int = 0,
    ) -> Tuple[int, int]:
        """The draft lengths ``(k, k_h)`` of the auto rows drafting copies
        (``auto``) and with the MTP head (``head``), each row given as
        (acceptance, most drafts it may make); ``rows``: rows the pass
        computes; ``fixed``: the longest draft of the other rows (the pass
        computes at least ``1 + fixed`` positions); ``others``: their
        expected tokens; ``head_fixed``: the head steps they run;
        ``head_catch_up``: the positions of the catch-up the head rows'
        drafts would run (their deferred rows, padded to the longest)."""
        limit = max((cap for _, cap in auto), default=0)
        head_limit = max((cap for _, cap in head), default=0)

        copies, heads = _group_tokens(auto, limit + 1), _group_tokens(
            head, head_limit + 1
        )

        k, kh = self._fastest(
            rows, copies, heads, fixed, others, head_fixed, head_catch_up
        )
        if self.probes.apply(max(k, kh), max(limit, head_limit)) > max(k, kh):
            k, kh = min(1, limit), min(1, head_limit)  # one draft for every row
        if self.group is not None:
            k, kh = from_rank0(self.group, k), from_rank0(self.group, kh)
        self.last = (k, kh)
        return k, kh

    def _fastest(self, rows, copies, heads, fixed, others, head_fixed, head_catch_up):
        """The pair ``(k, k_h)`` of the most expected tokens a second, the
        first of equals in the order ``k``, then ``k_h``. It runs before
        every pass of a batch of ``auto`` rows, for up to 81 pairs, so
        :meth:`cost` is written out here with the same arithmetic (its
        terms summed in the same order): the same pair, in about half the
        host time with :func:`_group_tokens`."""
        if self._theta is None:
            self._theta = solve_linear(self._A, self._b)
        alpha, beta, gamma, delta = self._theta
        best, best_speed = (0, 0), None
        for k, copy_tokens in enumerate(copies):
            for kh, head_tokens in enumerate(heads):
                T = 1 + max(k, kh, fixed)
                catch_up = head_catch_up if kh else 0
                cost = 0 + 1.0 * alpha + float(rows * T) * beta
                cost = cost + float(max(kh, head_fixed)) * gamma
                cost = max(cost + float(catch_up) * delta, 1e-9)
                speed = (others + copy_tokens + head_tokens) / cost
                if best_speed is None or speed > best_speed:
                    best, best_speed = (k, kh), speed
        return best

    def next_is_plain(self) -> bool:
        """Whether the next choice drafts nothing (said before it is made):
        the last one drafted nothing and no probe is due."""
        return self.last == (0, 0) and self.probes.plain_next()


def _group_tokens(group: List[Tuple[Sequence[float], int]], n: int) -> List[float]:
    """``tokens[k]`` for ``k < n``: what the rows of ``group`` (acceptance,
    most drafts) yield together with ``k`` drafts each, the sum over rows of
    :func:`~mlx_spec.core.policy.expected_tokens` of ``min(k, cap)``. Each
    row's running sums are taken once, with that function's arithmetic (the
    same floats), instead of once for every ``k``."""
    running = []
    for acceptance, cap in group:
        tokens, survive, sums = 1.0, 1.0, [1.0]
        for a in acceptance[: min(cap, n - 1)]:
            survive *= a
            tokens += survive
            sums.append(tokens)
        running.append(sums)
    return [sum(r[min(k, len(r) - 1)] for r in running) for k in range(n)]


def draft_lengths(
    rows, active: List[int], lengths: PassLength, batch_heads=()
) -> Dict[int, int]:
    """Each active row's draft length (``rows``: a
    :class:`~mlx_spec.core.batch.BatchDecoder`'s rows; ``active``: the indices
    of those decoding). A fixed number stays; ``auto`` rows share the lengths
    :class:`PassLength` chooses for the batch, one for the rows drafting
    copies, one for the rows drafting with the MTP head (a row alone: its own
    policy's choice). Then a copy row drafting less than the longest draft
    drafts up to that length as far as it may: the pass computes every row
    over the same ``1 + longest`` positions, so those drafts cost nothing. A
    head row's would not: each of its drafts is a head step. ``batch_heads``:
    the MTP drafters whose heads the batch runs together (their state is
    the batch's until it catches them up)."""
    ks, caps, auto, heads, judged = {}, {}, [], set(), 0
    for b in active:
        row = rows[b]
        room = min(row.max_draft, row.remaining - 1, row.decoder.draft_room())
        if row.decoder.drafter is None:
            ks[b] = caps[b] = 0
            continue
        caps[b] = room if row.policy is None else min(room, row.decoder.max_draft)
        if not row.decoder.drafter.can_draft():
            caps[b] = 0  # no copy, no head row: one token, whatever its acceptance
        if row.policy is not None:
            judged += row.policy.exchange(row.decoder.drafter)
        # alone on its own head, a combined drafter may run the head to name
        # the source; a head the batch holds is caught up later, with the others
        head = head_drafter(row.decoder.drafter)
        look = len(rows) == 1 and head not in batch_heads
        source = row.decoder.draft_source(caps[b], look=look)
        if head is not None and (source == "mtp" or head is row.decoder.drafter):
            heads.add(b)
        if row.policy is None:
            ks[b] = caps[b]
        else:
            row.policy.select(source)
            auto.append(b)
    if len(auto) == len(rows) == 1:  # alone: as one sequence
        (b,) = auto
        row = rows[b]
        room = min(row.max_draft, row.remaining - 1, row.decoder.draft_room())
        ks[b] = row.policy.active.choose(room, len(row.decoder.history))
    elif auto:
        if judged:  # as for one sequence, judgements stand in for probes
            lengths.probes.restart()

        def group(with_head: bool):
            return [
                (rows[b].policy.active.acceptance(), caps[b])
                for b in auto
                if (b in heads) == with_head
            ]

        k, k_head = lengths.choose(
            len(rows),
            group(False),
            max(ks.values(), default=0),
            float(len(ks)),  # rows not auto: one token each, at least
            group(True),
            max((ks[b] for b in heads if b in ks), default=0),
            _catch_up(rows, [b for b in auto if b in heads]),
        )
        ks.update({b: min(k_head if b in heads else k, caps[b]) for b in auto})
    longest = max(ks.values())
    return {
        b: k if b in heads else max(k, min(longest, caps[b])) for b, k in ks.items()
    }


def _catch_up(rows, drafting: List[int]) -> int:
    """Positions of the catch-up that runs before the head rows ``drafting``
    draft: every member head's row, padded to the longest of their deferred
    rows (see :meth:`~mlx_spec.core.batch_mtp.MTPBatch.catch_up`)."""
    heads = [head_drafter(row.decoder.drafter) for row in rows]
    members = sum(h is not None for h in heads)
    return members * max((heads[b].pending_rows for b in drafting), default=0)


def copies_pay(
    batch, drafts: Dict[int, mx.array], on_device: Collection[int] = ()
) -> bool:
    """Whether the copies the ``auto`` rows of ``batch`` (a
    :class:`~mlx_spec.core.batch.BatchDecoder`) found are worth their pass
    (by the batch's cost model) against a plain one. The length was chosen
    from each row's acceptance, which counts only the drafts a row made: a
    copy row finding no match drafts nothing, yet the pass is as long as its
    longest row. Drafts of the head (its steps are taken), of fixed-length
    rows and of a probe always pay; so do all drafts in a pipeline, whose
    ranks each fit their own cost model and would have to agree on every
    pass once more."""
    lengths, T = batch.lengths, 1 + max(len(d) for d in drafts.values())
    pipelined = batch.group is not None
    if T == 1 or lengths is None or lengths.probing or pipelined:
        return True
    if len(batch.rows) < 2:
        return True  # alone, a pass is as long as its own draft
    tokens = 0.0
    for b, draft in drafts.items():
        row = batch.rows[b]
        if len(draft) and (row.policy is None or b in on_device):
            return True
        acceptance = row.policy.active.acceptance() if row.policy else []
        tokens += expected_tokens(acceptance, len(draft))
    B, cost = len(batch.rows), lengths.cost
    return tokens / cost(B, T) >= len(drafts) / cost(B, 1)


def plain_ahead(batch, active: List[int], T: int) -> bool:
    """Whether the pass after this plain one (``T == 1``) of ``batch``
    drafts nothing either: every row decodes on and none drafts or probes
    next (its policy said so before choosing), so it may be queued now.
    Never in a pipeline, whose ranks agree on every pass."""
    if T > 1 or len(active) < len(batch.rows) or batch.group is not None:
        return False
    alone = len(batch.rows) == 1
    for row in batch.rows:
        if row.remaining <= 1 or row.processors:
            return False  # it finishes with this pass, or needs its history
        if row.decoder.drafter is None or row.max_draft == 0:
            continue
        if row.policy is None:
            return False  # a fixed draft length
        policy = row.policy if alone else batch.lengths
        if not policy.next_is_plain():
            return False
    return True
