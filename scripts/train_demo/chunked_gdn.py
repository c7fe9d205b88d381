"""A chunked (matmul-form) gated delta rule for training.

mlx-lm's CPU path runs the Gated-DeltaNet recurrence one token at a time
(``gated_delta_ops``): a training step over T tokens builds a graph of T
small steps per layer, forward and backward. This module computes the same
function chunk by chunk with matrix products (the WY / UT-transform form of
the delta rule, as in the Gated DeltaNet paper), with only T / C sequential
steps.

Recurrence per value head (state S: [Dv, Dk], starting from S_0)::

    S_t = g_t S_{t-1}
    u_t = beta_t (v_t - S_t k_t)
    S_t = S_t + u_t k_t^T
    y_t = S_t q_t

Within a chunk of C tokens entering with state S, let L_i = sum_{s<=i} log g_s
(cumulative log-decay inside the chunk), G_ij = exp(L_i - L_j) for j <= i.
The pseudo-values u solve a unit lower-triangular system::

    (I + diag(beta) strict_lower(G * K K^T)) U = diag(beta) (V - diag(e^L) K S^T)

so U = Tinv (beta V) - Tinv (beta e^L K) S^T, and::

    Y      = diag(e^L) Q S^T + lower(G * Q K^T) U
    S_next = e^{L_C} S + U^T (diag(e^{L_C - L}) K)

Tinv is the inverse of a unit lower-triangular matrix (``mx.linalg.tri_inv``,
CPU), given a VJP here. Everything runs in float32.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

DEFAULT_CHUNK = 64


@mx.custom_function
def unit_lower_inverse(x: mx.array) -> mx.array:
    """Inverse of a batch of lower-triangular matrices x: [..., C, C]."""
    return mx.linalg.tri_inv(x, upper=False, stream=mx.cpu)


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    # d(X^-1) = -X^-1 dX X^-1  =>  dL/dX = -T^T (dL/dT) T^T, kept lower.
    t = output[0] if isinstance(output, (list, tuple)) else output
    dt = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
    tt = t.swapaxes(-1, -2)
    return (mx.tril(-(tt @ dt @ tt)),)


def log_decay(a: mx.array, A_log: mx.array, dt_bias: mx.array) -> mx.array:
    """log g = -exp(A_log) * softplus(a + dt_bias) (mlx-lm's ``compute_g``, in logs)."""
    a = a.astype(mx.float32)
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    chunk: int = DEFAULT_CHUNK,
) -> Tuple[mx.array, mx.array]:
    """The gated delta rule, chunked.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; log_g, beta: [B, T, Hv];
    state: [B, Hv, Dv, Dk] or None (zeros). Returns (y [B, T, Hv, Dv] in q's
    dtype, final state [B, Hv, Dv, Dk] float32), like ``gated_delta_ops``.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T
    f32 = mx.float32
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    log_g, beta = log_g.astype(f32), beta.astype(f32)
    if pad:
        # Padded steps have g = 1 and beta = 0: they leave the state unchanged.
        zpad = [(0, 0), (0, pad), (0, 0), (0, 0)]
        q, k, v = mx.pad(q, zpad), mx.pad(k, zpad), mx.pad(v, zpad)
        log_g = mx.pad(log_g, [(0, 0), (0, pad), (0, 0)])
        beta = mx.pad(beta, [(0, 0), (0, pad), (0, 0)])

    def blocks(x):  # [B, nC, H, D] -> [B, H, n, C, D]
        return x.reshape(B, n, C, Hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = blocks(q), blocks(k), blocks(v)
    L = mx.cumsum(blocks(log_g[..., None])[..., 0], axis=-1)  # [B, H, n, C]
    bt = blocks(beta[..., None])  # [B, H, n, C, 1]

    idx = mx.arange(C)
    lower = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = L[..., :, None] - L[..., None, :]
    decay = mx.exp(mx.where(lower, diff, -mx.inf))  # [B, H, n, C, C]

    kk = k @ k.swapaxes(-1, -2)
    system = mx.eye(C) + mx.where(strict, bt * decay * kk, 0.0)
    tinv = unit_lower_inverse(system)
    eL = mx.exp(L)[..., None]  # [B, H, n, C, 1]
    u_v = tinv @ (bt * v)  # [B, H, n, C, Dv]
    u_s = tinv @ (bt * eL * k)  # [B, H, n, C, Dk]
    qk = decay * (q @ k.swapaxes(-1, -2))  # lower incl. diagonal
    q_s = eL * q
    tail = mx.exp(L[..., -1:, None] - L[..., None])[..., 0]  # [B, H, n, C]
    k_tail = tail[..., None] * k
    g_last = mx.exp(L[..., -1])  # [B, H, n]

    ys = []
    for c in range(n):
        st = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u = u_v[:, :, c] - u_s[:, :, c] @ st
        ys.append(q_s[:, :, c] @ st + qk[:, :, c] @ u)
        state = g_last[:, :, c, None, None] * state + u.swapaxes(-1, -2) @ (
            k_tail[:, :, c]
        )
    y = mx.stack(ys, axis=2)  # [B, H, n, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, n * C, Hv, Dv)[:, :T]
    return y.astype(out_dtype), state


def chunked_gated_delta_update(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state=None,
    mask=None,
    *,
    use_kernel: bool = True,
    lower_bound=None,
    allow_neg_eigval: bool = False,
    chunk: int = DEFAULT_CHUNK,
):
    """Drop-in for mlx-lm's ``gated_delta_update`` (no mask, default gating)."""
    if mask is not None or lower_bound is not None:
        raise NotImplementedError("chunked training GDN: no masks or lower bounds")
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    return chunked_gated_delta(
        q, k, v, log_decay(a, A_log, dt_bias), beta, state, chunk=chunk
    )


class ShiftConv1d(nn.Conv1d):
    """mlx-lm's depthwise causal ``conv1d`` as K shifted multiply-adds.

    Same parameters and outputs as ``nn.Conv1d(C, C, K, groups=C, bias=False)``
    (weight [C, K, 1]); about twice as fast forward + backward on the CPU.
    """

    def __call__(self, x: mx.array) -> mx.array:
        # x: [B, T + K - 1, C] -> [B, T, C]
        w = self.weight[:, :, 0]  # [C, K]
        K = w.shape[1]
        T = x.shape[1] - K + 1
        y = x[:, 0:T] * w[:, 0]
        for i in range(1, K):
            y = y + x[:, i : i + T] * w[:, i]
        return y


@contextmanager
def chunked_gdn(chunk: int = DEFAULT_CHUNK, model=None):
    """Within the block, mlx-lm's qwen3_next GDN layers use the chunked rule.

    With ``model``, its GDN ``conv1d`` modules also run as :class:`ShiftConv1d`
    (class swapped in place, restored on exit).
    """
    from mlx_lm.models import qwen3_next

    original = qwen3_next.gated_delta_update
    convs = []
    if model is not None:
        for layer in model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None and type(gdn.conv1d) is nn.Conv1d:
                gdn.conv1d.__class__ = ShiftConv1d
                convs.append(gdn.conv1d)

    def update(*args, **kwargs):
        return chunked_gated_delta_update(*args, chunk=chunk, **kwargs)

    qwen3_next.gated_delta_update = update
    try:
        yield
    finally:
        qwen3_next.gated_delta_update = original
        for conv in convs:
            conv.__class__ = nn.Conv1d
