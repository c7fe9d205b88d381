"""The GDN layers' causal conv as shifted products, against MLX's Conv1d."""

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_spec.models.depthwise_conv as dc


def _conv(C=96, K=4, dtype=mx.float32, **kwargs):
    conv = nn.Conv1d(C, C, K, groups=C, bias=False, **kwargs)
    conv.weight = conv.weight.astype(dtype)
    return conv


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.setattr(dc, "_PROBED", {})


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (4, 9), (2, 16), (1, 2048)])
def test_products_equal_the_conv_bit_for_bit(dtype, B, T):
    conv = _conv(dtype=dtype)
    x = (mx.random.normal((B, 3 + T, 96), key=mx.random.key(T)) * 3).astype(dtype)
    got = dc.depthwise_conv(conv, x)
    assert dc._PROBED  # the products were probed, and used where they match
    assert got.dtype == conv(x).dtype and mx.array_equal(got, conv(x))


def test_inputs_longer_than_the_probes_run_the_conv(monkeypatch):
    conv = _conv()
    x = mx.random.normal((1, 3 + dc.MAX_POSITIONS + 1, 96), key=mx.random.key(3))
    monkeypatch.setattr(dc, "_shifted_products", None)  # never reached
    assert mx.array_equal(dc.depthwise_conv(conv, x), conv(x))


def test_products_that_differ_from_the_conv_are_not_used(monkeypatch):
    """Negative control: products summed in the reverse order (what a
    device summing otherwise would compute) fail the probe, and the layer's
    own conv runs instead."""

    def reversed_sum(x, w):
        K, T = w.shape[1], x.shape[1] - w.shape[1] + 1
        out = x[:, K - 1 :] * w[:, K - 1, 0]
        for j in reversed(range(K - 1)):
            out = out + x[:, j : j + T] * w[:, j, 0]
        return out

    monkeypatch.setattr(dc, "_shifted_products", reversed_sum)
    conv = _conv()
    x = mx.random.normal((2, 12, 96), key=mx.random.key(1))
    assert not mx.array_equal(reversed_sum(x, conv.weight), conv(x))
    assert mx.array_equal(dc.depthwise_conv(conv, x), conv(x))
    assert list(dc._PROBED.values()) == [False]


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(8, 8, 4, groups=8, bias=True),
        nn.Conv1d(8, 8, 4, groups=2, bias=False),
        nn.Conv1d(8, 8, 4, groups=8, bias=False, padding=1),
        nn.Conv1d(8, 8, 4, groups=8, bias=False, dilation=2),
    ],
)
def test_other_convolutions_run_as_they_are(conv, monkeypatch):
    monkeypatch.setattr(dc, "_shifted_products", None)  # never reached
    x = mx.random.normal((1, 12, 8), key=mx.random.key(2))
    assert mx.array_equal(dc.depthwise_conv(conv, x), conv(x))
    assert dc._PROBED == {}
