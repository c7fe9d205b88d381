"""The Gated-DeltaNet layers' short causal convolution as K shifted products.

mlx-lm runs it as ``nn.Conv1d(C, C, K, groups=C)``: each of the ``C``
channels is convolved with its own ``K``-tap kernel (``K = 4`` in released
models). On MLX's CPU backend a grouped convolution costs about one small
matmul per group: on the demo model (1,024 channels) 135 us for 4 rows of
one token and 560 us for 4 rows of 9, against 42 and 89 us for the products
below (``scripts/profile_verify.py --conv``). Its arithmetic there is the
products of each tap in float32, summed in tap order and rounded once to the
output's dtype, which is what :func:`depthwise_conv` computes, bit for bit.

Whether the device in use convolves exactly so is checked once per device,
input and weight dtype, channel count and kernel size, on random inputs of
1, 9 and ``MAX_POSITIONS`` positions against the layer's own ``Conv1d``;
where it does not (Metal's kernels may sum in another order), for longer
inputs (the ``Conv1d``'s algorithm might change with the length), or for any
other convolution, the layer's own ``Conv1d`` runs. mlx-spec calls this for
its own passes only (see ``models/gdn.py``): a model decoding with mlx-lm's
caches keeps the ``Conv1d``.
"""

from typing import Dict, Tuple

import mlx.core as mx
import mlx.nn as nn

MAX_POSITIONS = 2048  # the longest input probed (mlx-lm's prefill chunk)
# (device, input dtype, weight dtype, C, K) -> the products equal the conv
_PROBED: Dict[Tuple, bool] = {}


@mx.compile
def _shifted_products(x: mx.array, w: mx.array) -> mx.array:
    # x: [B, K-1+T, C]; w: [C, K, 1] -> [B, T, C]: sum_j x[:, t + j] * w[:, j]
    K = w.shape[1]
    T = x.shape[1] - K + 1
    x32, w32 = x.astype(mx.float32), w.astype(mx.float32)
    out = x32[:, :T] * w32[:, 0, 0]
    for j in range(1, K):
        out = out + x32[:, j : j + T] * w32[:, j, 0]
    return out.astype(mx.result_type(x, w))


def _is_depthwise(conv: nn.Conv1d) -> bool:
    C, _, per_group = conv.weight.shape
    return (
        per_group == 1
        and getattr(conv, "groups", 1) == C
        and "bias" not in conv
        and getattr(conv, "padding", 0) == 0
        and getattr(conv, "stride", 1) == 1
        and getattr(conv, "dilation", 1) == 1
    )


def _matches(conv: nn.Conv1d, dtype) -> bool:
    """Whether the products equal ``conv`` on this device for ``dtype``
    inputs (probed once, on random inputs)."""
    C, K, _ = conv.weight.shape
    key = (str(mx.default_device()), dtype, conv.weight.dtype, C, K)
    if key not in _PROBED:
        shape = (1, K - 1 + MAX_POSITIONS, C)
        x = (mx.random.normal(shape, key=mx.random.key(0)) * 4).astype(dtype)
        two_rows = x[:, : 2 * (K - 1 + 9)].reshape(2, K - 1 + 9, C)
        probes = [x[:, :K], two_rows, x]  # 1 x 1, 2 x 9, 1 x MAX_POSITIONS
        _PROBED[key] = all(
            mx.array_equal(conv(p), _shifted_products(p, conv.weight)).item()
            for p in probes
        )
    return _PROBED[key]


def depthwise_conv(conv: nn.Conv1d, x: mx.array) -> mx.array:
    """``conv(x)`` for x: [B, K-1+T, C] -> [B, T, C], as shifted products
    where they equal it (see the module's docstring)."""
    short = x.shape[1] - conv.weight.shape[1] + 1 <= MAX_POSITIONS
    if short and _is_depthwise(conv) and _matches(conv, x.dtype):
        return _shifted_products(x, conv.weight)
    return conv(x)
