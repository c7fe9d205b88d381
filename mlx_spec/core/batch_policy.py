"""Draft lengths for the ``auto`` rows of a batch pass.

In a batch every row is computed over the same ``T = 1 + the longest
draft`` positions, and the rows drafting with the model's MTP head run its
steps together, so one row's longer draft makes every row pay. So with two
or more rows the ``auto`` rows share draft lengths: ``k`` for the rows whose
drafts cost nothing to make (copies), ``k_h`` for the rows drafting with the
head, the pair maximising

    sum over auto rows of E_b(k or k_h)  /  cost(pass)

``E_b(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` from each row's own acceptance
estimates (its :class:`~mlx_spec.core.policy.DraftLengthPolicy`, which keeps
learning from the row's passes), and ``cost`` the batch's
:class:`~mlx_spec.core.pass_cost.PassCost` (the same model a row alone
chooses by) of ``B`` rows over ``T`` positions, ``k_h`` head steps and the
catch-up the head rows' drafts run (0 when ``k_h = 0``: their deferred rows
need not run otherwise; a request that ends keeps them unrun in its state).
After ``tuning.probe_every`` passes at ``k = 0``, one pass drafts one token,
so acceptance that improves is noticed.
"""

from typing import Collection, Dict, List, Sequence, Tuple

import mlx.core as mx

from ..models.pipeline import from_rank0
from .batch_mtp import head_drafter
from .cost_profile import SHORT_CONTEXT
from .pass_cost import PassCost, PassShape
from .policy import expected_tokens
from .probe_schedule import ProbeSchedule, _ProbeFields

# expected_tokens: the batch reads a row's expected tokens from here too
__all__ = [
    "PassLength",
    "copies_pay",
    "draft_lengths",
    "expected_tokens",
    "head_catch_up",
    "plain_ahead",
]


class PassLength(_ProbeFields):
    """The shared draft lengths of a batch's ``auto`` rows, its passes
    priced by ``cost``."""

    def __init__(self, cost: PassCost, group=None):
        self.cost, self.group = cost, group
        self.probes = ProbeSchedule(cost.tuning)
        self.last = None  # the last (k, k_h) chosen

    def choose(
        self,
        rows: int,
        auto: List[Tuple[Sequence[float], int]],
        fixed: int = 0,
        others: float = 0.0,
        head: List[Tuple[Sequence[float], int]] = (),
        head_fixed: int = 0,
        head_catch_up: int = 0,
        context: int = SHORT_CONTEXT,
        others_drafting: int = 0,
    ) -> Tuple[int, int]:
        """The draft lengths ``(k, k_h)`` of the auto rows drafting copies
        (``auto``) and with the MTP head (``head``), each row given as
        (acceptance, most drafts it may make); ``rows``: rows the pass
        computes, after ``context`` tokens on average; ``fixed``: the
        longest draft of the other rows (the pass computes at least
        ``1 + fixed`` positions); ``others``: their expected tokens;
        ``others_drafting``: how many of them draft; ``head_fixed``: the
        head steps they run; ``head_catch_up``: the positions of the
        catch-up the head rows' drafts would run (their deferred rows,
        padded to the longest)."""
        limit = max((cap for _, cap in auto), default=0)
        head_limit = max((cap for _, cap in head), default=0)
        copies = _group_tokens(auto, limit + 1)
        heads = _group_tokens(head, head_limit + 1)
        drafters = (
            _drafting(auto, limit + 1),
            _drafting(head, head_limit + 1),
            others_drafting,
        )
        k, kh = self._fastest(
            rows,
            copies,
            heads,
            drafters,
            fixed,
            others,
            head_fixed,
            head_catch_up,
            context,
        )
        if self.probes.apply(max(k, kh), max(limit, head_limit)) > max(k, kh):
            k, kh = min(1, limit), min(1, head_limit)  # one draft for every row
        if self.group is not None:
            k, kh = from_rank0(self.group, k), from_rank0(self.group, kh)
        self.last = (k, kh)
        return k, kh

    def _fastest(
        self,
        rows,
        copies,
        heads,
        drafters,
        fixed,
        others,
        head_fixed,
        catch_up,
        context,
    ):
        """The pair ``(k, k_h)`` of the most expected tokens a second, the
        first of equals in the order ``k``, then ``k_h``. It runs before
        every pass of a batch of ``auto`` rows, for up to 81 pairs, so each
        length's forward is looked up once."""
        cost, longest = self.cost, 1 + max(len(copies), len(heads), fixed + 1)
        forward = [0.0] + [cost.forward(rows * T, context) for T in range(1, longest)]
        copy_rows, head_rows, other_rows = drafters
        theta = cost.coefficients()
        best, best_speed = (0, 0), None
        for k, copy_tokens in enumerate(copies):
            for kh, head_tokens in enumerate(heads):
                T = 1 + max(k, kh, fixed)
                shape = PassShape(
                    rows,
                    T,
                    copy_rows[k] + head_rows[kh] + other_rows,
                    max(kh, head_fixed),
                    catch_up if kh else 0,
                    context,
                )
                f = cost.features(shape, forward[T])
                seconds = max(sum(a * b for a, b in zip(f, theta)), 1e-9)
                speed = (others + copy_tokens + head_tokens) / seconds
                if best_speed is None or speed > best_speed:
                    best, best_speed = (k, kh), speed
        return best

    def next_is_plain(self) -> bool:
        """Whether the next choice drafts nothing (said before it is made):
        the last one drafted nothing and no probe is due."""
        return self.last == (0, 0) and self.probes.plain_next()


def _drafting(group: List[Tuple[Sequence[float], int]], n: int) -> List[int]:
    """``rows[k]`` for ``k < n``: how many rows of ``group`` draft at all
    with ``k`` drafts each (those that may draft)."""
    return [sum(min(k, cap) > 0 for _, cap in group) for k in range(n)]


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
        catch_up = head_catch_up(rows, [b]) if b in heads else 0
        ks[b] = row.policy.active.choose(room, len(row.decoder.history), catch_up)
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
            head_catch_up(rows, [b for b in auto if b in heads]),
            _mean_context(rows, active),
            sum(k > 0 for k in ks.values()),
        )
        ks.update({b: min(k_head if b in heads else k, caps[b]) for b in auto})
    longest = max(ks.values())
    return {
        b: k if b in heads else max(k, min(longest, caps[b])) for b, k in ks.items()
    }


def _mean_context(rows, active: List[int]) -> int:
    """The active rows' tokens of context, on average."""
    return sum(len(rows[b].decoder.history) for b in active) // len(active)


def head_catch_up(rows, drafting: List[int]) -> int:
    """Positions of the catch-up that runs before the rows ``drafting`` draft
    with their heads: every member head's row, padded to the longest of the
    drafting heads' deferred rows (see
    :meth:`~mlx_spec.core.batch_mtp.MTPBatch.catch_up`; a row alone: its own
    head's deferred rows). Rows without a head add nothing."""
    heads = [head_drafter(row.decoder.drafter) for row in rows]
    members = sum(h is not None for h in heads)
    pending = (heads[b].pending_rows for b in drafting if heads[b] is not None)
    return members * max(pending, default=0)


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
    B, context = len(batch.rows), _mean_context(batch.rows, list(drafts))
    drafting = sum(len(d) > 0 for d in drafts.values())
    cost = lengths.cost.cost
    spec = cost(PassShape(B, T, drafting, 0, 0, context))
    return tokens / spec >= len(drafts) / cost(PassShape(B, 1, 0, 0, 0, context))


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
