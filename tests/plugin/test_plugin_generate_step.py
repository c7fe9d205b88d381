"""``mlx_spec.plugin`` and mlx-lm's ``generate_step``: a script driving the
token loop itself gets mlx-lm's greedy tokens and logprobs with the plugin
on while drafts are accepted, and mlx-lm's prompt cache; a call the plugin
does not cover gets mlx-lm's own generator; mlx-lm's own ``stream_generate``,
for the calls left to it, still runs mlx-lm's own ``generate_step``."""

import itertools
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import mlx_lm.cache_prompt  # noqa: F401 (a second module holding generate_step)
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlx_spec import plugin
from mlx_spec.mlx_lm_compat import generate_step as plain_generate_step
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.reference import OracleDrafter, cache_arrays, prompts

MAX_TOKENS = 24
# Prompts that repeat themselves: n-gram copies are drafted and, on a random
# model whose greedy output loops, accepted.
PROMPTS = [prompts("repetitive", n=20, seed=1), prompts("mixed", n=16, seed=2)]


@pytest.fixture(scope="module")
def loaded(checkpoint_dirs):
    """family -> (reference, served, tokenizer): two copies of one
    checkpoint loaded by ``mlx_lm.load``: the reference never meets the
    plugin, so it runs exactly mlx-lm's code, while the plugin speculates on
    the served one."""
    out = {}
    for f, path in checkpoint_dirs.items():
        (ref, _), (model, tok) = mlx_lm.load(str(path)), mlx_lm.load(str(path))
        out[f] = ref, model, tok
    return out


def mlx_lms_steps(model, prompt, **kwargs):
    """mlx-lm's own generate_step, called directly (never the plugin's)."""
    return list(
        plain_generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, **kwargs)
    )


def steps(model, prompt, **kwargs):
    """generate_step as a script calls it: looked up in mlx-lm's module."""
    generate_step = sys.modules["mlx_lm.generate"].generate_step
    return list(generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, **kwargs))


def tokens_of(pairs):
    return [t for t, _ in pairs]


def same_caches(ours, theirs):
    a, b = cache_arrays(ours), cache_arrays(theirs)
    return all(mx.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_generate_step_is_routed_in_every_module_holding_it_and_restored():
    holders = [
        name
        for name, m in list(sys.modules.items())
        if name.split(".")[0] == "mlx_lm"
        and getattr(m, "generate_step", None) is plain_generate_step
    ]
    assert {"mlx_lm.generate", "mlx_lm.cache_prompt"} <= set(holders)
    plugin.enable(num_draft_tokens=3)
    plugin.enable()  # enabling again keeps one set of originals
    for name in holders:
        assert sys.modules[name].generate_step is plugin.routed_generate_step, name
    plugin.disable()
    for name in holders:
        assert sys.modules[name].generate_step is plain_generate_step, name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_are_mlx_lms_while_drafts_are_accepted(
    loaded, family
):
    """An oracle drafter that errs a third of the time (a random model's
    output rarely repeats itself, so n-gram copies are seldom right): full,
    partial and no acceptance, mlx-lm's tokens and logprobs throughout."""
    ref, model, _ = loaded[family]
    for i, prompt in enumerate(PROMPTS):
        want = mlx_lms_steps(ref, prompt)
        oracle = OracleDrafter(prompt + tokens_of(want), error=0.3, seed=i)
        state = plugin.enable(draft=oracle, num_draft_tokens=4)
        got = steps(model, prompt)
        assert tokens_of(got) == tokens_of(want)
        # mlx-lm's types: the token a Python int, the logprobs one [V] row
        assert all(type(t) is int for t, _ in got)
        for (t, ours), (_, theirs) in zip(got, want):
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
            assert mx.argmax(ours).item() == t
            assert mx.allclose(ours, theirs, atol=1e-4).item()
        assert state.decisions == state.step_decisions == {"covered": 1}
        stats = state.last_stats
        assert 0 < stats.accepted < stats.drafted
        assert stats.verify_passes < MAX_TOKENS  # fewer passes than tokens
        assert state.total.accepted == stats.accepted  # added when it ended


@pytest.mark.parametrize("k", [3, "auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_plugins_own_drafter_gives_mlx_lms_greedy_tokens(loaded, family, k):
    ref, model, _ = loaded[family]
    want = [tokens_of(mlx_lms_steps(ref, p)) for p in PROMPTS]
    state = plugin.enable(num_draft_tokens=k)
    got, drafted = [], 0
    for p in PROMPTS:
        got.append(tokens_of(steps(model, p)))
        drafted += state.last_stats.drafted
    assert got == want
    assert state.step_decisions == {"covered": len(PROMPTS)}
    if k != "auto":  # auto's lengths follow measured timings: no draft promised
        assert drafted > 0  # n-gram copies of the repeated prompt were verified


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_cache_reused_across_calls_ends_as_mlx_lms(loaded, family):
    """Two calls continuing one cache, the second stopped early by its
    caller (closed after five tokens): mlx-lm's tokens, and its caches array
    for array, after each call."""
    ref, model, _ = loaded[family]

    def conversation(generate_step, model):
        cache = make_prompt_cache(model)
        first = list(
            generate_step(
                mx.array(PROMPTS[0]), model, max_tokens=MAX_TOKENS, prompt_cache=cache
            )
        )
        # copied out: the next call updates the cache's arrays in place
        snapshot = [np.array(a) for a in cache_arrays(cache)]
        second = generate_step(
            mx.array(PROMPTS[1]), model, max_tokens=MAX_TOKENS, prompt_cache=cache
        )
        early = list(itertools.islice(second, 5))
        second.close()
        return tokens_of(first), snapshot, tokens_of(early), cache

    want = conversation(plain_generate_step, ref)
    state = plugin.enable(num_draft_tokens=3)
    got = conversation(sys.modules["mlx_lm.generate"].generate_step, model)
    assert got[0] == want[0] and got[2] == want[2]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert same_caches(got[3], want[3])
    assert state.step_decisions == {"covered": 2}


@pytest.mark.parametrize(
    "options",
    [
        # a deterministic processor whose verification is not the greedy match
        dict(logits_processors=make_logits_processors(repetition_penalty=1.5)),
        dict(prefill_step_size=5),
    ],
    ids=["penalty", "prefill-step"],
)
def test_mlx_lms_options_are_honoured(loaded, options):
    ref, model, _ = loaded["qwen3_5"]
    prompt = PROMPTS[1]
    want = tokens_of(mlx_lms_steps(ref, prompt, **options))
    oracle = OracleDrafter(prompt + want, error=0.3, seed=2)
    state = plugin.enable(draft=oracle, num_draft_tokens=3)
    assert tokens_of(steps(model, prompt, **options)) == want
    stats = state.last_stats
    assert state.step_decisions == {"covered": 1}
    assert 0 < stats.accepted < stats.drafted


def test_an_uncovered_call_gets_mlx_lms_own_generator(loaded):
    ref, model, _ = loaded["qwen3_next"]
    want = mlx_lms_steps(ref, PROMPTS[0], max_kv_size=8)
    state = plugin.enable(num_draft_tokens=3)
    generate_step = sys.modules["mlx_lm.generate"].generate_step
    gen = generate_step(
        mx.array(PROMPTS[0]), model, max_tokens=MAX_TOKENS, max_kv_size=8
    )
    assert gen.gi_code is plain_generate_step.__code__  # mlx-lm's, unchanged
    assert tokens_of(gen) == tokens_of(want)
    # a list prompt: mlx-lm's generate_step indexes it as an mx.array; left
    # to mlx-lm, the caller gets mlx-lm's own error
    with pytest.raises(Exception) as plain_error:
        list(plain_generate_step(PROMPTS[0], ref, max_tokens=2))
    with pytest.raises(type(plain_error.value)):
        list(generate_step(PROMPTS[0], model, max_tokens=2))
    # what does not fit mlx-lm's signature raises at the call, as mlx-lm's
    with pytest.raises(TypeError, match="no_such_option"):
        generate_step(mx.array(PROMPTS[0]), model, no_such_option=1)
    assert (
        state.decisions
        == state.step_decisions
        == {
            "argument 'max_kv_size'": 1,
            "prompt: not an mx.array of token ids": 1,
            "arguments: not mlx-lm's signature": 1,
        }
    )
    assert state.last_stats is None


def test_a_prefill_runs_mlx_lms_code_as_cache_prompt_does(loaded):
    """``cache_prompt``'s call (``max_tokens=0``): nothing yielded, the
    cache filled as mlx-lm fills it."""
    ref, model, _ = loaded["qwen3_5_moe"]
    ref_cache, cache = make_prompt_cache(ref), make_prompt_cache(model)
    assert not list(
        plain_generate_step(
            mx.array(PROMPTS[0]), ref, max_tokens=0, prompt_cache=ref_cache
        )
    )
    state = plugin.enable()
    prefill = sys.modules["mlx_lm.cache_prompt"].generate_step
    assert not list(
        prefill(mx.array(PROMPTS[0]), model, max_tokens=0, prompt_cache=cache)
    )
    assert same_caches(cache, ref_cache)
    assert state.step_decisions == {"max_tokens=0": 1}


def test_an_uncovered_stream_generate_runs_mlx_lms_own_generate_step(loaded):
    """mlx-lm's stream_generate looks generate_step up in its module as it
    runs: for a call left to mlx-lm (max_kv_size) that must be mlx-lm's own,
    so no generate_step call is judged. Between two of its responses the
    caller's own generate_step call is the plugin's again."""
    ref, model, tok = loaded["qwen3_next"]
    want = [
        r.token
        for r in mlx_lm.stream_generate(
            ref, tok, mx.array(PROMPTS[1]), max_tokens=MAX_TOKENS, max_kv_size=8
        )
    ]
    want_steps = tokens_of(mlx_lms_steps(ref, PROMPTS[0]))
    state = plugin.enable(num_draft_tokens=3)
    responses = mlx_lm.stream_generate(
        model, tok, mx.array(PROMPTS[1]), max_tokens=MAX_TOKENS, max_kv_size=8
    )
    got = [next(responses).token]
    assert tokens_of(steps(model, PROMPTS[0])) == want_steps  # mid-stream
    got += [r.token for r in responses]
    assert got == want
    assert state.decisions == {"argument 'max_kv_size'": 1, "covered": 1}
    assert state.step_decisions == {"covered": 1}  # the caller's call only
    assert state.last_stats.drafted > 0
