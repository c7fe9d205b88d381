"""Batched speculative decoding: every row's tokens are those it gets alone."""

import mlx.core as mx
import pytest

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.draft_lengths import RowGroup
from mlx_spec.core.pass_plan import Draft, PassPlan
from mlx_spec.drafters.contract import DraftSite, Proposal
from mlx_spec.core.pass_cost import PassCost
from mlx_spec.core.ragged_cache import RaggedKVCache
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.base import HostDrafter
from mlx_spec.mlx_lm_compat import make_prompt_cache
from mlx_spec.models import fast_layers
from mlx_spec.testing.memory import PER_TOKEN_LIMIT, growth_per_token
from mlx_spec.testing.reference import (
    drafter_for,
    OracleDrafter,
    cache_arrays,
    fed_decoder,
    prompts,
    reference_tokens,
    run_batch,
)
from mlx_spec.testing.reference import decode_alone

EOS = 399


@pytest.mark.parametrize(
    "kinds", [("oracle", "ngram", "oracle"), ("mtp", "mtp+ngram", "none")]
)
@pytest.mark.slow
def test_each_row_equals_its_decoding_alone(models, family, kinds):
    _assert_rows_equal_alone(models, family, kinds)


@pytest.mark.parametrize("kinds", [("oracle", "mtp+ngram", "none")])
def test_rows_attending_over_their_own_keys_equal_their_decoding_alone(
    models, family, kinds, monkeypatch
):
    """With every pass's attention split into a call per row (over its own
    keys, with its own mask), each row still gets its tokens alone."""
    monkeypatch.setattr(RaggedKVCache, "SPLIT_RATIO", 1.0)
    monkeypatch.setattr(RaggedKVCache, "SPLIT_WASTE", 0)
    calls = []
    real = fast_layers.attend_rows_alone
    monkeypatch.setattr(
        fast_layers, "attend_rows_alone", lambda *a: calls.append(a) or real(*a)
    )
    _assert_rows_equal_alone(models, family, kinds)
    assert len(calls) > 10 and {a[0].shape[2] for a in calls} > {1}


def _assert_rows_equal_alone(models, family, kinds):
    model, tok = models[family]
    specs = [
        (prompts("mixed"), 20, 3),
        (prompts("repetitive", n=9), 14, 0),
        ([7], 17, 5),
    ]
    batch = BatchDecoder(model, n_slots=4, max_draft=5)
    rows, want = {}, {}
    for (prompt, max_tokens, k), kind in zip(specs, kinds):
        ref = reference_tokens(model, tok, prompt, max_tokens)
        drafter = None if kind == "none" else drafter_for(kind, model, prompt, ref)
        b = batch.add(
            fed_decoder(model, prompt, drafter, 5),
            RowOptions(max_tokens, num_draft_tokens=k, stop_tokens={EOS}),
        )
        rows[b], want[b] = [], ref
    run_batch(batch, rows)
    assert rows == want


def test_rows_join_and_leave_between_passes(models, family):
    model, tok = models[family]
    a, b, c = (
        prompts("mixed", seed=1),
        prompts("repetitive", seed=2),
        prompts("random", n=7),
    )
    want = {p: reference_tokens(model, tok, p, 24) for p in map(tuple, (a, b, c))}
    batch = BatchDecoder(model, n_slots=2, max_draft=4)

    def add(p):
        ref = want[tuple(p)]
        d = fed_decoder(model, p, OracleDrafter(p + ref, error=0.2, seed=3))
        return batch.add(d, RowOptions(24, num_draft_tokens=4, stop_tokens={EOS}))

    got = {}
    sa, sb = add(a), add(b)
    got[sa], got[sb] = [], []
    for _ in range(3):
        for s, (t, _) in batch.step().items():
            got[s] += t
    # b leaves mid-run as a single-sequence decoder, c takes its slot
    left, b_tokens = batch.take(sb), got.pop(sb)
    sc = add(c)
    got[sc] = []
    run_batch(batch, got)
    assert got[sa] == want[tuple(a)] and got[sc] == want[tuple(c)]
    # b goes on alone from exactly where the batch left it
    rest = _continue(left, 24 - len(b_tokens))
    assert b_tokens + rest == want[tuple(b)]


def _continue(decoder, max_tokens):
    """Plain one-token steps of a single-sequence decoder."""
    out = []
    while len(out) < max_tokens and EOS not in out:
        out += decode_alone(decoder, 0, max_tokens=1, max_passes=1)
    return out


def test_a_row_taken_out_holds_plain_decodings_caches(models, family):
    model, tok = models[family]
    prompt = prompts("mixed", seed=4)
    ref = reference_tokens(model, tok, prompt, 13)
    batch = BatchDecoder(model, n_slots=3, max_draft=4)
    other = batch.add(
        fed_decoder(model, prompts("random"), make_drafter("ngram", model)),
        RowOptions(30),
    )
    slot = batch.add(
        fed_decoder(model, prompt, OracleDrafter(prompt + ref, error=0.3)),
        RowOptions(13, num_draft_tokens=4),
    )
    tokens = []
    while slot in batch.active:
        tokens += batch.step().get(slot, ([], None))[0]
    decoder = batch.take(slot)
    assert tokens == ref and other in batch.active
    decoder.flush()  # the last token processed, as plain decoding's cache holds it
    plain = make_prompt_cache(model)
    reference_tokens(model, tok, prompt, 13, prompt_cache=plain)
    got, want = cache_arrays(decoder.cache.caches), cache_arrays(plain)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.shape == y.shape and mx.array_equal(x, y).item()


def test_the_batch_empties_and_fills_again(models, family):
    """Every row leaves, then one-token and longer prompts join again."""
    model, tok = models[family]
    batch = BatchDecoder(model, n_slots=2, max_draft=3)
    for prompt in ([5, 6, 7], [9], prompts("mixed", seed=6)):
        want = reference_tokens(model, tok, prompt, 6)
        id = batch.add(
            fed_decoder(model, prompt, make_drafter("ngram", model)), RowOptions(6)
        )
        got = {id: []}
        run_batch(batch, got)
        batch.take(id)
        assert got[id] == want and batch.free == 2


def memory_after_rounds(batch, rounds: int, add_row, tokens: int):
    """Active memory with the batch empty after each round: two rows added
    by ``add_row(round, i)``, each decoded to ``tokens`` tokens, taken out."""
    readings = []
    for round in range(rounds):
        ids = {add_row(round, i): [] for i in range(2)}
        run_batch(batch, ids)
        assert not batch.queued and all(len(t) == tokens for t in ids.values())
        for id in ids:
            batch.take(id)
        mx.eval([])
        readings.append(mx.get_active_memory())
    return readings


def assert_flat_over_rounds(readings, tokens_per_round: int):
    """From the second round on (the first allocates the batch's buffers),
    growth per decoded token within ``PER_TOKEN_LIMIT``."""
    rounds = readings[1:]
    marks = [tokens_per_round * i for i in range(len(rounds))]
    assert growth_per_token(marks, rounds) < PER_TOKEN_LIMIT, readings


@pytest.mark.slow
def test_memory_flat_with_slots_cycling(tmp_path):
    """Sequences of mostly accepted drafts cycle through two slots; active
    memory with the batch empty does not grow from one round to the next."""
    import mlx_spec
    from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint

    model, _ = mlx_spec.load(write_cycle_checkpoint(tmp_path / "c", "qwen3_next"))
    order = cycle_order()
    batch = BatchDecoder(model, n_slots=2, max_draft=8)

    def add_row(round, i):
        prompt = order[10 * i + round : 10 * i + round + 30]
        d = fed_decoder(model, prompt, make_drafter("mtp+ngram", model), 8)
        return batch.add(d, RowOptions(150, num_draft_tokens=8))

    readings = memory_after_rounds(batch, 6, add_row, 150)
    assert_flat_over_rounds(readings, 2 * 150)


@pytest.mark.slow
def test_memory_flat_with_plain_passes_queued(models):
    """Rows without drafters (every pass queued ahead) cycle through two
    slots; active memory with the batch empty does not grow."""
    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)

    def add_row(round, i):
        prompt = prompts("mixed", seed=10 * round + i)
        return batch.add(fed_decoder(model, prompt, None), RowOptions(120))

    readings = memory_after_rounds(batch, 5, add_row, 120)
    assert_flat_over_rounds(readings, 2 * 120)


def test_a_long_sequence_joins_a_batch_of_short_ones(models, family):
    """Joining grows every row's attention buffers past their capacity."""
    model, tok = models[family]
    short, long = prompts("mixed", seed=7), prompts("random", n=300, seed=8)
    batch = BatchDecoder(model, n_slots=3, max_draft=3)
    got, want = {}, {}
    for p in (short, long):
        want[
            batch.add(
                fed_decoder(model, p, make_drafter("ngram", model)), RowOptions(8)
            )
        ] = reference_tokens(model, tok, p, 8)
    got = {id: [] for id in want}
    run_batch(batch, got)
    assert got == want


def _beside_a_row_drafting_five(model, tok, drafter, verify_costs=None):
    """An ``auto`` row decoding a short prompt with ``drafter(prompt, ref)``
    beside a row drafting 5 tokens a pass (while its known continuation
    lasts): its tokens, plain decoding's tokens, its stats and the other
    row's."""
    long, short = prompts("mixed", seed=11), prompts("random", seed=12)
    batch = BatchDecoder(model, n_slots=2, max_draft=8)
    sure = OracleDrafter(long + reference_tokens(model, tok, long, 200))
    fixed = batch.add(
        fed_decoder(model, long, sure, 8), RowOptions(200, num_draft_tokens=5)
    )
    ref = reference_tokens(model, tok, short, 30)
    row = batch.add(
        fed_decoder(model, short, drafter(short, ref), 8),
        RowOptions(30, stop_tokens={EOS}, verify_costs=verify_costs),
    )
    got = []
    while row in batch.active:
        got += batch.step().get(row, ([], None))[0]
    return got, ref, batch.take(row).stats, batch.take(fixed).stats


# One-sequence verify costs for T = 1..9 tokens (seconds).
_COSTS = [0.01 + 0.002 * t for t in range(9)]


@pytest.fixture
def modelled_pass_costs(monkeypatch):
    """The batch's cost fit sees modelled pass times (a fixed part, 2 ms per
    computed position, 4 ms per head step) instead of this machine's: the
    tests using it are about the lengths chosen, not the fit, and a busy
    machine's timings could make any length look cheapest."""
    real = PassCost.observe

    def observe(self, shape, seconds):
        rows, T = shape.rows, shape.T
        modelled = 0.01 + 0.002 * rows * T + 0.004 * shape.head_steps
        return real(self, shape, modelled)

    monkeypatch.setattr(PassCost, "observe", observe)


def test_an_auto_row_drafts_as_long_as_the_pass(models, family, modelled_pass_costs):
    """Beside a row drafting 5 tokens a pass, an ``auto`` row whose drafts
    are never accepted still verifies up to 5 drafts each pass (the pass
    computes those positions for every row anyway); once the other row has
    no draft (its known continuation ended), its own copies alone do not pay
    for their pass and it decodes plainly. Its tokens are plain decoding's."""
    model, tok = models[family]
    got, ref, stats, other = _beside_a_row_drafting_five(
        model,
        tok,
        lambda prompt, ref: OracleDrafter(prompt + ref, error=1.0),
        verify_costs=_COSTS,
    )
    assert got == ref
    assert stats.verify_passes == len(ref) and stats.accepted == 0
    beside = other.drafted_at[0]  # passes where the other row drafted
    assert beside >= 10
    assert stats.drafted == sum(min(5, 29 - i) for i in range(beside))
    # it drafted in exactly those passes (the last has no room for a draft)
    assert stats.drafted_at[0] == min(beside, len(ref) - 1)


def test_a_lone_copy_does_not_pay_for_its_pass(models):
    """Four ``auto`` rows expecting 0.9 of their drafts accepted, but only
    one found a copy: three drafts (the pass computes every row over 4
    positions) do not pay against a plain pass under the cost model, so the
    pass runs plain; one draft on each row does. Drafts that ran anyway or
    were asked for stand: a head's (its steps ran), a fixed-length row's, a
    probe's."""
    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=4, max_draft=8)
    for i in range(4):
        prompt = prompts("random", seed=30 + i)
        decoder = fed_decoder(model, prompt, OracleDrafter(prompt), 8)
        batch.add(decoder, RowOptions(24, verify_costs=_COSTS))
    for row in batch.rows:
        row.acceptance.select(None).acceptance = lambda: [0.9] * 8
    scheduler = batch.scheduler

    def plan(drafts, site=DraftSite.HOST):
        made = {
            b: Draft(Proposal(mx.array(d, mx.uint32), None, site))
            for b, d in drafts.items()
        }
        return PassPlan(
            made, 4, 0, 0, len(prompt), groups=dict.fromkeys(made, RowGroup.COPIES)
        )

    lone = {0: [5, 6, 7], 1: [], 2: [], 3: []}
    assert not scheduler.copies_pay(batch.rows, plan(lone))
    assert scheduler.copies_pay(batch.rows, plan({b: [5] for b in range(4)}))
    assert scheduler.copies_pay(batch.rows, plan(lone, DraftSite.DEVICE))  # the head's
    probes = scheduler.lengths.states[RowGroup.COPIES].probes
    probes.probing = True
    assert scheduler.copies_pay(batch.rows, plan(lone))
    probes.probing = False
    batch.rows[0].acceptance = None  # a fixed draft length
    assert scheduler.copies_pay(batch.rows, plan(lone))


def test_a_head_row_does_not_draft_up_to_a_copy_rows_length(
    models, family, modelled_pass_costs
):
    """Beside a row drafting 5 tokens a pass, an ``auto`` row drafting with
    the MTP head (random here: its drafts fail) is not filled up to 5: each
    of its drafts would be one more head step. Its tokens are plain
    decoding's."""
    model, tok = models[family]
    got, ref, stats, _ = _beside_a_row_drafting_five(
        model, tok, lambda prompt, ref: make_drafter("mtp", model), _COSTS
    )
    assert got == ref
    assert stats.drafted < 2 * stats.verify_passes  # filled: 5 a pass


def test_a_row_without_a_drafter_decodes_plainly_under_auto(models):
    """``auto`` has nothing to choose for a row without a drafter: it
    decodes one token a pass beside an auto row that drafts."""
    model, tok = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    rows, want = {}, {}
    for prompt, draft in ((prompts("mixed"), None), (prompts("repetitive"), "ngram")):
        ref = reference_tokens(model, tok, prompt, 12)
        drafter = draft and make_drafter(draft, model)
        d = fed_decoder(model, prompt, drafter)
        b = batch.add(d, RowOptions(12, num_draft_tokens="auto", stop_tokens={EOS}))
        rows[b], want[b] = [], ref
    run_batch(batch, rows)
    assert rows == want


class _NeverRightDrafter(HostDrafter):
    """Drafts the token after the one the target last chose (on these
    models, hardly ever its next choice); with ``judged``, reports one first
    draft judged wrong in hindsight before every pass."""

    def __init__(self, judged: bool):
        self.judged, self.last = judged, 0

    def reset(self, prompt, hidden=None):
        self.last = prompt[-1]

    def accept(self, tokens, hidden=None):
        self.last = tokens[-1]

    def draft(self, k):
        return [(self.last + 1) % 256] * k

    def hindsight(self):  # with the two below, contract.SelfJudging
        return {None: (0, 1)} if self.judged else {}

    def draft_source(self, k, look=True):
        return None

    def set_source_paying(self, source, paying):
        pass


@pytest.mark.parametrize("judged", [True, False])
def test_rows_judged_in_hindsight_are_not_probed(models, judged):
    """Once drafting stops, auto rows whose drafts are judged in hindsight
    every pass are never probed; control: without judgements the batch
    probes now and then."""
    model, tok = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    for seed in (1, 2):
        d = fed_decoder(model, prompts("mixed", seed=seed), _NeverRightDrafter(judged))
        batch.add(d, RowOptions(150, verify_costs=[0.01 + 0.002 * t for t in range(9)]))
    drafted = []
    while batch.active:
        before = sum(r.decoder.stats.drafted for r in batch.rows)
        batch.step()
        drafted.append(sum(r.decoder.stats.drafted for r in batch.rows) - before)
    assert (sum(map(bool, drafted[40:])) == 0) == judged, drafted
