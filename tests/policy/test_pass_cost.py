"""The one fitted pass-cost model: its forward, its fit, and who shares it."""

import random

import pytest

from mlx_spec.core.cost_profile import CostProfile, as_cost_profile
from mlx_spec.core.pass_cost import PassCost, PassShape

# One sequence's verify forward: 6 ms plus 1 ms per token (T = 1..9).
PROFILE = [0.006 + 0.001 * t for t in range(9)]


def _cost(head_step: float = 0.0) -> PassCost:
    return PassCost(as_cost_profile(PROFILE), head_step)


def test_the_forward_is_the_profile_over_rows_times_positions():
    """Within the profile, a forward over ``rows * T`` tokens is the
    profile's; past it, the profile's upper slope carries on (1 ms a token
    here), growing with context as the profile does."""
    cost = _cost()
    assert cost.forward(1) == pytest.approx(0.006)
    assert cost.forward(9) == pytest.approx(0.014)
    assert cost.forward(40) == pytest.approx(0.014 + 0.031)
    long = PassCost(CostProfile(list(PROFILE), (1032, [2 * c for c in PROFILE])))
    assert long.forward(4, 532) == pytest.approx(1.5 * PROFILE[3])


def test_before_any_pass_the_cost_is_the_profile_and_the_heads_steps():
    cost = _cost(head_step=0.002)
    assert cost.cost(PassShape()) == pytest.approx(0.006)
    shape = PassShape(rows=4, T=3, drafting=4, head_steps=2)
    assert cost.cost(shape) == pytest.approx(cost.forward(12) + 2 * 0.002)


def test_the_fit_recovers_what_passes_cost():
    """Passes generated from known costs (a constant, a forward twice the
    profile's growth, a cost per row, per drafting row, per head step and
    per catch-up position) on random shapes: the fit prices new shapes to
    within a few per cent."""
    rng = random.Random(3)
    true = dict(extra=0.002, per_row=0.0005, per_drafting_row=0.0008)
    true.update(per_head_step=0.003, per_catch_up=0.0001)
    cost = _cost()

    def seconds(s: PassShape) -> float:
        forward = 0.001 * 2 * (s.rows * s.T)  # 2 ms per token computed
        return (
            true["extra"]
            + forward
            + true["per_row"] * (s.rows - 1)
            + true["per_drafting_row"] * s.drafting
            + true["per_head_step"] * s.head_steps
            + true["per_catch_up"] * s.catch_up
        )

    def shape() -> PassShape:
        rows, T = rng.choice([1, 2, 4]), rng.randrange(1, 5)
        drafting = rng.randrange(1, rows + 1) if T > 1 else 0
        steps = rng.randrange(0, T) if T > 1 else 0
        return PassShape(rows, T, drafting, steps, rng.randrange(40) if steps else 0)

    for _ in range(400):
        s = shape()
        cost.observe(s, seconds(s))
    for _ in range(20):
        s = shape()
        assert cost.cost(s) == pytest.approx(seconds(s), rel=0.05)


def test_the_first_pass_of_a_shape_is_not_counted():
    cost = _cost()
    assert not cost.observe(PassShape(T=2, drafting=1), 0.5)  # a warm-up pass
    assert cost.weight == 0
    assert cost.observe(PassShape(T=2, drafting=1), 0.009)
    assert cost.weight == 1


def test_a_draft_is_never_priced_as_a_gain():
    """Drafting passes that happen to run faster than plain ones (noise)
    price a draft at nothing, never at a gain: every cost but the constant
    is cut back to zero where the fit would put it below."""
    cost = _cost()
    for i in range(100):
        k = i % 3
        shape = PassShape(rows=2, T=1 + k, drafting=2 * (k > 0))  # no healing
        cost.observe(shape, 0.004 - 0.0005 * k)
    assert cost.fitted()["per_drafting_row"] == 0.0
    plain = cost.cost(PassShape(rows=2))
    assert cost.cost(PassShape(rows=2, T=3, drafting=2)) >= plain


def test_a_batch_of_constant_rows_is_priced_as_its_passes_ran():
    """Every pass has 8 rows, so the constant and the cost per row are one
    term to the fit, and the profile (one sequence's) overprices an 8-row
    forward 3x here. Passes ran: plain 20 ms, 8 copy drafts of 8 positions
    70 ms. Priced within 10% both: a coefficient the unconstrained fit would
    put below 0 is held at 0 and the others solved again, not cut alone
    (which left the constant's compensation in place: plain passes priced
    at 2x what they took)."""
    cost = _cost()
    plain, drafted = PassShape(rows=8), PassShape(rows=8, T=9, drafting=8)
    rng = random.Random(5)
    for i in range(200):
        shape = drafted if i % 4 == 0 else plain
        timed = 0.070 if shape is drafted else 0.020
        cost.observe(shape, timed * (1 + 0.05 * rng.uniform(-1, 1)))
    assert cost.cost(plain) == pytest.approx(0.020, rel=0.1)
    assert cost.cost(drafted) == pytest.approx(0.070, rel=0.1)
    assert min(cost.coefficients()[1:]) >= 0.0


def test_a_one_row_pass_under_the_profile_heals_it_and_restarts_the_fit():
    """Plain passes of one row take 3 ms where the profile says 6: the
    profile is lowered (its version moves) and the fit, whose residuals were
    taken against the old forwards, starts again."""
    cost = _cost()
    before = cost.profile.version
    for _ in range(20):
        cost.observe(PassShape(), 0.003)
    assert cost.profile.version > before
    assert cost.profile.short[0] == pytest.approx(0.003)
    assert cost.weight < 15  # restarted when the profile moved
    assert cost.cost(PassShape()) == pytest.approx(0.003, rel=0.05)


def test_every_row_of_a_batch_is_priced_by_one_model(models):
    """The rows' own estimates hold acceptance only: the one choice function
    of the batch prices every pass by the batch's one model."""
    from mlx_spec.core.batch import BatchDecoder, RowOptions
    from mlx_spec.drafters.ngram import NgramDrafter
    from mlx_spec.testing.reference import fed_decoder, prompts

    model, _ = models["qwen3_next"]
    batch = BatchDecoder(model, n_slots=2, max_draft=4)
    assert batch.cost is None  # before an auto row: nothing to price
    for seed in (1, 2):
        prompt = prompts("repetitive", seed=seed)
        costs = [1e-3 * (1 + 0.2 * t) for t in range(9)]  # not the model's own
        options = RowOptions(8, verify_costs=costs)
        batch.add(fed_decoder(model, prompt, NgramDrafter(), 4), options)
    assert batch.scheduler.lengths.cost is batch.cost is not None
    assert all(not hasattr(r.acceptance, "cost") for r in batch.rows)
    fitted = batch.cost.weight
    while batch.active:
        batch.step(queue_ahead=False)
    assert batch.cost.weight > fitted  # its passes, timed into the one model


def test_a_sequence_tells_the_model_its_head_steps_and_catch_up(models, monkeypatch):
    """Decoding alone with the MTP head, each drafting pass is observed with
    as many head steps as drafts, and the head's catch-up; plain passes with
    no head steps, and the head's upkeep (one row, none once suspended) as
    their catch-up."""
    from mlx_spec.testing.reference import prompts, reference_tokens, spec_tokens

    model, tok = models["qwen3_next"]
    shapes = []
    observe = PassCost.observe

    def spy(self, shape, seconds):
        shapes.append(shape)
        return observe(self, shape, seconds)

    monkeypatch.setattr(PassCost, "observe", spy)
    prompt = prompts("repetitive")
    got = spec_tokens(model, tok, prompt, 40, draft="mtp", num_draft_tokens="auto")
    assert got == reference_tokens(model, tok, prompt, 40)
    drafting = [s for s in shapes if s.T > 1]
    assert drafting and all(s.head_steps == s.T - 1 for s in drafting)
    assert all(s.rows == 1 and s.drafting == 1 for s in drafting)
    assert any(s.catch_up > 0 for s in drafting)
    plain = [s for s in shapes if s.T == 1]
    assert all(s.head_steps == s.drafting == 0 for s in plain)
    assert all(s.catch_up in (0, 1) for s in plain)
