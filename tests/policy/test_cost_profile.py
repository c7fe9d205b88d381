"""The verify-cost profile heals itself: passes that keep running faster than
a profile taken on a busy machine lower it, for ``auto`` and on disk.

Pass timings are injected (a clock the test controls), so nothing here
depends on this machine's speed."""

import json
import random
import statistics

import pytest

import mlx_spec.core.verify_profile as verify_profile
from mlx_spec.core.cost_profile import CostProfile, implausible_lengths
from mlx_spec.testing.one_row import OneRow
from dataclasses import replace

from mlx_spec.core.policy_tuning import DEFAULT_TUNING as TUNING
from mlx_spec.cache_dir import CACHE_DIR_ENV

# A quiet machine's verify forward over T = 1..9 tokens (T = 9 at 2.7x), and
# one measured while it was busy: T = 1 at 2x, T = 9 at 3.7x that.
QUIET = [10e-3 * (1 + 1.7 * t / 8) for t in range(9)]
BUSY = [20e-3 * (1 + 2.7 * t / 8) for t in range(9)]
HOST = 0.3e-3  # what a pass takes beyond its forward
PASSES, SETTLED = 300, 200  # recovered within SETTLED passes


def drafted_per_pass(profile, passes=PASSES, acceptance=0.75, seed=0, tuning=TUNING):
    """Drafts per pass of ``auto`` on a workload accepting each draft with
    probability ``acceptance``, every pass timed as the quiet machine runs
    it; one entry per pass."""
    rng = random.Random(seed)
    policies = OneRow(profile, tuning=tuning)
    drafts = []
    for _ in range(passes):
        k = policies.choose(8, 32)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        policies.update(k, accepted)
        policies.observe_pass(k, QUIET[k] + HOST, 32)
        drafts.append(k)
    return drafts


def settled(drafts):
    return statistics.mean(drafts[SETTLED:])


def test_auto_recovers_its_drafting_from_a_busy_profile():
    quiet = settled(drafted_per_pass(CostProfile(list(QUIET))))
    written = []
    busy = CostProfile(list(BUSY), store=lambda short, long: written.append(short[:]))
    assert settled(drafted_per_pass(busy)) >= 0.9 * quiet > 2
    # Lowered towards what the passes took, and stored.
    assert busy.short[0] == pytest.approx(QUIET[0] + HOST)
    assert all(q <= c < b for q, c, b in zip(QUIET, busy.short, BUSY))
    assert written and written[-1] == busy.short


def test_without_healing_the_fit_alone_recovers_and_the_profile_stays_busy():
    """The control: the same passes, the profile never corrected. The online
    fit prices passes as they were timed, so this process drafts again (its
    coefficients are fitted under their bounds, not cut to them); the
    profile, and what the next process reads, stays busy."""
    never = replace(TUNING, heal_window=0)
    quiet = settled(drafted_per_pass(CostProfile(list(QUIET)), tuning=never))
    written = []
    busy = CostProfile(list(BUSY), store=lambda short, long: written.append(short))
    assert settled(drafted_per_pass(busy, tuning=never)) >= 0.9 * quiet > 2
    assert busy.short == BUSY and not written


def test_a_quiet_profile_is_not_moved_by_passes_that_take_longer():
    """Passes dearer than the profile (host work, stalls, head steps) are the
    online fit's to price."""
    profile = CostProfile(list(QUIET))
    rng = random.Random(1)
    for i in range(200):
        k = i % 4
        stall = 80e-3 if rng.random() < 0.1 else 0.0
        assert not profile.observe(k, 32, QUIET[k] * 1.3 + stall)
    assert profile.short == QUIET and profile.version == 0
    # One pass far faster than the rest (mis-timed) is not enough either.
    profile = CostProfile(list(QUIET))
    for seconds in [0.5 * QUIET[0]] + [0.95 * QUIET[0]] * (TUNING.heal_window - 1):
        assert not profile.observe(0, 32, seconds)
    assert profile.short == QUIET


def test_a_window_of_faster_passes_lowers_the_profile():
    """A window of passes that all beat the profile lowers it to their
    second fastest, and lengths never timed move with the nearest timed ones."""
    profile = CostProfile(list(BUSY), (8224, [2 * c for c in BUSY]))
    seen = [0.6, 0.55, 0.58, 0.7, 0.52, 0.6, 0.57, 0.59][: TUNING.heal_window]
    results = [profile.observe(0, 32, r * BUSY[0]) for r in seen]
    assert results == [False] * (len(seen) - 1) + [True]
    scale = sorted(seen)[1]
    assert profile.short == pytest.approx([scale * c for c in BUSY])
    assert profile.long[1] == pytest.approx([2 * scale * c for c in BUSY])
    # Then T = 5 at 0.8 of its new cost: lengths between interpolate.
    for _ in range(TUNING.heal_window):
        profile.observe(4, 32, 0.8 * profile.short[4])
    expected = [scale * c * (1 - 0.2 * min(t, 4) / 4) for t, c in enumerate(BUSY)]
    assert profile.short == pytest.approx(expected)


def test_a_corrected_profile_is_written_back_and_read_by_the_next_process(
    models, monkeypatch, tmp_path
):
    """A profile measured while the machine was busy (injected: the
    measurement returns BUSY), corrected by fast passes: the cache file holds
    the correction, and a new process starts from it."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(verify_profile, "_profiles", {})
    measured = []

    def measure(
        model, max_tokens, repeats=3, context=verify_profile.SHORT_CONTEXT, first=1
    ):
        measured.append(context)
        busy = BUSY[first - 1 : max_tokens]
        return list(busy) if context == 32 else [2 * c for c in busy]

    monkeypatch.setattr(verify_profile, "measure_verify_costs", measure)
    model, _ = models["qwen3_5"]
    policies = OneRow(verify_profile.cost_profile(model))
    for _ in range(TUNING.heal_window + 1):  # the first pass warms up
        policies.choose(0, 32)
        policies.observe_pass(0, QUIET[0], 32)
    healed = verify_profile.verify_cost_profile(model)
    assert healed[0] == pytest.approx(QUIET[0]) and healed[1] < BUSY[1]
    stored = json.loads(verify_profile.profile_cache_file().read_text())
    assert healed in stored.values()
    monkeypatch.setattr(verify_profile, "_profiles", {})  # a new process
    assert verify_profile.verify_cost_profile(model) == healed
    assert len(measured) == 2  # short and long, measured once


class PassClock:
    """A stand-in for the engine's ``time``: each pass takes ``step``
    seconds (its commit moves the clock on), drafting and the host's work
    nothing, whatever this machine's speed."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        return self.now

    def install(self, monkeypatch, engine):
        commit = engine.BatchDecoder.commit

        def timed_commit(batch, *args, **kwargs):
            self.now += self.step
            return commit(batch, *args, **kwargs)

        monkeypatch.setattr(engine, "time", self)
        monkeypatch.setattr(engine.BatchDecoder, "commit", timed_commit)


def generate_on_a_busy_profile(models, monkeypatch, tmp_path, tuning, runs=2):
    """Generations with ``auto`` on a model whose profile was measured on a
    busy machine (injected), every pass timed by a clock on which it takes 4 ms (a
    plain pass far under the profile's 20), a drafter accepted 0.6 of the
    time; checks each output is the target's. Returns the stored short
    profile and each run's accepted drafts."""
    import mlx_spec.core.batch as engine
    from mlx_spec.session import DecodeOptions, Session
    from mlx_spec.testing.reference import OracleDrafter, prompts, reference_tokens

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(verify_profile, "_profiles", {})

    def measure(
        model, max_tokens, repeats=3, context=verify_profile.SHORT_CONTEXT, first=1
    ):
        busy = BUSY[first - 1 : max_tokens]
        return list(busy) if context == 32 else [2 * c for c in busy]

    monkeypatch.setattr(verify_profile, "measure_verify_costs", measure)
    PassClock(4e-3).install(monkeypatch, engine)
    model, tok = models["qwen3_next"]
    prompt = prompts("mixed")
    sequence = prompt + reference_tokens(model, tok, prompt, 80)
    accepted = []
    for run in range(runs):
        drafter = OracleDrafter(sequence, error=0.4, seed=run)
        options = DecodeOptions(drafter, num_draft_tokens="auto", tuning=tuning)
        steps = list(Session(model, options).generate(prompt, max_tokens=80))
        assert [t for t, _, _ in steps] == sequence[len(prompt) :]
        accepted.append(sum(a for _, _, a in steps))
    stored = json.loads(verify_profile.profile_cache_file().read_text())
    short = verify_profile.verify_cost_profile(model)
    assert short in stored.values()
    return short, accepted


def test_the_decode_loop_heals_a_busy_profile(models, monkeypatch, tmp_path):
    """Through the decode loop: the passes beat the busy profile, so it is
    lowered and written back, and ``auto`` drafts where it paid. The
    control, healing off: the profile stays and ``auto`` hardly drafts.
    (The pass-cost fit's scale is pinned to the profile in both: within a
    generation it would learn cheaper forwards too, but not keep them.)"""
    pinned = replace(TUNING, scale_prior_weight=1e6)
    never = replace(pinned, heal_window=0)
    with monkeypatch.context() as m:
        kept, control = generate_on_a_busy_profile(models, m, tmp_path / "off", never)
    assert kept == BUSY
    healed, accepted = generate_on_a_busy_profile(models, monkeypatch, tmp_path, pinned)
    assert healed[0] < 0.5 * BUSY[0] and all(h < b for h, b in zip(healed, BUSY))
    assert min(accepted) >= 3 * max(control) + 10, (accepted, control)


# Measured while the machine was busy from T = 3 on: flat at three times the
# quiet T = 2, which a one-token step and a two-token one would beat.
FLAT = QUIET[:2] + [3 * QUIET[1]] * 7


def test_a_profile_of_an_implausible_shape_is_measured_again_once():
    """A forward over T tokens dearer than two shorter ones covering them is
    a busy measurement: measured again (short and long), kept and stored; a
    profile of a plausible shape is not, nor is one checked before; with the
    ratio at infinity (the control) nothing is."""
    assert implausible_lengths(FLAT, 1.2) == [2, 3]  # T = 3 and 4
    assert implausible_lengths(QUIET, 1.2) == [] == implausible_lengths(BUSY, 1.2)
    measured, written = [], []

    def measure(context):
        measured.append(context)
        return list(QUIET) if context == 32 else [2 * c for c in QUIET]

    def store(short, long):
        written.append((short[:], long[1][:]))

    profile = CostProfile(list(FLAT), (8224, [2 * c for c in FLAT]), store)
    assert profile.check_shape(measure, TUNING) and measured == [32, 8224]
    assert profile.short == QUIET and profile.long[1] == [2 * c for c in QUIET]
    assert written == [(QUIET, [2 * c for c in QUIET])] and profile.version == 1
    assert not profile.check_shape(measure, TUNING) and len(measured) == 2
    plausible = CostProfile(list(BUSY), store=store)
    assert not plausible.check_shape(measure, TUNING) and plausible.short == BUSY
    never = replace(TUNING, implausible_ratio=float("inf"))
    control = CostProfile(list(FLAT), store=store)
    assert not control.check_shape(measure, never) and control.short == FLAT
    assert len(measured) == 2 and len(written) == 1


def test_auto_tries_the_lengths_an_implausible_stored_profile_overpriced(
    models, monkeypatch, tmp_path
):
    """Through the engine's cost model: a stored profile flat from T = 3 on
    (injected as the first measurement) is measured again when ``auto``
    first prices passes, and ``auto`` then drafts two tokens and more on a
    workload accepting 3 drafts in 4. The control (the check off): the
    stored profile stays, and ``auto`` never drafts more than one token, so
    no pass ever times the lengths that would heal it."""
    from mlx_spec.core.policy import pass_cost_model

    def drafts(tuning, where):
        monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / where))
        monkeypatch.setattr(verify_profile, "_profiles", {})
        measures = iter([FLAT, [2 * c for c in FLAT]])  # then the quiet machine

        def measure(model, max_tokens, repeats=3, context=32, first=1):
            quiet = QUIET if context == 32 else [2 * c for c in QUIET]
            costs = next(measures, None) or quiet
            return list(costs[first - 1 : max_tokens])

        monkeypatch.setattr(verify_profile, "measure_verify_costs", measure)
        model, _ = models["qwen3_next"]
        cost = pass_cost_model(model, tuning=tuning)
        return cost.profile.short, drafted_per_pass(cost, tuning=tuning)

    pinned = replace(TUNING, scale_prior_weight=1e6)  # the profile's shape, as fitted
    kept, control = drafts(replace(pinned, implausible_ratio=float("inf")), "off")
    assert kept == FLAT and max(control) <= 1
    healed, tried = drafts(pinned, "on")
    assert healed == QUIET and settled(tried) > 2
