"""The DFlash draft model against an independent implementation: z-lab's own
MLX code (``dflash.model_mlx`` of the ``dflash`` package 0.1.0) loads the same
random checkpoint, is bound to the same target and gets the same target
features; the draft logits must agree.

The package is not a dependency (its wheel pins versions of tqdm, datasets and
requests that would replace the user's): install it with
``pip install --no-deps dflash==0.1.0`` to run these tests.
"""

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.loading import load_drafter
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import random_features, write_dflash_checkpoint

pytest.importorskip(
    "dflash.model_mlx",
    reason="z-lab's dflash package is absent (pip install --no-deps dflash==0.1.0)",
)

from mlx_spec.testing.dflash_reference import (  # noqa: E402 (after the skip)
    reference_draft_model,
)

# Both compute in float32 with the same MLX ops in the same order; what may
# differ is only how a fused kernel sums (the mask argument, the cache's
# concatenation): well below this.
ATOL = 1e-4

LAYOUTS = {
    "full": {},
    "causal": {"is_causal": True},
    "sliding": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
    },
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("target"), "qwen3_5")
    return mlx_spec.load(path)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_same_draft_logits_as_z_labs_model(tmp_path, target, layout):
    path = write_dflash_checkpoint(tmp_path, "qwen3_5", block_size=6, **LAYOUTS[layout])
    theirs, config = reference_draft_model(path, target)
    ours = load_drafter(path, target)
    block = ours.block(mx.array([5, 21]))
    features = random_features(config, 11, rows=2)
    want = theirs(block, features, theirs.make_cache(), logits_start=1)
    got = ours(block, features, ours.make_cache())
    assert got.shape == want.shape == (2, 5, config["vocab_size"])
    assert mx.allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("layout", ["full", "causal"])
def test_the_same_drafts_as_z_labs_model_over_a_growing_context(
    tmp_path, target, layout
):
    """Three drafts, each adding the context positions committed since the
    last, as both loops run them."""
    path = write_dflash_checkpoint(tmp_path, "qwen3_5", **LAYOUTS[layout])
    theirs, config = reference_draft_model(path, target)
    ours = load_drafter(path, target)
    features = random_features(config, 17)
    their_cache, our_cache = theirs.make_cache(), ours.make_cache()
    for start, stop, token in ((0, 9, 4), (9, 12, 30), (12, 17, 2)):
        block = ours.block(mx.array([token]))
        chunk = features[:, start:stop]
        want = theirs(block, chunk, their_cache, logits_start=1)
        got = ours(block, chunk, our_cache)
        assert mx.allclose(got, want, atol=ATOL), (start, stop)
