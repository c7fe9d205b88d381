"""Memory stays flat over long, mostly-accepted generations.

MLX is lazy: an array that is written into every pass but never evaluated
keeps the graph of every earlier pass (and its buffers) alive. These tests
read MLX's active memory at two points of a long run and require it not to
grow beyond what the KV caches themselves add (target and MTP head).
"""

import pytest

import mlx_spec
from mlx_spec.demo import default_model_path
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.memory import memory_readings
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint

# Growth allowed between the two readings besides the KV caches: the pending
# MTP rows (at most 64 hidden states) and allocator slack. The defect this
# guards against grew by about 25 MB per 500 tokens on the tiny models.
SLACK_BYTES = 1 << 20


def memory_growth(model, tok, prompt, draft, marks, **kwargs):
    """Active-memory growth (bytes) between the first and last of ``marks``,
    less the KV caches' growth, and the run's stats."""
    readings, stats = memory_readings(model, tok, prompt, draft, marks, **kwargs)
    assert len(readings) == len(marks)
    return readings[-1] - readings[0], stats


@pytest.fixture(scope="module")
def cycle_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle")
    return {f: mlx_spec.load(write_cycle_checkpoint(root / f, f)) for f in FAMILIES}


def assert_flat_on_cycle(model, tok, draft, **kwargs):
    """800 mostly-accepted tokens (the hard case) without growth."""
    prompt, marks = cycle_order()[:40], (400, 1200)
    growth, stats = memory_growth(model, tok, prompt, draft, marks, **kwargs)
    assert stats.acceptance_rate > 0.5
    assert growth < SLACK_BYTES, f"grew {growth / 1e6:.1f} MB over 800 tokens"
    return stats


@pytest.mark.parametrize("rollback", ["store", "replay"])
@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
def test_memory_flat_on_every_family(cycle_models, family, draft, rollback):
    model, tok = cycle_models[family]
    assert_flat_on_cycle(model, tok, draft, num_draft_tokens=8, rollback=rollback)


@pytest.mark.parametrize("draft", ["ngram", "mtp+ngram"])
def test_memory_flat_on_demo_model(draft):
    model, tok = mlx_spec.load(default_model_path())
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    growth, stats = memory_growth(
        model, tok, prompt, draft, marks=(300, 1000), num_draft_tokens=8
    )
    assert stats.acceptance_rate > 0.5
    assert growth < SLACK_BYTES, f"grew {growth / 1e6:.1f} MB over 700 tokens"


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
def test_memory_flat_under_auto(cycle_models, draft):
    """``auto`` keeps a policy and the head's judgements in hindsight: they
    must not grow either."""
    model, tok = cycle_models["qwen3_next"]
    stats = assert_flat_on_cycle(model, tok, draft, num_draft_tokens="auto")
    assert stats.tokens_per_pass > 2  # it drafted


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
def test_memory_flat_with_a_windowed_head(cycle_models, draft, monkeypatch):
    """The head attending to its last 64 positions (of 1,200): the rows it
    no longer sees stay stored (they are the KV bytes subtracted), nothing
    else grows."""
    model, tok = cycle_models["qwen3_next"]
    monkeypatch.setattr(model.mtp_head, "attention_window", 64)
    assert_flat_on_cycle(model, tok, draft, num_draft_tokens=8)


@pytest.mark.parametrize("draft", ["mtp", "mtp+ngram"])
def test_memory_flat_under_logits_processors(cycle_models, draft):
    """Greedy under a repetition penalty: the head drafts its argmax after
    the penalty (the history converted once per length) and its rows are
    judged for ``auto``; neither keeps anything alive."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = cycle_models["qwen3_5_moe"]
    procs = make_logits_processors(repetition_penalty=1.1, repetition_context_size=16)
    stats = assert_flat_on_cycle(
        model, tok, draft, num_draft_tokens="auto", logits_processors=procs
    )
    assert stats.tokens_per_pass > 2  # it drafted
