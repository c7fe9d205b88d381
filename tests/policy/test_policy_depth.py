"""Depth probes of ``auto``: a deeper draft position whose old evidence is
poor is tested again while one more draft looks nearly as good."""

from dataclasses import replace

from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.testing.one_row import OneRow


def _passes_with_a_second_position(policy, second_accepted: bool, passes: int):
    """Choices over ``passes`` passes of a drafter whose first draft is
    accepted three passes in four and whose second always is (or never),
    after six early passes that rejected the second draft."""
    for _ in range(6):
        policy.update(2, 1)
    choices = []
    for i in range(passes):
        k = policy.choose(4)
        first = k > 0 and i % 4 != 3
        policy.update(k, 0 if not first else (k if second_accepted else 1))
        choices.append(k)
    return choices


def test_a_second_draft_that_became_reliable_is_found():
    """The second position's early evidence says no; its estimate then only
    drifts back towards the first position's (0.75), at which one draft
    looks best (1.75 tokens per 1.6 against 2.31 per 2.2). Depth probes test
    the second draft again while a longer draft looks nearly as good, so the
    policy learns that it is now always accepted (2.5 tokens per 2.2)."""
    costs = [1 + 0.6 * t for t in range(9)]
    choices = _passes_with_a_second_position(OneRow(costs), True, 200)
    assert sum(k >= 2 for k in choices[-50:]) >= 40
    shallow = replace(DEFAULT_TUNING, depth_evidence=0.0)  # no depth probes
    policy = OneRow(costs, tuning=shallow)
    choices = _passes_with_a_second_position(policy, True, 200)
    assert max(choices[-150:]) == 1


def test_depth_probes_of_a_useless_second_draft_are_rare():
    costs = [1 + 0.6 * t for t in range(9)]
    choices = _passes_with_a_second_position(OneRow(costs), False, 200)
    assert set(choices[-100:]) <= {1, 2}
    assert sum(k == 2 for k in choices[-100:]) <= 8
