"""Lossless greedy speculative decoding on every tiny family."""

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_spec
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
)


@pytest.mark.parametrize("kind", ["random", "repetitive", "mixed"])
@pytest.mark.slow
def test_ngram_greedy_identical_to_mlx_lm(models, family, kind):
    model, tok = models[family]
    prompt = prompts(kind)
    for max_tokens in (1, 7, 40):
        ref = reference_tokens(model, tok, prompt, max_tokens)
        for k in range(1, 9):
            out = spec_tokens(model, tok, prompt, max_tokens, num_draft_tokens=k)
            assert out == ref, (family, kind, max_tokens, k)


@pytest.mark.parametrize("error", [0.0, 0.3, 0.7])
@pytest.mark.slow
def test_partial_acceptance_identical(models, family, error):
    """Drafts that are right, partly right or mostly wrong: output never changes."""
    model, tok = models[family]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 48)
    for k in (1, 2, 3, 5, 8):
        stats = mlx_spec.SpecStats()
        drafter = OracleDrafter(prompt + ref, error=error, seed=k)
        out = spec_tokens(
            model, tok, prompt, 48, draft=drafter, num_draft_tokens=k, stats=stats
        )
        assert out == ref, (family, error, k)
        if error == 0.0:
            # Every draft right: each pass keeps all k drafts plus the bonus.
            assert stats.accepted == stats.drafted > 0
            assert stats.verify_passes == -(-48 // (k + 1))
        else:
            assert 0 < stats.accepted < stats.drafted


def test_replay_rollback_identical(models, family):
    model, tok = models[family]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 30)
    drafter = OracleDrafter(prompt + ref, error=0.4)
    out = spec_tokens(
        model, tok, prompt, 30, draft=drafter, num_draft_tokens=4, rollback="replay"
    )
    assert out == ref


def test_eos_inside_accepted_draft_ends_generation(models, family):
    model, tok = models[family]
    prompt = prompts("random", seed=3)
    ref = reference_tokens(model, tok, prompt, 30)
    eos = ref[10]  # declare a token of the continuation to be EOS
    tok.eos_token_ids = {eos}
    try:
        ref_eos = reference_tokens(model, tok, prompt, 30)
        drafter = OracleDrafter(prompt + ref, error=0.0)
        responses = list(
            mlx_spec.stream_generate(
                model, tok, mx.array(prompt), 30, draft=drafter, num_draft_tokens=6
            )
        )
    finally:
        tok.eos_token_ids = {mlx_spec.testing.checkpoints.EOS_TOKEN_ID}
    assert [r.token for r in responses] == ref_eos
    last = responses[-1]
    assert last.token == eos and last.finish_reason == "stop"
    assert last.from_draft  # EOS was an accepted draft token, not the bonus


def test_max_tokens_met_exactly(models):
    model, tok = models["qwen3_next"]
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, 64)
    for max_tokens in (1, 2, 5, 9, 17):
        drafter = OracleDrafter(prompt + ref)
        out = list(
            mlx_spec.stream_generate(
                model, tok, mx.array(prompt), max_tokens, draft=drafter
            )
        )
        assert [r.token for r in out] == ref[:max_tokens]
        assert out[-1].finish_reason == "length"
        assert out[-1].generation_tokens == max_tokens


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    family=st.sampled_from(FAMILIES),
    k=st.integers(0, 8),
    max_tokens=st.integers(1, 24),
)
@pytest.mark.slow
def test_property_ngram_identical(models, data, family, k, max_tokens):
    unit = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=6))
    noise = data.draw(st.lists(st.integers(0, 255), max_size=12))
    repeats = data.draw(st.integers(0, 4))
    prompt = noise + unit * repeats or unit
    model, tok = models[family]
    ref = reference_tokens(model, tok, prompt, max_tokens)
    assert spec_tokens(model, tok, prompt, max_tokens, num_draft_tokens=k) == ref


def test_logits_processors_and_prefill_chunks(models, family):
    """Repetition penalty sees the right history at every draft position;
    chunked prefill matches mlx-lm's chunking."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = models[family]
    prompt = prompts("repetitive", n=30)
    procs = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    kw = dict(logits_processors=procs, prefill_step_size=7)
    ref = reference_tokens(model, tok, prompt, 32, **kw)
    drafter = OracleDrafter(prompt + ref, error=0.3)
    out = spec_tokens(model, tok, prompt, 32, draft=drafter, num_draft_tokens=4, **kw)
    assert out == ref


@pytest.mark.parametrize("start", [10, 30])
def test_kv_quantization_switch_point_is_lossless(models, family, start):
    """With kv_bits the cache is quantized exactly where plain decoding does it
    (after the prompt when it is longer than ``start``, else mid-generation)."""
    model, tok = models[family]
    prompt = prompts("mixed")
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=start)
    ref = reference_tokens(model, tok, prompt, 30, **kw)
    drafter = OracleDrafter(prompt + ref, error=0.2)
    out = spec_tokens(model, tok, prompt, 30, draft=drafter, num_draft_tokens=5, **kw)
    assert out == ref
