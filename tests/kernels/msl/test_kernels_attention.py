"""Verify attention and MTP attention (mlx_spec.kernels.attention) in the harness.

Checks: against MLX's attention on the real attention dims of
Qwen3-Next-80B-A3B / Qwen3.5-35B-A3B (16 query / 2 KV heads of 256; T 1-9,
cache lengths sampled in 1..4096) and on tiny odd shapes, with the cache a
strided ``KVCache`` view; a query row's result does not depend on T or on
the split of the cache (bit for bit); the MTP variant reads a float16 cache
with float32 / bfloat16 queries.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.kernels import switch as kernels
from mlx_spec.kernels.attention import (
    SPLIT,
    attention_kernel,
    attention_reference,
    mtp_attention,
    mtp_attention_reference,
    verify_attention,
)

from . import harness

# (B, Hq, Hkv, T, N, D)
REAL = [
    (1, 16, 2, 1, 4096, 256),
    (1, 16, 2, 4, 1000, 256),
    (1, 16, 2, 9, 513, 256),
    (1, 16, 2, 9, 9, 256),
]
TINY = [
    (1, 3, 1, 3, 7, 64),
    (2, 6, 2, 5, 300, 64),
    (1, 5, 5, 2, 2, 128),
    (3, 4, 2, 1, 1, 64),
    (1, 2, 1, 16, 40, 128),
]


def rel_err(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def make_inputs(B, Hq, Hkv, T, N, D, dtype, kv_dtype=None, seed=0):
    """Queries and a cache view of N positions in a longer KVCache buffer."""
    mx.random.seed(seed)
    kv_dtype = kv_dtype or dtype
    cap = -(-(N + 1) // 256) * 256
    q = mx.random.normal((B, Hq, T, D)).astype(dtype)
    kbuf = mx.random.normal((B, Hkv, cap, D)).astype(kv_dtype)
    vbuf = mx.random.normal((B, Hkv, cap, D)).astype(kv_dtype)
    return q, kbuf[:, :, :N], vbuf[:, :, :N], ("causal" if T > 1 else None)


def on_harness(fn, *args):
    with harness.use_harness(), kernels.use_mode("on"):
        out = fn(*args)
        mx.eval(out)
    return out


def exact(q, k, v, mask):
    f32 = [x.astype(mx.float32) for x in (q, k, v)]
    return attention_reference(*f32, q.shape[-1] ** -0.5, mask)


@pytest.mark.parametrize("shape", REAL[:2] + TINY)
def test_matches_reference_float32(shape):
    q, k, v, mask = make_inputs(*shape, mx.float32)
    scale = shape[-1] ** -0.5
    out = on_harness(verify_attention, q, k, v, scale, mask)
    assert rel_err(out, attention_reference(q, k, v, scale, mask)) < 1e-5


@pytest.mark.parametrize(
    "shape,dtype,tol",
    [(REAL[2], mx.float16, 1e-3), (REAL[3], mx.bfloat16, 1e-2)]
    + [(s, mx.float16, 1e-3) for s in TINY[1:3]],
)
def test_matches_reference_half(shape, dtype, tol):
    q, k, v, mask = make_inputs(*shape, dtype)
    out = on_harness(verify_attention, q, k, v, shape[-1] ** -0.5, mask)
    assert out.dtype == dtype
    # against the exact answer for these inputs (MLX's attention in float32)
    assert rel_err(out, exact(q, k, v, mask)) < tol


def test_rows_do_not_depend_on_T_or_splits():
    """Row t of a T-token pass == a one-token pass over positions <= N-T+t,
    across a split boundary (one split vs several) and in any row grouping."""
    B, Hq, Hkv, T, D = 1, 4, 2, 6, 64
    N = SPLIT + 3
    q, k, v, _ = make_inputs(B, Hq, Hkv, T, N, D, mx.float16)
    with harness.use_harness():
        full = attention_kernel(q, k, v, 0.125)
        for t in range(T):
            n = N - T + t + 1
            one = attention_kernel(q[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], 0.125)
            assert mx.array_equal(one[:, :, 0], full[:, :, t]), (t, n)


@pytest.mark.parametrize(
    "q_dtype,N,tol", [(mx.float32, 700, 1e-5), (mx.bfloat16, 37, 1e-2)]
)
def test_mtp_attention_float16_cache(q_dtype, N, tol):
    q, k, v, mask = make_inputs(1, 16, 2, 1, N, 256, q_dtype, mx.float16)
    assert k.dtype == mx.float16
    out = on_harness(mtp_attention, q, k, v, 256**-0.5, mask)
    assert out.dtype == q_dtype
    ref = mtp_attention_reference(q, k, v, 256**-0.5, mask)
    if q_dtype == mx.float32:
        assert rel_err(out, ref) < tol
    else:
        assert rel_err(out, exact(q, k, v, mask)) < tol


def test_unsupported_cases_use_the_reference():
    # head_dim 32, an array mask, more than 16 tokens: MLX's attention
    for shape, mask in [
        ((1, 4, 2, 3, 10, 32), "causal"),
        ((1, 4, 2, 3, 10, 64), mx.ones((3, 10), dtype=mx.bool_)),
        ((1, 4, 2, 17, 20, 64), "causal"),
    ]:
        q, k, v, _ = make_inputs(*shape, mx.float32)
        out = on_harness(verify_attention, q, k, v, 0.1, mask)
        assert mx.array_equal(out, attention_reference(q, k, v, 0.1, mask))
