"""Memory stays flat over long, mostly-accepted generations.

MLX is lazy: an array that is written into every pass but never evaluated
keeps the graph of every earlier pass (and its buffers) alive. These tests
read MLX's active memory at two points of a long run and require it not to
grow beyond what the KV caches themselves add (target and MTP head).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.mtp.testing import cycle_order, write_cycle_checkpoint
from mlx_spec.tiny_checkpoint import FAMILIES

# Growth allowed between the two readings besides the KV caches: the pending
# MTP rows (at most 64 hidden states) and allocator slack. The defect this
# guards against grew by about 25 MB per 500 tokens on the tiny models.
SLACK_BYTES = 1 << 20


def _kv_bytes(caches) -> int:
    """Bytes of the attention caches' key/value buffers (they grow by design)."""
    total = 0
    for c in caches:
        for name in ("keys", "values"):
            for a in _arrays(getattr(c, name, None)):
                total += a.nbytes
    return total


def _arrays(value):
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


def _drafter_caches(drafter):
    head = getattr(drafter, "mtp", drafter)  # mtp+ngram holds an MTP drafter
    return list(getattr(head, "cache", None) or [])


def memory_growth(model, tok, prompt, draft, marks, **kwargs):
    """Active-memory growth (bytes) between the ``marks`` token counts, less
    the KV caches' growth, and the run's stats."""
    cache = make_prompt_cache(model)
    drafter = make_drafter(draft, model)
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full length
    readings = []
    try:
        for r in mlx_spec.stream_generate(
            model,
            tok,
            prompt,
            marks[-1],
            draft=drafter,
            prompt_cache=cache,
            **kwargs,
        ):
            if r.generation_tokens in marks:
                kv = _kv_bytes(list(cache) + _drafter_caches(drafter))
                readings.append(mx.get_active_memory() - kv)
    finally:
        tok.eos_token_ids = eos
    assert len(readings) == len(marks)
    return readings[-1] - readings[0], r.stats


@pytest.fixture(scope="module")
def cycle_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cycle")
    return {f: mlx_spec.load(write_cycle_checkpoint(root / f, f)) for f in FAMILIES}


@pytest.mark.parametrize("rollback", ["store", "replay"])
@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
def test_memory_flat_on_every_family(cycle_models, family, draft, rollback):
    model, tok = cycle_models[family]
    growth, stats = memory_growth(
        model,
        tok,
        cycle_order()[:40],
        draft,
        marks=(400, 1200),
        num_draft_tokens=8,
        rollback=rollback,
    )
    assert stats.acceptance_rate > 0.5  # mostly-accepted passes: the hard case
    assert growth < SLACK_BYTES, f"grew {growth / 1e6:.1f} MB over 800 tokens"


@pytest.mark.parametrize("draft", ["ngram", "mtp+ngram"])
def test_memory_flat_on_demo_model(draft):
    model, tok = mlx_spec.load(default_model_path())
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    growth, stats = memory_growth(
        model, tok, prompt, draft, marks=(300, 1000), num_draft_tokens=8
    )
    assert stats.acceptance_rate > 0.5
    assert growth < SLACK_BYTES, f"grew {growth / 1e6:.1f} MB over 700 tokens"
