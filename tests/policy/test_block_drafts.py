"""``auto`` for a block drafter: drafts up to its own ceiling, its draft
forward priced per drafting pass and with its growth with context.

The choice is made as the engine makes it (its :class:`Scheduler` priced for
the drafter, the row's cap from the acceptance the scheduler gives it) over
a known cost model: the verify profile given, no pass timed, so every
coefficient is its prior and a pass costs ``forward(1 + k)`` plus, when the
row drafts, the drafter's declared forward. Each test checks the choice
against the best length computed here from that formula, and fails when the
draft forward is not priced or the ceiling is left at 8.
"""

from dataclasses import replace

import pytest

from mlx_spec.core.cost_profile import as_cost_profile
from mlx_spec.core.draft_lengths import Candidate, PassRequest, RowGroup
from mlx_spec.core.pass_cost import PassCost, PassShape
from mlx_spec.core.policy import expected_tokens
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.core.scheduler import Scheduler
from mlx_spec.drafters import calls
from mlx_spec.drafters.base import HostDrafter
from mlx_spec.drafters.contract import NO_DRAFT_FORWARD, DraftForwardCost
from mlx_spec.testing.block_drafter import PricedBlockDrafter

BLOCK = 15  # drafts a block of 16 holds after its first token
# A forward over T = 1..16 tokens: nearly flat, as on a GPU at small T.
FLAT = [0.020 + 0.0005 * t for t in range(BLOCK + 1)]


def chosen(drafter, acceptance, context=32, profile=FLAT, max_draft=16):
    """The length ``auto`` chooses for one row of ``drafter`` at the first
    pass (no probe is due), as the engine builds the choice."""
    scheduler = Scheduler(None, max_draft, None, DEFAULT_TUNING)
    scheduler.price(list(profile), drafter)
    cap = scheduler.acceptance(drafter).max_draft
    forwards = calls.forwards_to_draft(drafter)
    evidence = [100.0] * cap  # every position well tested: no depth probe
    row = Candidate(RowGroup.COPIES, acceptance[:cap], evidence, cap, forwards)
    request = PassRequest(1, (row,), context=context)
    return scheduler.lengths.choose(request)[RowGroup.COPIES]


def best_length(acceptance, forward: DraftForwardCost, context=32, ceiling=BLOCK):
    """The length maximising expected tokens a second when a pass of ``k``
    drafts costs ``FLAT[k]`` plus, for ``k > 0``, the draft forward."""

    def speed(k):
        block = forward.seconds + forward.per_kilotoken * context / 1000 if k else 0
        return expected_tokens(acceptance, k) / (FLAT[k] + block)

    return max(range(ceiling + 1), key=speed)


def test_deep_reliable_blocks_draft_past_eight():
    """Acceptance 0.9 at every position, a cheap block forward: the whole
    block pays (the ceiling left at 8 would stop at 8)."""
    cost = DraftForwardCost(0.004)
    acceptance = [0.9] * BLOCK
    k = chosen(PricedBlockDrafter(BLOCK, cost), acceptance)
    assert k == best_length(acceptance, cost) and k > 8


def test_a_dear_block_forward_with_low_acceptance_decodes_plainly():
    """Acceptance 0.3 and a block forward dearer than half a verify pass:
    no draft pays it, so a plain pass; priced as free (the control), one
    draft would."""
    cost = DraftForwardCost(0.015)
    acceptance = [0.3] * BLOCK
    assert chosen(PricedBlockDrafter(BLOCK, cost), acceptance) == 0
    assert best_length(acceptance, cost) == 0
    free = PricedBlockDrafter(BLOCK, NO_DRAFT_FORWARD)
    assert chosen(free, acceptance) == best_length(acceptance, NO_DRAFT_FORWARD) > 0


def test_a_block_forward_growing_with_context_stops_paying_at_long_context():
    """A block forward of 2 ms + 3 ms per 1,000 context tokens, acceptance
    0.5: after 32 tokens drafting pays, after 8,000 the forward costs more
    than its drafts yield and the pass is plain. Without the growth (the
    control) it would still draft there."""
    cost = DraftForwardCost(0.002, 0.003)
    acceptance = [0.5] * BLOCK
    drafter = PricedBlockDrafter(BLOCK, cost)
    short = chosen(drafter, acceptance, context=32)
    assert short == best_length(acceptance, cost, 32) > 0
    assert chosen(drafter, acceptance, context=8000) == 0
    flat = PricedBlockDrafter(BLOCK, replace(cost, per_kilotoken=0.0))
    assert chosen(flat, acceptance, context=8000) > 0


class _Copier(HostDrafter):
    """A drafter declaring nothing: ``auto``'s default ceiling, no forward."""


def test_the_ceiling_is_the_drafters_and_the_profiles():
    """A drafter declaring none drafts up to 8 under ``auto``, a block
    drafter up to its block; neither past what the engine allows or the
    profile prices."""
    block = PricedBlockDrafter(BLOCK, NO_DRAFT_FORWARD)
    scheduler = Scheduler(None, 16, None, DEFAULT_TUNING)
    scheduler.price(FLAT, block)
    assert scheduler.acceptance(block).max_draft == BLOCK
    assert scheduler.acceptance(_Copier()).max_draft == 8
    short = Scheduler(None, 16, None, DEFAULT_TUNING)
    short.price(FLAT[:9], block)
    assert short.acceptance(block).max_draft == 8
    engine = Scheduler(None, 4, None, DEFAULT_TUNING)
    engine.price(FLAT, block)
    assert engine.acceptance(block).max_draft == 4


def test_the_fit_learns_the_draft_forward_and_its_growth_with_context():
    """Passes of one row timed at a verify forward plus, when drafting, a
    block forward of 3 ms + 2 ms per 1,000 context tokens the prior does not
    know (nothing declared): the fitted model prices drafting passes at long
    and short context within 5%, and a plain pass without the forward."""
    cost = PassCost(as_cost_profile(FLAT))
    contexts = [100, 2000, 4000, 8000]
    for i in range(400):
        k, context = i % 5, contexts[i % 4]
        seconds = FLAT[k] + ((0.003 + 0.002 * context / 1000) if k else 0.0)
        shape = PassShape(1, 1 + k, int(k > 0), 0, 0, context, int(k > 0))
        cost.observe(shape, seconds)
    for context in (100, 8000):
        drafting = PassShape(1, 5, 1, 0, 0, context, 1)
        want = FLAT[4] + 0.003 + 0.002 * context / 1000
        assert cost.cost(drafting) == pytest.approx(want, rel=0.05)
        plain = PassShape(1, 1, 0, 0, 0, context, 0)
        assert cost.cost(plain) == pytest.approx(FLAT[0], rel=0.05)
    assert cost.fitted()["per_draft_forward_kilotoken"] == pytest.approx(0.002, rel=0.1)
