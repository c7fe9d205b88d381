"""Counters and the phase clock of a speculative generation."""

import mlx_spec

PHASES = {"host", "draft", "verify", "sampling", "commit"}


def _generate(models, timing):
    model, tok = models["qwen3_next"]
    stats = mlx_spec.SpecStats()
    for _ in mlx_spec.stream_generate(
        model,
        tok,
        "a b a b a b a b",
        max_tokens=12,
        draft="ngram",
        num_draft_tokens=2,
        stats=stats,
        timing=timing,
    ):
        pass
    return stats


def test_timing_splits_each_pass_into_wall_and_host_cpu_time(models):
    stats = _generate(models, timing=True)
    assert set(stats.phases) == set(stats.phase_cpu) == PHASES
    for phase in PHASES:
        # one host thread cannot use more CPU than the time that passed
        assert 0.0 <= stats.phase_cpu[phase] <= stats.phases[phase] + 1e-3
    assert stats.verify_passes > 0 and stats.generated == 12


def test_no_phase_is_timed_unless_asked(models):
    stats = _generate(models, timing=False)
    assert stats.phases == {} and stats.phase_cpu == {}
    assert stats.verify_passes > 0
