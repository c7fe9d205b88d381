"""The DFlash draft model: its forward on the tiny target of every family,
the block's attention (both ways or causal, the window), and the context
cache that grows in chunks and trims back exactly."""

import json

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.loading import load_drafter
from mlx_spec.models.dflash.context_cache import ContextCache
from mlx_spec.testing.attention_only import write_llama_checkpoint
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import (
    TARGET_FAMILIES,
    random_features,
    write_dflash_checkpoint,
)

TOKEN = 7  # the block's last committed token: any id of the tiny vocabulary
# Identical graphs in one process give identical floats; a different chunking
# of the same context changes only the order of a few reductions.
ATOL = 1e-5


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> the tiny target, loaded through mlx_spec.load."""
    root = tmp_path_factory.mktemp("dflash_targets")
    out = {}
    for family in TARGET_FAMILIES:
        if family == "llama":
            path = write_llama_checkpoint(root / family)
        else:
            path = write_tiny_checkpoint(root / family, family)
        out[family] = mlx_spec.load(path)[0]
    return out


def _drafter(tmp_path, target, family="qwen3_5", **overrides):
    path = write_dflash_checkpoint(tmp_path / "drafter", family, **overrides)
    config = json.loads((path / "config.json").read_text())
    return load_drafter(path, target), config


def _draft(drafter, features, cache=None, token=TOKEN, rows=1):
    cache = drafter.make_cache() if cache is None else cache
    block = drafter.block(mx.full((rows,), token, mx.int32))
    return drafter(block, features, cache), cache


@pytest.mark.parametrize("family", TARGET_FAMILIES)
def test_a_block_of_drafts_for_every_family(tmp_path, targets, family):
    drafter, config = _drafter(tmp_path, targets[family], family, block_size=5)
    vocab = config["vocab_size"]
    block = drafter.block(mx.array([3, 9]))
    assert block.tolist() == [[3] + [vocab - 1] * 4, [9] + [vocab - 1] * 4]
    cache = drafter.make_cache()
    logits = drafter(block, random_features(config, 6, rows=2), cache)
    assert logits.shape == (2, 4, vocab)  # block positions 1..4
    assert bool(mx.all(mx.isfinite(logits)))
    assert [c.offset for c in cache] == [6, 6]  # one context cache per layer
    # The context is used: other features, other drafts.
    other, _ = _draft(drafter, random_features(config, 6, seed=1, rows=2), rows=2)
    assert not mx.allclose(other, logits[:1].astype(other.dtype))


def test_logits_come_through_the_targets_head(tmp_path, targets):
    """The drafter owns no embedding or output head: scaling the target's
    embedding (tied to its head in qwen3_5) changes the drafts."""
    target = targets["qwen3_5"]
    drafter, config = _drafter(tmp_path, target)
    assert not any("embed" in k or "lm_head" in k for k, _ in _params(drafter))
    features = random_features(config, 5)
    before, _ = _draft(drafter, features)
    embed = target.language_model.model.embed_tokens
    saved = embed.weight
    try:
        embed.weight = saved * 2
        after, _ = _draft(drafter, features)
    finally:
        embed.weight = saved
    assert not mx.allclose(before, after)


def _params(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _with_token_at(drafter, features, position, token):
    block = drafter.block(mx.array([TOKEN]))
    block[0, position] = token
    return drafter(block, features, drafter.make_cache())


def test_the_block_attends_both_ways_unless_causal(tmp_path, targets):
    target = targets["qwen3_5"]
    both, config = _drafter(tmp_path / "both", target, block_size=6)
    features = random_features(config, 5)
    a = _with_token_at(both, features, 4, 11)
    b = _with_token_at(both, features, 4, 12)
    # Logits k are block position k + 1: position 1 sees position 4.
    assert not mx.allclose(a[:, 0], b[:, 0])

    causal, _ = _drafter(tmp_path / "causal", target, block_size=6, is_causal=True)
    a = _with_token_at(causal, features, 4, 11)
    b = _with_token_at(causal, features, 4, 12)
    assert mx.array_equal(a[:, :3], b[:, :3])  # positions 1..3 cannot see 4
    assert not mx.allclose(a[:, 3:], b[:, 3:])


def test_a_sliding_layer_sees_only_its_window(tmp_path, targets):
    drafter, config = _drafter(
        tmp_path,
        targets["qwen3_5"],
        num_hidden_layers=1,
        target_layer_ids=(1,),
        layer_types=["sliding_attention"],
        sliding_window=4,
    )
    features = random_features(config, 10)
    base, _ = _draft(drafter, features)
    changed = mx.array(features)
    changed[:, :6] = 0.0  # before every block position's window (from 7 on)
    same, _ = _draft(drafter, changed)
    assert mx.allclose(base, same, atol=ATOL)
    changed[:, 9] = 0.0  # the last context position: in every window
    other, _ = _draft(drafter, changed)
    assert not mx.allclose(base, other)


LAYOUTS = {
    "full": {},
    "causal": {"is_causal": True},
    "sliding": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 3,
    },
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_in_chunks_gives_the_drafts_of_one_chunk(tmp_path, targets, layout):
    drafter, config = _drafter(tmp_path, targets["qwen3_5"], **LAYOUTS[layout])
    features = random_features(config, 40)
    whole, _ = _draft(drafter, features)
    cache = drafter.make_cache()
    for start, stop in ((0, 9), (9, 10), (10, 27), (27, 40)):
        chunked, cache = _draft(drafter, features[:, start:stop], cache)
    assert mx.allclose(whole, chunked, atol=ATOL)
    assert [c.offset for c in cache] == [40, 40]
    # Context taken in without drafting, then a draft of the block alone.
    extended = drafter.make_cache()
    drafter.extend(features[:, :31], extended)
    drafter.extend(features[:, 31:], extended)
    alone, _ = _draft(drafter, None, extended)
    assert mx.allclose(whole, alone, atol=ATOL)
    if layout == "sliding":  # the window's layer dropped what it cannot see
        assert cache[0].size < 40 and cache[1].size == 40


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_trimmed_cache_drafts_as_if_never_extended(tmp_path, targets, layout):
    drafter, config = _drafter(tmp_path, targets["qwen3_5"], **LAYOUTS[layout])
    features = random_features(config, 30)
    want, _ = _draft(drafter, features[:, :26])
    _, cache = _draft(drafter, features)  # 30 positions, 4 of them rejected
    assert all(c.trim(4) == 4 for c in cache)
    got, cache = _draft(drafter, None, cache)
    assert mx.allclose(want, got, atol=ATOL)
    assert [c.offset for c in cache] == [26, 26]


def test_a_window_cache_refuses_a_trim_past_what_it_kept():
    cache = ContextCache(window=3, slack=2)
    for _ in range(5):
        cache.append(mx.zeros((1, 1, 4, 2)), mx.zeros((1, 1, 4, 2)))
    assert cache.offset == 20 and cache.size < 20
    with pytest.raises(ValueError, match="cannot trim 6"):
        cache.trim(6)
    assert cache.offset == 20  # unchanged
    assert cache.trim(2) == 2 and cache.offset == 18
    with pytest.raises(ValueError, match="cannot trim 21"):
        ContextCache().trim(21)


def test_a_full_cache_grows_in_steps():
    cache = ContextCache()
    cache.append(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    held = cache.nbytes
    cache.append(mx.ones((1, 2, 5, 4)), mx.ones((1, 2, 5, 4)))
    assert cache.nbytes == held  # no copy for a few more positions
    keys, values = cache.fetch()
    assert keys.shape == (1, 2, 8, 4) and bool(mx.all(keys == 1))
