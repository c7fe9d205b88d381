"""The state manager leaves every layer exactly where plain decoding would."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from mlx_spec.core.state import SpeculativeCache
from mlx_spec.testing.reference import cache_arrays, prompts


@pytest.mark.parametrize("rollback", ["store", "replay"])
def test_commit_equals_plain_decoding(models, family, rollback):
    model, _ = models[family]
    prompt = mx.array(prompts("random", n=12))
    block = mx.array([5, 17, 3, 99, 42, 8])
    for n in range(1, block.size + 1):
        plain = make_prompt_cache(model)
        model(prompt[None], cache=plain)
        for t in block[:n].tolist():
            model(mx.array([[t]]), cache=plain)

        spec = SpeculativeCache(model, max_draft=8, rollback=rollback)
        model(prompt[None], cache=spec.caches)
        spec.begin(block.size)
        model(block[None], cache=spec.caches)
        spec.commit(n)

        a, b = cache_arrays(plain), cache_arrays(spec.caches)
        mx.eval(a, b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.shape == y.shape and mx.array_equal(x, y).item(), (family, n)


def test_commit_bounds_and_pool_limit(models):
    model, _ = models["qwen3_next"]
    spec = SpeculativeCache(model, max_draft=2)
    model(mx.array([[1, 2, 3]]), cache=spec.caches)
    spec.begin(3)
    model(mx.array([[4, 5, 6]]), cache=spec.caches)
    with pytest.raises(ValueError, match="commit\\(4\\)"):
        spec.commit(4)
    spec.begin(4)
    with pytest.raises(ValueError, match="exceeds the rollback slots"):
        model(mx.array([[4, 5, 6, 7]]), cache=spec.caches)


def test_unknown_rollback_strategy(models):
    with pytest.raises(ValueError, match="'undo'"):
        SpeculativeCache(models["qwen3_5"][0], 3, rollback="undo")


def test_model_without_rollback_support_is_refused(models):
    """Caches that cannot be rolled back (here: a recurrent state that is not
    one of the supported GDN layers) get a clear error."""
    model, tok = models["qwen3_next"]
    bad = [
        ArraysCache(2) if i == 0 else c for i, c in enumerate(make_prompt_cache(model))
    ]
    layer = model.layers[0]
    saved = layer.linear_attn
    try:
        del layer.linear_attn  # layer 0 now looks like an unknown recurrent layer
        layer.mixer = saved
        with pytest.raises(
            ValueError, match="cannot be rolled back.*layer 0: ArraysCache"
        ):
            SpeculativeCache(model, 3, caches=bad)
    finally:
        del layer.mixer
        layer.linear_attn = saved
