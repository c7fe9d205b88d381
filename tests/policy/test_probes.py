"""Exploration at ``k = 0``: when ``auto`` drafting nothing drafts one token
anyway (a probe), how long it waits after one, and what spaces probes."""

import math

import pytest

from mlx_spec.core.draft_lengths import DraftLengths
from mlx_spec.core.policy_tuning import DEFAULT_TUNING as TUNING
from mlx_spec.testing.one_row import OneRow


def test_never_accepted_drafts_switch_speculation_off():
    policy = OneRow([1 + 0.05 * t for t in range(9)])
    choices = []
    for _ in range(64):
        k = policy.choose(8)
        choices.append(k)
        policy.update(k, 0)
    # After a few passes of evidence only the periodic one-draft probes remain.
    assert set(choices[16:]) <= {0, 1}
    assert choices[16:].count(1) <= len(choices[16:]) // 16 + 1


def test_failed_probes_back_off_and_an_accepted_one_resets_them():
    """Probes cost the drafter's catch-up: each rejected probe doubles the
    wait before the next, up to MAX_PROBE_EVERY; with this much evidence an
    accepted probe brings back the short interval."""
    p = OneRow([1 + 0.1 * t for t in range(9)])
    for _ in range(10):
        p.update(1, 0)
    probes = []
    for i in range(600):
        k = p.choose(8)
        if k:
            probes.append(i)
        p.update(k, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == TUNING.probe_every - 1 and gaps[:3] == [32, 64, 128]
    assert set(gaps[2:]) == {TUNING.max_probe_every}
    while not p.choose(8):  # the next probe is accepted
        p.update(0, 0)
    p.update(1, 1)
    assert p.probe_every == TUNING.probe_every


def test_accepted_probes_follow_each_other_until_there_is_evidence():
    """A drafter judged on its prior alone is re-probed at once after an
    accepted probe, but only until the first position has
    PROBE_STREAK_EVIDENCE passes of evidence: then the cost decides (here
    drafts cost too much to pay even when accepted) and spaces the probes."""
    p = OneRow([1 + 0.8 * t for t in range(9)])
    probes, k = [], None  # before a first choice, nothing is predicted
    for i in range(80):
        predicted, after_plain = p.next_is_plain(), k == 0
        k = p.choose(8)
        assert predicted == (k == 0) or not after_plain
        if k:
            probes.append(i)
        p.update(k, k)  # every draft accepted
    assert probes[0] == TUNING.probe_every - 1
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # then the probes' cost spaces them: 0.8 plain passes more each
    streak = gaps.index(math.ceil(0.8 / TUNING.probe_budget))
    assert 1 <= streak <= TUNING.probe_streak_evidence and set(gaps[:streak]) == {1}


@pytest.mark.parametrize("probe_ms, wait", [(30.0, 67), (10.8, TUNING.probe_every)])
def test_probes_are_spaced_by_what_they_cost(probe_ms, wait):
    """An accepted probe that took two plain passes more (the MTP head
    catching up on every deferred row at a long context) is followed by
    about 67 plain passes, so that probes cost PROBE_BUDGET (3%) of the time; a cheap
    one (the control: what the profile says a 2-token pass costs) by
    TUNING.probe_every."""
    p = OneRow([10e-3 + 0.8e-3 * t for t in range(9)])
    for _ in range(40):
        p.update(1, 0)  # drafts (nearly) never accepted: k = 0 but for probes
    for k in (0, 0, 0, 1):  # the first pass of each shape is a warm-up
        p.observe_pass(k, 10e-3 if k == 0 else probe_ms * 1e-3)
    plain = 0
    while not p.choose(8):
        plain += 1
    assert plain == TUNING.probe_every - 1
    p.update(1, 1)
    p.observe_pass(1, probe_ms * 1e-3)
    while not p.choose(8):
        plain += 1
        p.observe_pass(0, 10e-3)
    # the wait as priced by the fit, which takes a little of the probe's
    # cost as the forward's growth (so a plain pass is priced a bit dearer)
    assert plain - (TUNING.probe_every - 1) == pytest.approx(wait - 1, rel=0.1)


def test_a_streak_is_spaced_by_its_dearest_probe():
    """A streak's first probe resumed the drafter (200 ms against 20 ms
    plain passes), the next cost 51 ms: the wait after the streak is the
    first's (capped at max_probe_every), not the second's (52 passes); the
    control, a streak of two cheap probes, waits by their cost."""
    from mlx_spec.core.probe_schedule import ProbeSchedule

    def after_streak(first_ms: float, second_ms: float) -> int:
        probes = ProbeSchedule(TUNING)
        probes.probed(True, evidence=0.0)  # little evidence: a streak
        assert probes.every == 1
        probes.space(first_ms * 1e-3, 20e-3)
        probes.probed(True, evidence=TUNING.probe_streak_evidence)
        probes.space(second_ms * 1e-3, 20e-3)
        return probes.every

    budget = TUNING.probe_budget * 20e-3
    assert after_streak(200.0, 51.0) == TUNING.max_probe_every
    assert after_streak(51.0, 51.0) == math.ceil(31e-3 / budget) == 52
    assert after_streak(30.0, 51.0) == 52  # the second was the dearer


def test_the_first_probe_after_drafting_stops_waits_by_what_drafts_cost():
    """Passes drafting 2 tokens took 25 ms, plain ones 10 ms; then drafts
    stop being accepted. The first probe comes after more than twice
    TUNING.probe_every plain passes (a draft costs more than a plain pass; the
    control: passes as cheap as the profile says, 12 ms, TUNING.probe_every)."""
    waits = []
    for drafting_ms in (25.0, 12.0):
        p = OneRow([10e-3 + 1e-3 * t for t in range(9)])
        for k in (0, 0, 2, 2) * 10:
            p.update(k, k)
            p.observe_pass(k, 1e-3 * (drafting_ms if k else 10.0))
        k = p.choose(8)
        assert k >= 2
        for _ in range(100):
            p.update(k, 0)
            k = p.choose(8)
            if not k:
                break
        plain = 1
        while not p.choose(8) and plain < 1000:
            plain += 1
        waits.append(plain)
    assert waits[0] > 2 * TUNING.probe_every and waits[1] == TUNING.probe_every - 1


def test_a_draft_chosen_for_a_queued_pass_is_probed_next():
    """A pass that ran a forward queued ahead cannot draft what its choice
    chose: the group's next choice at k = 0 probes (its drafts are then
    verified and its acceptance learnt), where it would otherwise wait
    out its interval (the control: a schedule not told)."""
    from mlx_spec.core.draft_lengths import RowGroup
    from mlx_spec.core.pass_cost import PassCost
    from mlx_spec.core.cost_profile import as_cost_profile

    def next_choice(told: bool) -> int:
        lengths = DraftLengths(PassCost(as_cost_profile([1e-3] * 9)))
        probes = lengths.states[RowGroup.COPIES].probes
        assert probes.apply(0, 8) == 0  # one plain pass of the interval
        if told:
            lengths.dropped(RowGroup.COPIES)
        return probes.apply(0, 8)

    assert next_choice(told=True) == 1
    assert next_choice(told=False) == 0
