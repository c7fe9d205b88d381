"""The verify-cost profile behind ``auto``: measured once, kept on disk."""

import time

import pytest

import mlx_spec
import mlx_spec.core.verify_profile as profile
from mlx_spec.core.verify_profile import verify_cost_profile
from mlx_spec.testing.reference import prompts
from mlx_spec.cache_dir import CACHE_DIR_ENV


def test_verify_cost_profile_is_cached_and_positive(models):
    model, _ = models["qwen3_5_moe"]
    costs = verify_cost_profile(model, 4, repeats=1)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert verify_cost_profile(model, 4) == costs


@pytest.fixture
def fresh_profiles(monkeypatch, tmp_path):
    """An empty profile cache on disk and in the process; counts measurements."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(profile, "_profiles", {})
    measured = []
    real = profile.measure_verify_costs

    def measure(model, max_tokens, repeats=3, context=profile.SHORT_CONTEXT, first=1):
        measured.append(max_tokens)
        return real(model, max_tokens, 1, context, first)

    monkeypatch.setattr(profile, "measure_verify_costs", measure)
    return measured


def test_profile_is_kept_on_disk_per_machine_mlx_and_model(
    models, fresh_profiles, monkeypatch
):
    model, other = models["qwen3_5"][0], models["qwen3_next"][0]
    costs = verify_cost_profile(model, 3)
    assert profile.profile_cache_file().exists() and fresh_profiles == [3]
    long = verify_cost_profile(model, 3, context=profile.PREFILLED_LONG_CONTEXT)
    assert fresh_profiles == [3, 3]  # each context is measured once
    monkeypatch.setattr(profile, "_profiles", {})  # a new process
    assert verify_cost_profile(model, 3) == costs and fresh_profiles == [3, 3]
    long_again = verify_cost_profile(model, 3, context=profile.PREFILLED_LONG_CONTEXT)
    assert long_again == long and fresh_profiles == [3, 3]
    fresh_profiles.clear()
    verify_cost_profile(other, 3)  # another model: measured
    assert fresh_profiles == [3]
    monkeypatch.setattr(profile, "_profiles", {})
    monkeypatch.setattr(profile.mx, "__version__", "0.0.0-other")
    verify_cost_profile(model, 3)  # another MLX version: measured again
    assert fresh_profiles == [3, 3]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"x": 1}', ""])
def test_broken_profile_cache_is_measured_again(
    models, fresh_profiles, monkeypatch, content
):
    model, _ = models["qwen3_5"]
    profile.profile_cache_file().write_text(content)
    assert len(verify_cost_profile(model, 2)) == 2 and fresh_profiles == [2]
    monkeypatch.setattr(profile, "_profiles", {})
    verify_cost_profile(model, 2)  # the rewritten file is good
    assert fresh_profiles == [2]


def test_unwritable_profile_cache_only_costs_a_measurement(
    models, fresh_profiles, monkeypatch, tmp_path
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocker / "sub"))
    model, _ = models["qwen3_5"]
    assert len(verify_cost_profile(model, 2)) == 2 and fresh_profiles == [2]


def test_profile_time_is_not_prompt_time(models, fresh_profiles, monkeypatch):
    """The one-off profile is reported apart from prompt processing: a
    profile that takes 1,000 s (on a fake clock) leaves the prompt rate alone."""
    model, tok = models["qwen3_5"]
    real_clock, skew = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + skew[0])
    measure = profile.measure_verify_costs

    def slow(*args, **kwargs):
        skew[0] += 1000.0
        return measure(*args, **kwargs)

    monkeypatch.setattr(profile, "measure_verify_costs", slow)
    stats = mlx_spec.SpecStats()
    prompt = prompts("mixed")
    for r in mlx_spec.stream_generate(model, tok, prompt, 4, stats=stats):
        pass
    assert stats.profile_seconds >= 1000.0
    assert r.prompt_tps > len(prompt) / 100.0


def test_head_step_cost_is_measured_once_and_kept_on_disk(
    models, plain_models, fresh_profiles, monkeypatch
):
    model = models["qwen3_next"][0]
    measured, real = [], profile._measure_head_step
    monkeypatch.setattr(
        profile,
        "_measure_head_step",
        lambda head, r: measured.append(r) or real(head, 1),
    )
    cost = profile.head_step_cost(model)
    assert 0 < cost < 1 and len(measured) == 1
    monkeypatch.setattr(profile, "_profiles", {})  # a new process: from disk
    assert profile.head_step_cost(model) == cost and len(measured) == 1
    assert profile.head_step_cost(plain_models["qwen3_next"][0]) is None  # no head


class _Counting:
    """A model stand-in that counts the tokens it is run on."""

    def __init__(self, model):
        self.model, self.tokens = model, 0
        self.layers, self.make_cache = model.layers, model.make_cache

    def __call__(self, inputs, cache=None):
        self.tokens += inputs.shape[1]
        return self.model(inputs, cache=cache)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_long_scratch_context_is_written_not_prefilled(models, family):
    """The long profile's context: a few tokens through the model, the rest
    random key/value rows; every attention cache holds the whole context."""
    model = _Counting(models[family][0])
    cache = profile._scratch_cache(model, 64, 300)
    assert model.tokens == profile.SEED_TOKENS
    kv = [c for c in cache if isinstance(c, profile.KVCache)]
    assert kv and all(c.offset == 300 for c in kv)
    assert all(c.keys.shape[2] >= 300 and c.values.shape[2] >= 300 for c in kv)


class _OtherKV(profile.KVCache):  # not a plain KVCache: filled by the model
    pass


@pytest.fixture
def other_cache_kinds(monkeypatch):
    """Call it and models' prompt caches hold _OtherKV where they held a
    plain KVCache."""
    real = profile.make_prompt_cache

    def other_kinds(m):
        return [_OtherKV() if type(c) is profile.KVCache else c for c in real(m)]

    return lambda: monkeypatch.setattr(profile, "make_prompt_cache", other_kinds)


def test_caches_of_other_kinds_are_prefilled_whole(models, other_cache_kinds):
    other_cache_kinds()
    model = _Counting(models["qwen3_next"][0])
    cache = profile._scratch_cache(model, 64, 300)
    assert model.tokens == 300
    assert all(c.offset == 300 for c in cache if isinstance(c, _OtherKV))


def test_the_long_profile_is_far_from_the_short_one_where_it_is_cheap(
    models, fresh_profiles, other_cache_kinds
):
    """A written scratch cache is profiled at LONG_CONTEXT (its growth with
    context then stands out of the noise); one that must be prefilled, at the
    shorter PREFILLED_LONG_CONTEXT."""
    model = models["qwen3_next"][0]
    short, (context, long) = profile.verify_cost_profiles(model)
    assert context == profile.LONG_CONTEXT > 4 * profile.PREFILLED_LONG_CONTEXT
    assert len(short) == len(long) and fresh_profiles == [len(short)] * 2
    other_cache_kinds()
    assert profile.long_context(model) == profile.PREFILLED_LONG_CONTEXT


def test_a_stored_profile_is_extended_by_the_lengths_after_it(
    models, monkeypatch, tmp_path
):
    """A profile stored for T = 1..9 (by an earlier run) is read, and a
    drafter whose ``auto`` drafts go deeper asks T = 1..16: only T = 10..16
    are measured (both contexts), appended to the stored lengths and kept.
    A process already holding the 9 lengths extends its profile in place
    (the same object, a new version: fits over it start again), reading the
    16 stored."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(profile, "_profiles", {})
    calls = []

    def measure(model, max_tokens, repeats=3, context=profile.SHORT_CONTEXT, first=1):
        calls.append((context, first, max_tokens))
        per_token = 0.001 if context == profile.SHORT_CONTEXT else 0.002
        return [per_token * T for T in range(first, max_tokens + 1)]

    monkeypatch.setattr(profile, "measure_verify_costs", measure)
    model = models["qwen3_5"][0]
    long = profile.long_context(model)
    want = [0.001 * T for T in range(1, 17)]
    assert len(profile.cost_profile(model)) == 9
    assert sorted(calls) == [(profile.SHORT_CONTEXT, 1, 9), (long, 1, 9)]
    monkeypatch.setattr(profile, "_profiles", {})  # a new process
    calls.clear()
    deeper = profile.cost_profile(model, tokens=16)
    assert sorted(calls) == [(profile.SHORT_CONTEXT, 10, 16), (long, 10, 16)]
    assert deeper.short == pytest.approx(want)
    assert deeper.long[1] == pytest.approx([2 * c for c in want])
    monkeypatch.setattr(profile, "_profiles", {})  # another process
    calls.clear()
    held = profile.cost_profile(model)
    version = held.version
    assert len(held) == 9 and calls == []
    assert profile.cost_profile(model, tokens=16) is held
    assert len(held) == 16 and held.version > version and calls == []
    assert held.short == pytest.approx(want)
    assert held.verify_cost(15, long) == pytest.approx(0.032)
