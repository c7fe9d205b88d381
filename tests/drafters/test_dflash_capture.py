"""The target's chosen layer outputs recorded during its own forward (the
features a DFlash drafter reads): exact, unchanged logits, chunk by chunk."""

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec.loading import load_drafter
from mlx_spec.mlx_lm_compat import make_prompt_cache
from mlx_spec.models.dflash.capture import attach_tap, detach_tap, tap_of
from mlx_spec.models.dflash.model import text_model
from mlx_spec.testing.attention_only import write_llama_checkpoint
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import TARGET_FAMILIES, write_dflash_checkpoint

TOKENS = [[3, 41, 7, 7, 19, 200, 5, 64, 11, 90, 2]]


@pytest.fixture(scope="module", params=TARGET_FAMILIES)
def target(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_" + request.param)
    if request.param == "llama":
        path = write_llama_checkpoint(root)
    else:
        path = write_tiny_checkpoint(root, request.param)
    model = mlx_spec.load(path)[0]
    model.family = request.param  # which tiny drafter fits it
    yield model
    detach_tap(model)


def _last(model) -> int:
    return len(text_model(model).model.layers) - 1


def test_the_tap_records_the_layer_outputs_and_changes_nothing(target):
    tokens = mx.array(TOKENS)
    plain = target(tokens, cache=make_prompt_cache(target))
    tap = attach_tap(target, (0, _last(target)))
    try:
        tapped = target(tokens, cache=make_prompt_cache(target))
        features = tap.take()
    finally:
        detach_tap(target)
    assert mx.array_equal(plain, tapped)  # the same computation
    backbone = text_model(target).model
    H = backbone.norm.weight.shape[0]
    assert features.shape == (1, len(TOKENS[0]), 2 * H)
    # The last layer's output is what the final norm turns into the hidden
    # state the backbone returns.
    hidden = backbone(tokens, cache=make_prompt_cache(target))
    assert mx.allclose(backbone.norm(features[..., H:]), hidden, atol=1e-5)
    assert tap.take() is None  # taken once


def test_chunks_record_the_features_of_the_whole(target):
    tokens = mx.array(TOKENS)
    tap = attach_tap(target, (1, 0))
    try:
        target(tokens, cache=make_prompt_cache(target))
        whole = tap.take()
        cache = make_prompt_cache(target)
        target(tokens[:, :4], cache=cache)
        target(tokens[:, 4:], cache=cache)
        chunked = tap.take()
    finally:
        detach_tap(target)
    assert mx.allclose(whole, chunked, atol=1e-5)


def test_detach_gives_each_layer_its_class_back(target):
    layers = text_model(target).model.layers
    before = [type(layer) for layer in layers]
    tap = attach_tap(target, (0,))
    assert tap_of(target) is tap and type(layers[0]) is not before[0]
    assert attach_tap(target, (1,)) is tap_of(target)  # replaces, never stacks
    assert type(layers[0]) is before[0]
    detach_tap(target)
    assert [type(layer) for layer in layers] == before and tap_of(target) is None
    with pytest.raises(ValueError, match="layer 9"):
        attach_tap(target, (0, 9))


def test_drafts_from_a_prompt_fed_in_chunks_equal_those_of_one_feed(target, tmp_path):
    """The intended cycle's first half: prefill in chunks, each chunk's
    features appended to the drafter's context, then one draft."""
    path = write_dflash_checkpoint(tmp_path, target.family)
    drafter = load_drafter(path, target)
    tokens = mx.array(TOKENS)
    block = drafter.block(mx.array([TOKENS[0][-1]]))
    tap = attach_tap(target, drafter.config.target_layer_ids)
    try:
        target(tokens[:, :-1], cache=make_prompt_cache(target))
        want = drafter(block, tap.take(), drafter.make_cache())
        cache, context = make_prompt_cache(target), drafter.make_cache()
        for start, stop in ((0, 3), (3, 8), (8, len(TOKENS[0]) - 1)):
            target(tokens[:, start:stop], cache=cache)
            drafter.extend(tap.take(), context)
        got = drafter(block, None, context)
    finally:
        detach_tap(target)
    assert [c.offset for c in context] == [len(TOKENS[0]) - 1] * 2
    assert mx.allclose(want, got, atol=1e-5)
