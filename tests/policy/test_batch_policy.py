"""The shared draft length of a batch's auto rows, priced by the fitted pass cost."""

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from dataclasses import replace

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.cost_profile import SHORT_CONTEXT, as_cost_profile
from mlx_spec.core.draft_lengths import (
    Candidate,
    DraftLengths,
    PassRequest,
    RowGroup,
    Verdict,
)
from mlx_spec.core.pass_cost import PassCost, PassShape
from mlx_spec.core.policy_tuning import DEFAULT_TUNING as TUNING
from mlx_spec.core.scheduler import head_catch_up, head_upkeep
from mlx_spec.drafters.base import HostDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.testing.reference import fed_decoder, prompts

# A single-sequence profile: 5 ms plus 1 ms per token verified (T = 1..9).
PROFILE = [0.005 + 0.001 * T for T in range(1, 10)]


class _Lengths:
    """The batch's choice as these tests ask it: the pair ``(k, k_h)`` for
    rows copying (``auto``) and rows drafting with the head (``head``), each
    given as (acceptance, most drafts), with their probes at ``k = 0``; the
    rows' evidence is ample and cost probes are off, so neither a depth
    probe nor a plain pass for timing stands in the way of the pair."""

    def __init__(self, tuning=TUNING):
        tuning = replace(tuning, depth_evidence=0.0, plain_probe_weight=0.0)
        self.lengths = DraftLengths(PassCost(as_cost_profile(PROFILE), tuning=tuning))
        self.cost = self.lengths.cost

    def choose(
        self,
        rows,
        auto,
        fixed=0,
        others=0.0,
        head=(),
        head_fixed=0,
        head_catch_up=0,
        context=SHORT_CONTEXT,
        others_drafting=0,
        head_upkeep=0,
    ):
        ample = [100.0] * 8
        candidates = tuple(
            Candidate(RowGroup.COPIES, a, ample, cap) for a, cap in auto
        ) + tuple(Candidate(RowGroup.HEAD, a, ample, cap) for a, cap in head)
        request = PassRequest(
            rows,
            candidates,
            fixed,
            others,
            others_drafting,
            head_fixed,
            head_catch_up,
            context,
            head_upkeep=head_upkeep,
        )
        chosen = self.lengths.choose(request)
        return chosen[RowGroup.COPIES], chosen[RowGroup.HEAD]

    def next_is_plain(self) -> bool:
        return self.lengths.next_is_plain()


def _length(tuning=TUNING) -> _Lengths:
    return _Lengths(tuning)


def _shape(rows, T, head_steps=0, catch_up=0) -> PassShape:
    """Every row drafts in a pass of more than one position."""
    return PassShape(rows, T, rows if T > 1 else 0, head_steps, catch_up)


def _observe(length: _Lengths, rows, T, seconds, head_steps=0, catch_up=0):
    length.cost.observe(_shape(rows, T, head_steps, catch_up), seconds)


def _cost(length: _Lengths, rows, T, head_steps=0, catch_up=0) -> float:
    return length.cost.cost(_shape(rows, T, head_steps, catch_up))


def test_drafts_get_shorter_as_the_batch_grows():
    """Every row's longer draft costs every row: the more rows, the shorter
    the shared draft (acceptance 0.8 at every position)."""
    policy = _length()
    ks = [policy.choose(B, [([0.8] * 8, 8)] * B)[0] for B in (1, 2, 4, 8)]
    assert ks == sorted(ks, reverse=True) and ks[0] == 4 and ks[-1] == 1


def test_rows_whose_drafts_fail_decode_plainly_with_a_probe():
    policy = _length()
    ks = [policy.choose(2, [([0.0] * 8, 8)] * 2)[0] for _ in range(TUNING.probe_every)]
    assert ks == [0] * (TUNING.probe_every - 1) + [1]
    # the probe's length bounds slices of the drafts' logits: a bool (True == 1)
    # passed the comparison above but MLX refuses it as a slice bound
    assert mx.arange(4)[: ks[-1]].tolist() == [0]


def test_the_pass_before_a_probe_is_not_said_to_be_plain():
    """``next_is_plain`` says, before the choice, whether it will draft
    nothing: true after plain choices until the probe is due."""
    policy = _length()
    assert not policy.next_is_plain()  # nothing chosen yet
    said = []
    for _ in range(TUNING.probe_every):
        said.append(policy.next_is_plain())
        k, _ = policy.choose(2, [([0.0] * 8, 8)] * 2)
        assert said[-1] <= (k == 0)  # never plain when it drafts
    assert said == [False] + [True] * (TUNING.probe_every - 2) + [False]
    policy.choose(2, [([0.9] * 8, 8)] * 2)  # drafting pays
    assert not policy.next_is_plain()


def _probes_in(rows: int, passes: int, accepting: int) -> int:
    """Probes of the head group over ``passes`` passes of ``rows`` new head
    rows (one trial each at the first position, drafts worth nothing at
    the estimates), of which ``accepting`` accept every probe's draft."""
    lengths = DraftLengths(PassCost(as_cost_profile(PROFILE), tuning=TUNING))
    thin = [1.0] * 8
    candidates = (Candidate(RowGroup.HEAD, [0.0] * 8, thin, 8),) * rows
    probes = 0
    for _ in range(passes):
        if lengths.choose(PassRequest(rows, candidates))[RowGroup.HEAD]:
            probes += 1
            verdicts = [Verdict(1.0, b < accepting) for b in range(rows)]
            lengths.probed(RowGroup.HEAD, verdicts)
    return probes


def test_one_row_of_many_accepting_its_probes_does_not_keep_the_batch_probing():
    """A probe's verdict is the group's, its evidence pooled over the rows
    that drafted: eight new rows (one trial each), one of which accepts,
    have eight trials together, so the probes keep their interval. Alone,
    the same row's one trial starts a streak of probes (its control)."""
    passes = 4 * TUNING.probe_every
    assert _probes_in(8, passes, accepting=1) <= passes // TUNING.probe_every
    assert _probes_in(1, passes, accepting=1) > passes // 2
    assert _probes_in(8, passes, accepting=0) <= passes // TUNING.probe_every


def test_a_group_of_rows_deepens_only_while_its_pooled_evidence_is_thin():
    """A depth probe asks whether the next position is barely tested. Eight
    rows with one trial each there have tested it eight times together: no
    depth probe; with a quarter of a trial each (two together) they have
    not (its control)."""
    tuning = replace(TUNING, plain_probe_weight=0.0)
    for trials, deepened in ((1.0, False), (0.25, True)):
        lengths = DraftLengths(PassCost(as_cost_profile(PROFILE), tuning=tuning))
        evidence = [100.0, trials] + [0.0] * 6
        row = Candidate(RowGroup.COPIES, [0.9, 0.6] + [0.1] * 6, evidence, 8)
        chosen = lengths.choose(PassRequest(8, (row,) * 8))[RowGroup.COPIES]
        assert lengths.states[RowGroup.COPIES].best == 1
        assert (chosen == 2) is deepened


def test_a_longer_fixed_draft_elsewhere_is_free_to_match():
    """The pass computes 1 + 5 positions anyway: an auto row may as well
    draft up to 5, even with poor acceptance."""
    policy = _length()
    assert policy.choose(2, [([0.3] * 8, 8)], fixed=5, others=1.0) == (5, 0)


def test_the_cost_model_learns_the_batch_passes():
    """Passes that really cost 2 ms + 3 ms per token computed, plus 4 ms
    per MTP head step: after enough of them the model predicts that."""
    policy = _length()
    for i in range(300):
        B, T, S = 1 + i % 4, 1 + i % 5, i % 3
        _observe(policy, B, T, 0.002 + 0.003 * B * T + 0.004 * S, S)
    for B, T, S in ((1, 1, 0), (4, 1, 0), (4, 3, 2), (8, 6, 5)):
        want = 0.002 + 0.003 * B * T + 0.004 * S
        assert _cost(policy, B, T, S) == pytest.approx(want, rel=0.05)


def test_passes_of_one_shape_keep_a_cost_that_grows_with_the_draft():
    """Four rows decoding plainly for a long while, one of them leaving for
    a pass that happened to be slow: passes of (almost) one shape determine
    only one combination of the costs. The profile keeps the rest, so drafts
    with 0.9 acceptance still look worth their positions and the cost
    still grows with T (a prior that decayed away let these passes fit a
    negative fixed cost and a steep per-token one: never a draft again)."""
    policy = _length()
    for i in range(200):
        rows = 3 if i == 150 else 4
        _observe(policy, rows, 1, 0.0125 if rows == 3 else 0.011)
    costs = [_cost(policy, 4, T) for T in range(1, 10)]
    assert all(a < b for a, b in zip(costs, costs[1:]))
    assert _cost(policy, 4, 1) == pytest.approx(0.011, rel=0.1)
    assert policy.choose(4, [([0.9] * 8, 8)] * 4)[0] >= 1


@pytest.mark.parametrize("step_ms", [12.0, 0.0])
def test_rows_drafting_with_the_head_get_their_own_length(step_ms):
    """Two rows copying (acceptance 0.95) and two drafting with the MTP head
    (0.75), on passes costing 12.5 ms + 1.9 ms per token computed (the demo
    model at four rows). Each head draft is a head step for all head rows;
    when a step costs 12 ms the copies draft and the head rows do not
    (filling them up to the copies' length had cost a step per position);
    when steps are free both draft."""
    policy = _length()
    for i in range(300):
        B, T, S = 1 + i % 4, 1 + i % 5, i % 3
        _observe(policy, B, T, 1e-3 * (12.5 + 1.9 * B * T + step_ms * S), S)
    copies, heads = [([0.95] * 8, 8)] * 2, [([0.75] * 8, 8)] * 2
    k, k_head = policy.choose(4, copies, head=heads)
    assert k >= 2
    assert (k_head == 0) if step_ms else (k_head >= 2)


def test_a_head_step_is_not_charged_with_the_catch_up_before_it():
    """Head passes cost 5 ms a step plus 0.1 ms per position the head
    catches up: few after a drafting pass, hundreds after a stretch at
    k = 0. The fit tells the two apart, so a head step is priced at its
    5 ms, not at the catch-up a probe after a long stretch pays. (Copies
    lengthen some passes without head steps: T alone tells the forward's
    growth from a step.)"""
    policy = _length()
    for i in range(300):
        S = i % 3
        C = (64 * (1 + i % 4) if i % 5 == 0 else 8) if S else 0
        T = 1 + max(S, i % 2)
        _observe(policy, 4, T, 0.012 + 0.002 * 4 * T + 0.005 * S + 1e-4 * C, S, C)
    step = _cost(policy, 4, 2, 1) - _cost(policy, 4, 2, 0)
    assert step == pytest.approx(0.005, rel=0.1)


def _fitted_with_catch_ups() -> _Lengths:
    """Four rows, passes of 12 ms + 2 ms per position + 1 ms a head step +
    0.1 ms per position the head catches up."""
    policy = _length()
    for i in range(300):
        S = i % 3
        C = (64 * (1 + i % 4) if i % 5 == 0 else 8) if S else 0
        T = 1 + max(S, i % 2)
        _observe(policy, 4, T, 0.012 + 0.002 * 4 * T + 0.001 * S + 1e-4 * C, S, C)
    return policy


def test_a_head_draft_pays_for_the_catch_up_it_runs():
    """Four rows drafting with the head (acceptance 0.7): caught up, a draft
    pays; when the catch-up before it would run 4 x 100 positions (its rows
    deferred over a stretch without head drafts: a finished request keeps
    them unrun) it does not, and the rows decode plainly. The copy rows'
    choice is not charged with it."""
    heads = [([0.7] * 8, 8)] * 2
    _, k_head = _fitted_with_catch_ups().choose(4, [], head=heads * 2)
    assert k_head >= 1
    _, k_head = _fitted_with_catch_ups().choose(
        4, [], head=heads * 2, head_catch_up=400
    )
    assert k_head == 0
    copies = [([0.95] * 8, 8)] * 2
    k, k_head = _fitted_with_catch_ups().choose(
        4, copies, head=heads, head_catch_up=400
    )
    assert k >= 1 and k_head == 0


@pytest.mark.parametrize("bound", [TUNING.stall_bound, math.inf])
def test_two_stalled_passes_do_not_reshape_the_cost(bound):
    """Four rows at T = 1..3 costing 4 ms + 2 ms per position, then two
    one-token passes the machine stalled on (90, 85 ms). Counted at most
    STALL_BOUND times the expected cost, the cost still grows with T and
    rows at 0.55 acceptance draft little; counted in full (the control),
    a one-token pass is priced at more than twice what such passes take.
    A lasting doubling of every pass is followed all the same."""
    length = _length(replace(TUNING, stall_bound=bound))
    for i in range(100):
        _observe(length, 4, 1 + i % 3, 0.004 + 0.008 * (1 + i % 3))
    _observe(length, 4, 1, 0.09)
    _observe(length, 4, 1, 0.085)
    k, _ = length.choose(4, [([0.55] * 8, 8)] * 4)
    grows = _cost(length, 4, 4) > _cost(length, 4, 2) > _cost(length, 4, 1)
    one = _cost(length, 4, 1)
    if bound < math.inf:
        assert grows and k <= 2 and one == pytest.approx(0.012, rel=0.2)
    else:
        assert one > 2 * 0.012
    for i in range(60):
        _observe(length, 4, 1 + i % 3, 2 * (0.004 + 0.008 * (1 + i % 3)))
    assert _cost(length, 4, 2) == pytest.approx(2 * 0.02, rel=0.05)


def test_the_catch_up_counts_every_member_padded_to_the_longest():
    """The head's catch-up forward runs every member head's row, padded to
    the longest deferred rows of those about to draft (what it computes)."""

    def row(drafter, deferred=0):
        if deferred:
            drafter.accept(list(range(deferred)), mx.zeros((deferred, 4)))
        return SimpleNamespace(decoder=SimpleNamespace(drafter=drafter))

    heads = [MTPDrafter(head=None) for _ in range(3)]
    rows = [row(heads[0], 5), row(NgramDrafter()), row(heads[1], 2), row(heads[2])]
    assert head_catch_up(rows, [0, 2]) == 3 * 5
    assert head_catch_up(rows, [2]) == 3 * 2
    assert head_catch_up(rows, [3]) == head_catch_up(rows, []) == 0


def test_the_heads_upkeep_is_priced_into_a_pass_without_head_drafts():
    """One head row, passes of 1 ms + the profile's forward (7 ms at T = 1,
    8 at T = 2) + 1 ms a head step + 1 ms per position of head catch-up,
    fitted. At acceptance 0.2 a draft does not pay against a plain pass with
    no upkeep (1.2 tokens in 9 ms against 1 in 7), and does against one whose
    head still runs two rows of upkeep (1 in 9 ms)."""
    policy = _length()
    for i in range(300):
        S, C = i % 2, i % 3
        T = 1 + S
        seconds = 0.001 + PROFILE[T - 1] + 0.001 * S + 0.001 * C
        policy.cost.observe(PassShape(1, T, S, S, C), seconds)
    head = [([0.2] * 8, 8)]
    assert policy.choose(1, [], head=head)[1] == 0
    assert policy.choose(1, [], head=head, head_upkeep=2)[1] >= 1


def test_the_upkeep_counts_the_heads_that_are_not_suspended():
    """A pass's head upkeep: one row for each active row whose head has not
    stopped its upkeep; rows without a head add nothing."""

    def row(drafter):
        return SimpleNamespace(decoder=SimpleNamespace(drafter=drafter))

    heads = [MTPDrafter(head=None) for _ in range(3)]
    heads[1].suspend("mtp")
    rows = [row(heads[0]), row(NgramDrafter()), row(heads[1]), row(heads[2])]
    assert head_upkeep(rows, [0, 1, 2, 3]) == 2
    assert head_upkeep(rows, [1, 2]) == 0
    heads[1].resume("mtp")
    assert head_upkeep(rows, [1, 2]) == 1


class _NothingToCopy(HostDrafter):
    """A copy drafter whose index never matches; ``says``: it tells the batch
    so (``can_draft``), else it is as unknown as any custom drafter."""

    def __init__(self, says: bool):
        self.says = says

    def reset(self, prompt, hidden=None):
        pass

    def accept(self, tokens, hidden=None):
        pass

    def draft(self, k):
        return []

    def can_draft(self):
        return not self.says


@pytest.mark.parametrize("says", [True, False])
def test_rows_with_nothing_to_copy_queue_their_plain_passes(models, says):
    """Four ``auto`` rows whose acceptance promises 0.9 but which have no
    copy to make. Said so, each counts as one token: the batch chooses plain
    passes and queues each behind the last. Control: not said, the batch
    chooses drafts that never come, and no pass is queued."""
    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=4, max_draft=8)
    for i in range(4):
        prompt = prompts("random", seed=30 + i)
        batch.add(fed_decoder(model, prompt, _NothingToCopy(says), 8), RowOptions(24))
    for row in batch.rows:
        row.acceptance.select(None).acceptance = lambda: [0.9] * 8
    queued = []
    for _ in range(8):
        batch.step()
        queued.append(batch.queued)
    assert queued == [says] * 8


def test_the_pair_chosen_is_the_first_fastest_by_the_cost_model():
    """``choose`` picks the pair of draft lengths with the most expected
    tokens a second by the batch's :class:`PassCost`, the first of equals (``k``,
    then ``k_h``), over random fits (head steps and catch-ups included),
    rows, acceptances, caps and fixed rows; ties come from rows that may not
    draft. Probes are kept out of the way."""
    from mlx_spec.core.policy import expected_tokens
    import random

    rng = random.Random(7)

    def rows_of(n):
        return [
            ([rng.choice([0.0, rng.random()]) for _ in range(8)], rng.randrange(9))
            for _ in range(n)
        ]

    for _ in range(300):
        policy = _length()
        for state in policy.lengths.states.values():
            state.probes.every = 10**9
        for _ in range(rng.randrange(40)):
            _observe(
                policy,
                rng.choice([2, 4, 8]),
                rng.randrange(1, 10),
                rng.uniform(0.005, 0.08),
                rng.randrange(4),
                rng.randrange(300),
            )
        n_rows = rng.choice([2, 4, 8])
        auto, head = rows_of(rng.randrange(n_rows)), rows_of(rng.randrange(3))
        fixed, head_fixed = rng.choice([0, 0, 2]), rng.choice([0, 0, 1])
        others, catch_up = float(rng.randrange(3)), rng.randrange(200)
        others_drafting = int(fixed > 0) * rng.randrange(1, 3)
        context = rng.choice([32, 500])
        limit = max((c for _, c in auto), default=0)
        head_limit = max((c for _, c in head), default=0)

        def speed(k, kh):
            tokens = others + sum(expected_tokens(a, min(k, c)) for a, c in auto)
            tokens += sum(expected_tokens(a, min(kh, c)) for a, c in head)
            drafting = sum(min(k, c) > 0 for _, c in auto) + others_drafting
            drafting += sum(min(kh, c) > 0 for _, c in head)
            T = 1 + max(k, kh, fixed)
            shape = PassShape(
                n_rows,
                T,
                drafting,
                max(kh, head_fixed),
                catch_up if kh else 0,
                context,
            )
            return tokens / policy.cost.cost(shape)

        pairs = [(k, kh) for k in range(limit + 1) for kh in range(head_limit + 1)]
        best = max(pairs, key=lambda pair: speed(*pair))
        got = policy.choose(
            n_rows,
            auto,
            fixed,
            others,
            head,
            head_fixed,
            catch_up,
            context,
            others_drafting,
        )
        assert got == best
