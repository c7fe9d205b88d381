"""The queue of plain passes a draft breaks: its edges timed, learnt and priced."""

import random
from dataclasses import replace

import pytest

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.cost_profile import as_cost_profile
from mlx_spec.core.draft_lengths import Candidate, DraftLengths, PassRequest, RowGroup
from mlx_spec.core.pass_cost import FEATURES, PassCost, PassShape
from mlx_spec.core.policy_tuning import DEFAULT_TUNING as TUNING
from mlx_spec.testing.reference import (
    OracleDrafter,
    fed_decoder,
    prompts,
    reference_tokens,
)

# One sequence's verify forward: 5 ms plus 1 ms per token (T = 1..9).
PROFILE = [0.005 + 0.001 * T for T in range(1, 10)]
EDGE = 0.002  # what an edge of the queue costs a pass: a break costs two


def _profile_seconds(shape: PassShape) -> float:
    """A pass costing its profiled forward and its edges, nothing else."""
    return PROFILE[shape.rows * shape.T - 1] + EDGE * shape.queue_edges


def _fitted(tuning=TUNING) -> PassCost:
    """A cost model fitted on passes of one row priced by
    :func:`_profile_seconds`: queued plain passes, both edges of the queue
    (ending it, restarting it) and drafting passes of every length."""
    cost = PassCost(as_cost_profile(PROFILE), tuning=tuning)
    shapes = [PassShape(queue_edges=e) for e in (0, 0, 0, 1)]
    shapes += [PassShape(T=1 + k, drafting=1) for k in range(1, 9)]
    for _ in range(6):
        for shape in shapes:
            cost.observe(shape, _profile_seconds(shape))
    return cost


def test_the_fit_learns_what_an_edge_of_the_queue_costs():
    """Random one-row passes, some at an edge of the queue: the fit recovers
    the edge's cost, so a draft breaking the queue (two edges) is priced at
    a plain pass's cost plus two edges."""
    rng = random.Random(5)
    cost = PassCost(as_cost_profile(PROFILE))
    for _ in range(300):
        T = rng.randrange(1, 6)
        shape = PassShape(T=T, drafting=int(T > 1), queue_edges=rng.randrange(2))
        cost.observe(shape, _profile_seconds(shape))
    assert cost.fitted()["per_queue_edge"] == pytest.approx(EDGE, rel=0.05)
    broken = cost.cost(PassShape(T=3, drafting=1, queue_edges=2))
    assert broken == pytest.approx(PROFILE[2] + 2 * EDGE, rel=0.05)


def test_an_end_and_a_restart_together_price_one_break():
    """A pass ending the queue took a queued pass's time and the one
    restarting it that plus ``2 * EDGE`` (its graph built with the device
    idle): each edge is fitted at half of it, a break at the whole."""
    cost = PassCost(as_cost_profile(PROFILE))
    plain = PROFILE[0]
    for _ in range(10):
        for edges, seconds in (
            (0, plain),
            (0, plain),
            (1, plain),
            (1, plain + 2 * EDGE),
        ):
            cost.observe(PassShape(queue_edges=edges), seconds)
    assert cost.cost(PassShape(queue_edges=2)) == pytest.approx(
        plain + 2 * EDGE, rel=0.05
    )


def test_edges_of_the_queue_do_not_heal_the_profile():
    """A pass ending the queue ran a forward partly computed before its clock
    started: however fast, it says nothing of the profile (whole forwards
    that fast do heal it)."""
    for edges, heals in ((1, False), (0, True)):
        cost = PassCost(as_cost_profile(PROFILE))
        for _ in range(12):
            cost.observe(PassShape(queue_edges=edges), 0.3 * PROFILE[0])
        assert (cost.profile.verify_cost(0, 32) < PROFILE[0]) is heals


def _choose(cost: PassCost, acceptance: float, queue_edges: int) -> int:
    """One ``auto`` row's length (ample evidence, probes out of the way)."""
    lengths = DraftLengths(cost)
    for state in lengths.states.values():
        state.probes.every = 10**9
    row = Candidate(RowGroup.COPIES, [acceptance] * 8, [100.0] * 8, 8)
    request = PassRequest(rows=1, candidates=(row,), queue_edges=queue_edges)
    return lengths.choose(request)[RowGroup.COPIES]


def test_a_marginal_draft_does_not_pay_for_breaking_the_queue():
    """Acceptance 0.3: one draft yields 1.3 tokens for 7 ms against a plain
    pass's 1 for 6 ms, so it pays after a draft (no queue runs), not while
    plain passes run queued (the break adds 4 ms). At acceptance 0.95 the
    drafts pay for the break too."""
    tuning = replace(TUNING, depth_evidence=0.0, plain_probe_weight=0.0)
    cost = _fitted(tuning)
    assert cost.fitted()["per_queue_edge"] == pytest.approx(EDGE, rel=0.1)
    assert _choose(cost, 0.3, queue_edges=0) > 0
    assert _choose(cost, 0.3, queue_edges=2) == 0
    assert _choose(cost, 0.95, queue_edges=2) > 0


def _engine(model, tok, drafter_of, max_tokens: int):
    """A batch of one ``auto`` row whose drafts are never accepted, so it
    decodes in queued plain passes broken by probes; the row's drafter is
    built from the reference continuation by ``drafter_of``."""
    prompt = prompts("mixed")
    sequence = prompt + reference_tokens(model, tok, prompt, max_tokens)
    batch = BatchDecoder(model, n_slots=1, max_draft=4)
    decoder = fed_decoder(model, prompt, drafter_of(sequence), 4)
    costs = [1e-3 * (1 + 0.5 * t) for t in range(9)]
    id = batch.add(decoder, RowOptions(max_tokens, verify_costs=costs))
    return batch, id, sequence[len(prompt) :]


def test_the_engine_times_the_edges_of_its_queue(models):
    """Passes that end or restart the queue are counted by the fit (as edges),
    and the tokens are plain decoding's."""
    model, tok = models["qwen3_next"]
    never = lambda sequence: OracleDrafter(sequence, error=1.0)  # noqa: E731
    batch, id, expected = _engine(model, tok, never, 60)
    tokens, queued = [], []
    while batch.active:
        queued.append(batch.queued)
        tokens += batch.step()[id][0]
    assert tokens == expected
    assert True in queued and False in queued  # queued stretches, broken
    edge = FEATURES.index("per_queue_edge")
    assert batch.cost._A[edge][edge] > 0  # edge passes were fitted


def test_a_break_is_priced_only_while_the_pass_runs_queued(models, monkeypatch):
    """The choice is told a draft would break the queue (two edges) exactly
    when the pass it chooses for runs a forward queued ahead."""
    model, tok = models["qwen3_next"]
    never = lambda sequence: OracleDrafter(sequence, error=1.0)  # noqa: E731
    batch, id, expected = _engine(model, tok, never, 40)
    told, choose = [], DraftLengths.choose

    def spy_choose(self, request):
        told.append(request.queue_edges)
        return choose(self, request)

    monkeypatch.setattr(DraftLengths, "choose", spy_choose)
    queued, tokens = [], []
    while batch.active:
        queued.append(batch.queued)
        tokens += batch.step()[id][0]
    assert tokens == expected
    assert told == [2 if q else 0 for q in queued]
    assert 2 in told and 0 in told
