"""The state manager leaves every layer exactly where plain decoding would."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

import mlx_spec
from conftest import prompts
from mlx_spec.state import GDNSlotCache, SpeculativeCache


def _arrays(caches):
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out += [x for x in c.cache]
        else:
            out += list(c.keys_and_values())
    return out


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

        a, b = _arrays(plain), _arrays(spec.caches)
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
    with pytest.raises(ValueError, match="exceeds the slot pool"):
        model(mx.array([[4, 5, 6, 7]]), cache=spec.caches)


def test_unknown_rollback_strategy(models):
    with pytest.raises(ValueError, match="'undo'"):
        SpeculativeCache(models["qwen3_5"][0], 3, rollback="undo")


def test_long_generation_keeps_pool_size(models, family):
    """2,000 tokens: the GDN slot pools never grow after their one allocation."""
    model, tok = models[family]
    cache = make_prompt_cache(model)
    prompt = prompts("repetitive", n=40)
    sizes, max_tokens = [], 2000
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full length
    try:
        for r in mlx_spec.stream_generate(
            model,
            tok,
            mx.array(prompt),
            max_tokens,
            num_draft_tokens=4,
            prompt_cache=cache,
        ):
            if r.generation_tokens in (100, 1000) or r.finish_reason:
                gdn = [c for c in cache if isinstance(c, GDNSlotCache)]
                sizes.append(sum(c.pool_nbytes for c in gdn))
    finally:
        tok.eos_token_ids = eos
    assert r.generation_tokens == max_tokens and r.stats.drafted > 0
    gdn = [c for c in cache if isinstance(c, GDNSlotCache)]
    assert gdn and len(set(sizes)) == 1
    # One allocation of exactly max_draft + 1 = 5 slots per layer.
    per_layer = gdn[0].state_pool.nbytes
    assert gdn[0].state_pool.shape[0] == 5
    assert per_layer == 5 * gdn[0][1].nbytes
    kv = [c for c in cache if isinstance(c, KVCache)]
    assert kv[0].offset == len(prompt) + max_tokens - 1


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
