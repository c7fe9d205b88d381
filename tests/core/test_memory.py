"""Memory stays flat over long, mostly-accepted generations.

MLX is lazy: an array that is written into every pass but never evaluated
keeps the graph of every earlier pass (and its buffers) alive. These tests
read MLX's active memory every 100 tokens of a long run, less what the KV
caches hold (target and MTP head), and bound its growth per token (a
robust slope of the readings, ``growth_per_token``): at most plain mlx-lm
decoding's own slope on the same model, measured in the same session, plus
``PER_TOKEN_LIMIT``.
A one-off step of the allocator (up to 0.5 MB seen) barely moves the slope;
a leak of 256 bytes per token moves it by 256, which
``test_an_injected_leak_is_caught`` shows.
"""

import gc

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.demo import default_model_path
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.memory import (
    PER_TOKEN_LIMIT,
    growth_per_token,
    memory_readings,
)
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint

MARKS = tuple(range(400, 1201, 100))  # 800 tokens, after the first KV blocks
CYCLE_PROMPT = cycle_order()[:40]


def memory_slope(model, tok, prompt, draft, marks=MARKS, **kwargs):
    """Active-memory growth per token over ``marks``, less the KV caches',
    and the run's stats."""
    readings, stats = memory_readings(model, tok, prompt, draft, marks, **kwargs)
    assert len(readings) == len(marks)
    return growth_per_token(marks, readings), stats


@pytest.fixture(scope="module")
def cycle_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle")
    return {f: mlx_spec.load(write_cycle_checkpoint(root / f, f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def plain_slope(cycle_models):
    """family -> plain mlx-lm decoding's growth per token on the cycle run
    (measured once per family, when first needed)."""
    measured = {}

    def slope(family):
        if family not in measured:
            model, tok = cycle_models[family]
            measured[family] = memory_slope(model, tok, CYCLE_PROMPT, "none")[0]
        return measured[family]

    return slope


def assert_flat_on_cycle(model, tok, draft, baseline, **kwargs):
    """800 mostly-accepted tokens (the hard case) without growth beyond
    plain decoding's ``baseline`` (bytes per token)."""
    slope, stats = memory_slope(model, tok, CYCLE_PROMPT, draft, **kwargs)
    assert stats.acceptance_rate > 0.5
    assert (
        slope < baseline + PER_TOKEN_LIMIT
    ), f"grew {slope:.0f} B/token (plain decoding: {baseline:.0f})"
    return stats


@pytest.mark.slow
def test_an_injected_leak_is_caught(cycle_models, plain_slope, monkeypatch):
    """Control: the decoder made to keep 256 bytes per emitted token (an
    evaluated array, as a retained per-token state would be) fails the bound,
    with the drafter whose own measured slope is the lowest (mtp+ngram)."""
    kept = []
    advance = SpeculativeDecoder.advance

    def leaking_advance(self, drafted, n, tokens, *rest):
        kept.append(mx.zeros((64 * len(tokens),), mx.float32))  # 256 B/token
        mx.eval(kept[-1])
        return advance(self, drafted, n, tokens, *rest)

    monkeypatch.setattr(SpeculativeDecoder, "advance", leaking_advance)
    model, tok = cycle_models["qwen3_next"]
    for draft in ("mtp+ngram", "ngram"):
        slope, _ = memory_slope(model, tok, CYCLE_PROMPT, draft, num_draft_tokens=8)
        assert slope > plain_slope("qwen3_next") + PER_TOKEN_LIMIT, (draft, slope)


@pytest.mark.parametrize("rollback", ["store", "replay"])
@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
@pytest.mark.slow
def test_memory_flat_on_every_family(
    cycle_models, plain_slope, family, draft, rollback
):
    model, tok = cycle_models[family]
    baseline = plain_slope(family)
    assert_flat_on_cycle(
        model, tok, draft, baseline, num_draft_tokens=8, rollback=rollback
    )


@pytest.fixture(scope="module")
def demo_run():
    """The demo model, its code prompt, the marks of its 600-token window and
    plain decoding's growth per token there."""
    model, tok = mlx_spec.load(default_model_path())
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    marks = tuple(range(400, 1001, 100))
    return model, tok, prompt, marks, memory_slope(model, tok, prompt, "none", marks)[0]


@pytest.mark.parametrize("draft", ["ngram", "mtp+ngram"])
@pytest.mark.slow
def test_memory_flat_on_demo_model(demo_run, draft):
    model, tok, prompt, marks, baseline = demo_run
    slope, stats = memory_slope(model, tok, prompt, draft, marks, num_draft_tokens=8)
    assert stats.acceptance_rate > 0.5
    assert slope < baseline + PER_TOKEN_LIMIT, (slope, baseline)


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
@pytest.mark.slow
def test_memory_flat_under_auto(cycle_models, plain_slope, draft):
    """``auto`` keeps a policy and the head's judgements in hindsight: they
    must not grow either."""
    model, tok = cycle_models["qwen3_next"]
    baseline = plain_slope("qwen3_next")
    stats = assert_flat_on_cycle(model, tok, draft, baseline, num_draft_tokens="auto")
    assert stats.tokens_per_pass > 2  # it drafted


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
@pytest.mark.slow
def test_memory_flat_with_a_windowed_head(
    cycle_models, plain_slope, draft, monkeypatch
):
    """The head attending to its last 64 positions (of 1,200): the rows it
    no longer sees stay stored (they are the KV bytes subtracted), nothing
    else grows."""
    model, tok = cycle_models["qwen3_next"]
    baseline = plain_slope("qwen3_next")
    monkeypatch.setattr(model.mtp_head, "attention_window", 64)
    assert_flat_on_cycle(model, tok, draft, baseline, num_draft_tokens=8)


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
@pytest.mark.slow
def test_memory_flat_under_logits_processors(cycle_models, plain_slope, draft):
    """Greedy under a repetition penalty: the head drafts its argmax after
    the penalty (the history converted once per length) and its rows are
    judged for ``auto``; neither keeps anything alive."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = cycle_models["qwen3_5_moe"]
    procs = make_logits_processors(repetition_penalty=1.1, repetition_context_size=16)
    baseline = plain_slope("qwen3_5_moe")
    stats = assert_flat_on_cycle(
        model, tok, draft, baseline, num_draft_tokens="auto", logits_processors=procs
    )
    assert stats.tokens_per_pass > 2  # it drafted


def _left_to_the_collector(run) -> list:
    """What ``run()`` left that only the garbage collector frees, of
    mlx-spec's objects and MLX arrays: objects in reference cycles (kept
    until it runs, with whatever arrays they hold)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if isinstance(o, mx.array) or type(o).__module__.startswith("mlx_spec")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
def test_a_finished_generation_frees_its_caches_at_once(cycle_models, family, draft):
    """A generation's engine, caches and drafter are freed when it ends, not
    at the collector's next run: a cycle through them (the engine and its
    queue-ahead holding each other) kept a generation's caches until then,
    so the peak memory of back-to-back requests grew with each."""
    model, tok = cycle_models[family]

    def generate():
        for _ in mlx_spec.stream_generate(
            model, tok, CYCLE_PROMPT, max_tokens=24, draft=draft
        ):
            pass

    generate()  # what the first run builds once (profiles, compiled calls)
    assert _left_to_the_collector(generate) == []
