"""A batch pass's MLPs and head over the positions holding tokens only."""

import mlx.core as mx

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.models.packed import PassRows, _PackedMLP, pack_positions
from mlx_spec.testing.reference import (
    OracleDrafter,
    fed_decoder,
    prompts,
    reference_tokens,
    run_batch,
)


def test_apply_computes_the_holding_positions_only():
    rows, seen = PassRows(), []

    def f(x):  # a per-position layer that records what it was given
        seen.append(x.shape)
        return 2 * x[..., :3] + 1

    x = mx.random.normal((3, 4, 5), key=mx.random.key(0))
    with rows.ragged([4, 1, 0], 4):
        got = rows.apply(f, x)
    assert seen == [(1, 5, 5)]  # 4 + 1 + 0 positions
    want = f(x)
    assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1, :1], want[1, :1])
    assert not got[1, 1:].any() and not got[2].any()  # the padding: zeros
    assert rows.index is None  # the pass built: every call is whole again
    assert mx.array_equal(rows.apply(f, x), want) and seen[-1] == (3, 4, 5)


def test_only_the_batched_model_is_packed_and_its_mlps_agree(
    models, plain_models, family
):
    """pack_positions swaps the class of this model's MLPs only (once; the
    same checkpoint loaded by mlx-lm keeps its own); a ragged pass gives
    each holding position what the padded MLP gives it, bit for bit with
    MLX's CPU BLAS."""
    model, _ = models[family]
    rows = pack_positions(model)
    assert pack_positions(model) is rows
    mlp = model.layers[0].mlp
    assert isinstance(mlp, _PackedMLP)
    twin = plain_models[family][0]
    assert not any(isinstance(l.mlp, _PackedMLP) for l in twin.layers)
    parent = type(mlp).__mro__[2]  # (packed, _PackedMLP, mlx-lm's class)
    assert not issubclass(parent, _PackedMLP) and parent.__module__.startswith("mlx_lm")
    H = model.layers[0].post_attention_layernorm.weight.shape[0]
    x = mx.random.normal((3, 5, H), key=mx.random.key(1))
    want = parent.__call__(mlp, x)
    lengths = [5, 2, 3]
    with rows.ragged(lengths, 5):
        got = mlp(x)
    for b, n in enumerate(lengths):
        assert mx.array_equal(got[b, :n], want[b, :n])
    assert mx.array_equal(mlp(x), want)  # outside a pass: the parent's call


def test_ragged_batch_passes_compute_the_tokens_only(models, family, monkeypatch):
    """Rows drafting 4, 0 and 2 tokens a pass: each row's tokens are plain
    decoding's, and every ragged pass's MLPs and head computed its rows'
    tokens only, not B x T positions."""
    model, tok = models[family]
    batch = BatchDecoder(model, n_slots=3, max_draft=4)
    computed = []
    real = PassRows.apply

    def apply(self, f, x):
        out = real(self, f, x)
        if self.index is not None:
            computed.append((self.index.size, x.shape[0] * x.shape[1]))
        return out

    monkeypatch.setattr(PassRows, "apply", apply)
    got, want = {}, {}
    for seed, k in ((1, 4), (2, 0), (3, 2)):
        prompt = prompts("mixed", seed=seed)
        ref = reference_tokens(model, tok, prompt, 12)
        drafter = OracleDrafter(prompt + ref, error=0.3, seed=seed)
        row = batch.add(
            fed_decoder(model, prompt, drafter, 4), RowOptions(12, num_draft_tokens=k)
        )
        got[row], want[row] = [], ref
    run_batch(batch, got)
    assert got == want
    assert computed and all(n < positions for n, positions in computed)


def test_an_mlp_called_with_more_arguments_is_left_to_its_own_call():
    """Another model's MLP taking more than the hidden states keeps its own
    call (and its result) even while a ragged pass is built."""
    import mlx.nn as nn

    class GatedMLP(nn.Module):
        def __call__(self, x, gate=1.0):
            return x * gate

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = GatedMLP()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Layer()]

    model = Model()
    rows = pack_positions(model)
    x = mx.ones((2, 3, 4))
    with rows.ragged([3, 1], 3):
        assert mx.array_equal(model.layers[0].mlp(x, 2.0), 2 * x)
        packed = model.layers[0].mlp(x)
    assert not packed[1, 1:].any() and mx.array_equal(packed[0], x[0])
