"""The verify forward of the GDN subclasses against the installed mlx-lm."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from mlx_spec.core.batch import BatchDecoder
from mlx_spec.core.state import GDNSlotCache, SpeculativeCache
from mlx_spec.models.gdn import make_verifiable


def _gdn_layers(model):
    return [l.linear_attn for l in model.layers if hasattr(l, "linear_attn")]


def _plain_forward(layer, x, cache):
    """The parent class's (mlx-lm's) forward, whatever the layer's class."""
    parent = next(c for c in type(layer).__mro__ if c.__module__.startswith("mlx_lm"))
    return parent.__call__(layer, x, None, cache)


@pytest.mark.parametrize(
    "T,capturing", [(1, True), (2, True), (5, True), (1, False), (7, False)]
)
def test_own_forward_equals_mlx_lm_forward(models, family, T, capturing, monkeypatch):
    """Capturing over T tokens gives the output and cache of mlx-lm's own
    forward over the same tokens (then commit keeps them all); so does a
    step or a prefill outside a verify pass, and the context's prefill
    before them. All run mlx-spec's forward (its conv among them)."""
    import mlx_spec.models.gdn as gdn

    convs = []
    real_conv = gdn.depthwise_conv
    monkeypatch.setattr(
        gdn, "depthwise_conv", lambda c, x: convs.append(x.shape) or real_conv(c, x)
    )
    model, _ = models[family]
    layer = _gdn_layers(model)[0]
    assert make_verifiable(layer)
    mx.random.seed(T)
    H = layer.in_proj_ba.weight.shape[1] if hasattr(layer, "in_proj_ba") else None
    H = H or layer.in_proj_qkv.weight.shape[1]
    history = mx.random.normal((1, 6, H))
    x = mx.random.normal((1, T, H))
    plain, ours = ArraysCache(2), GDNSlotCache(max_tokens=8)
    before = _plain_forward(layer, history, plain)  # a context first
    assert mx.array_equal(layer(history, None, ours), before)
    want = _plain_forward(layer, x, plain)
    ours.capturing = capturing
    got = layer(x, None, ours)
    if capturing:
        ours.commit([T])
    K, C = layer.conv_kernel_size, layer.conv_dim
    assert convs == [(1, K - 1 + 6, C), (1, K - 1 + T, C)]
    assert mx.array_equal(got, want)
    for a, b in zip(ours.cache, plain.cache):
        assert mx.array_equal(a, b)


def test_left_padded_cache_is_refused(models):
    model, _ = models["qwen3_5"]
    layer = _gdn_layers(model)[0]
    cache = GDNSlotCache(max_tokens=4)
    cache.left_padding = mx.array([1])
    cache.capturing = True
    H = layer.in_proj_qkv.weight.shape[1]
    with pytest.raises(NotImplementedError, match="left-padded"):
        layer(mx.zeros((1, 2, H)), None, cache)


def test_a_layer_sharded_over_devices_is_refused(models, monkeypatch):
    """mlx-lm's tensor-parallel GDN layer sums its output over a group; the
    forward mlx-spec runs over its caches does not, so it says so."""
    model, _ = models["qwen3_5"]
    layer = _gdn_layers(model)[0]
    monkeypatch.setattr(layer, "sharding_group", object(), raising=False)
    H = layer.in_proj_qkv.weight.shape[1]
    with pytest.raises(NotImplementedError, match="--pipeline"):
        layer(mx.zeros((1, 1, H)), None, GDNSlotCache(max_tokens=4))


@pytest.mark.parametrize("skip_padding", [False, True])
@pytest.mark.parametrize("kept", [[4, 1, 0, 2], [3, 1, 0, 1]])
def test_rows_padded_at_the_end_match_mlx_lm(
    plain_models, models, family, skip_padding, kept, monkeypatch
):
    """A batch of rows with their own lengths (cache.lengths; a row of 0:
    it stopped): the verify forward and a commit of each row's kept tokens
    (all of its own, or fewer) give mlx-lm's output on the kept tokens and
    mlx-lm's caches after them. Given the lengths on the host too
    (``set_row_lengths``), the recurrence runs each row's own tokens only."""
    import mlx_spec.kernels.gated_delta as gd

    model, _ = models[family]
    layer = _gdn_layers(model)[0]
    plain_layer = _gdn_layers(plain_models[family][0])[0]
    H = layer.out_proj.weight.shape[0]
    x = mx.random.normal((4, 4, H), key=mx.random.key(1))
    lengths = [4, 1, 0, 2]
    row_steps = []
    step = gd.gated_delta_step_ops
    monkeypatch.setattr(
        gd,
        "gated_delta_step_ops",
        lambda *a: row_steps.append(a[-1].shape[0]) or step(*a),
    )
    plain, ours = ArraysCache(2), GDNSlotCache(max_tokens=4)
    plain.lengths = mx.array(kept)
    want = plain_layer(x, plain.make_mask(4), plain)
    if skip_padding:
        ours.set_row_lengths(lengths)
    else:
        ours.lengths = mx.array(lengths)
    ours.capturing = True
    got = layer(x, ours.make_mask(4), ours)
    assert ours.rollback_nbytes > 0  # what the pass captured, counted
    ours.commit(kept)
    assert ours.rollback_nbytes == 0
    for b, n in enumerate(kept):
        assert mx.array_equal(got[b, :n], want[b, :n])
    for a, b in zip(ours.cache, plain.cache):
        assert mx.array_equal(a, b)
    assert sum(row_steps) == (sum(lengths) if skip_padding else 4 * 4)


@pytest.mark.parametrize("capturing", [False, True])
def test_only_mlx_spec_caches_start_layers_early(models, monkeypatch, capturing):
    """A layer over mlx-spec's cache starts evaluating its output once built
    (plain and verify forwards); over mlx-lm's own cache it never does, so
    mlx-lm decoding the same model schedules its work as it always has."""
    model, _ = models["qwen3_next"]
    layer = _gdn_layers(model)[0]
    make_verifiable(layer)
    started = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(a) or real(*a))
    H = layer.out_proj.weight.shape[0]
    x = mx.random.normal((1, 3, H), key=mx.random.key(2))
    want = layer(x, None, ArraysCache(2))
    assert started == []
    ours = GDNSlotCache(max_tokens=4)
    ours.capturing = capturing
    got = layer(x, None, ours)
    assert len(started) == 1 and started[0][0] is got
    assert mx.array_equal(got, want)


def test_the_ranks_of_a_pipeline_do_not_start_layers_early(models, monkeypatch):
    """On one process mlx-spec's caches start their layers early; a model
    split over a pipeline's ranks gets caches that do not (there each rank's
    layers wait on the others', and starting them early made passes slower)."""
    model, _ = models["qwen3_next"]

    def early():
        batch = BatchDecoder(model, n_slots=2, max_draft=3)
        single = SpeculativeCache(model, 3)
        return {c.evaluate_early for c in batch.gdn + single.gdn}

    assert early() == {True}
    monkeypatch.setattr(model.model, "pipeline_size", 2, raising=False)
    assert early() == {False}
