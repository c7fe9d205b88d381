"""The DFlash training forward of ``scripts/train_dflash``: many anchors of a
sequence in one forward give the logits the runtime drafter gives for each
anchor alone (a fresh context cache, the positions before the anchor, one
block), and the loss trains the parameters the runtime loads."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "train_dflash"
sys.path.insert(0, str(SCRIPTS))

from dflash_forward import (  # noqa: E402
    block_loss,
    position_weights,
    runtime_block_logits,
    train_logits,
    training_mask,
)

import mlx_spec  # noqa: E402
from mlx_spec.loading import load_drafter  # noqa: E402
from mlx_spec.testing.checkpoints import write_tiny_checkpoint  # noqa: E402
from mlx_spec.testing.dflash_drafters import (  # noqa: E402
    random_features,
    write_dflash_checkpoint,
)

ATOL = 1e-4  # another grouping of the same float32 reductions


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_dflash")
    target = mlx_spec.load(write_tiny_checkpoint(root / "target", "qwen3_next"))[0]
    path = write_dflash_checkpoint(root / "drafter", "qwen3_next", block_size=5)
    config = __import__("json").loads((path / "config.json").read_text())
    return target, load_drafter(path, target), config


def _sequence(config, T, rows=2, seed=1):
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, config["vocab_size"] - 1, size=(rows, T)))
    return tokens, random_features(config, T, seed=seed, rows=rows)


def test_every_anchor_equals_the_runtime_block(drafter):
    target, model, config = drafter
    T = 14
    tokens, features = _sequence(config, T)
    anchors = mx.array([[1, 4, 9], [2, 3, 8]])  # each row its own anchors
    logits = train_logits(model, tokens, features, anchors)
    assert logits.shape == (2, 3, 4, config["vocab_size"])
    for r in range(2):
        for j, a in enumerate(anchors[r].tolist()):
            ref = runtime_block_logits(model, tokens[r : r + 1], features[r : r + 1], a)
            assert mx.abs(logits[r, j] - ref[0]).max().item() < ATOL, (r, a)


def test_a_block_sees_no_context_at_or_after_its_anchor(drafter):
    _, model, config = drafter
    tokens, features = _sequence(config, 12, rows=1)
    anchors = mx.array([[5]])
    before = train_logits(model, tokens, features, anchors)
    later = mx.concatenate([features[:, :5], 3.0 + features[:, 5:]], axis=1)
    assert mx.abs(train_logits(model, tokens, later, anchors) - before).max() == 0
    # the control: a change before the anchor changes the drafts
    earlier = mx.concatenate([3.0 + features[:, :5], features[:, 5:]], axis=1)
    assert mx.abs(train_logits(model, tokens, earlier, anchors) - before).max() > 1e-3


def test_the_mask_keeps_blocks_apart():
    mask = training_mask(mx.array([[2, 5]]), context_len=6, block_size=3)
    assert mask.shape == (1, 1, 6, 12)
    rows = np.array(mask[0, 0])
    assert rows[0, :6].tolist() == [True, True, False, False, False, False]
    assert rows[3, :6].tolist() == [True] * 5 + [False]
    assert rows[0, 6:].tolist() == [True] * 3 + [False] * 3
    assert rows[4, 6:].tolist() == [False] * 3 + [True] * 3


def test_the_loss_moves_the_runtime_parameters(drafter):
    _, model, config = drafter
    tokens, features = _sequence(config, 12)
    anchors = mx.array([[3, 6], [1, 7]])
    weights = position_weights(5, 7.0)
    assert weights.tolist()[0] == 1.0 and weights.tolist()[1] < 1.0
    valid = mx.ones(anchors.shape)

    def loss(m):
        return block_loss(m, tokens, features, anchors, weights, valid)[0]

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    grads = dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))
    assert "fc.weight" in grads and "layers.1.self_attn.q_proj.weight" in grads
    assert all(mx.abs(g).max().item() > 0 for g in grads.values())
    assert not any("embed" in k or "lm_head" in k for k in grads)  # the target's
