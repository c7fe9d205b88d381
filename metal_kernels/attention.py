"""Verify attention and the MTP head's single-query attention.

Both are one kernel: ``T <= 16`` query tokens of the ``G = Hq / Hkv`` query
heads that share a KV head attend to that head's cache; query token ``t``
sees cache positions ``< N - T + t + 1`` (causal within the T tokens, the
cache holding ``N`` positions including them). A threadgroup owns one KV head
and one *split* of ``C = 256`` consecutive cache positions and serves all
``R = G * T`` query rows from it, so each K/V row is read from device memory
once per verify step (tiles of ``BK`` positions staged in threadgroup
memory), not once per query head or token.

Pass 1 grid ``(32 * NSG, n_splits, B * Hkv)``, threadgroup ``(32 * NSG, 1,
1)`` with ``NSG = min(32, R)`` SIMD groups; SIMD group ``s`` owns rows
``s, s + NSG, ...`` (``RPS = ceil(R / NSG)`` rows), each lane ``D / 32``
elements of the query (scaled, float32) and of the output accumulator of each
row; scores are ``simd_sum``s, softmax is online per tile. With one split the
kernel writes the output; otherwise it writes per-split partials (float32
accumulator, running max and sum) and pass 2 (grid ``(D, R, B * Hkv)``)
combines them.

Splits sit at fixed cache positions and a row ignores positions it cannot
see, so a query row's result does not depend on ``T``, on the other rows or
on positions after it: a verify pass computes bit-for-bit what one-token
steps through this kernel would. The MTP variant is the same kernel with
``T = 1`` reading the float16 cache directly while the queries stay in the
head's compute dtype (mlx-lm-style code upcasts the whole cache first).

mlx-lm's attention layer reaches these through the dispatcher that
``mlx_spec.models.fast_layers`` installs in place of
``mlx_lm.models.qwen3_next.scaled_dot_product_attention``.
"""

from typing import Optional

import mlx.core as mx

from .switch import cached_kernel, dispatch, kernel_stream, time_call

SPLIT = 256  # cache positions per split (a multiple of every BK below)
MAX_T = 16
HEAD_DIMS = (64, 128, 256)
AUTO_BENCH_N = 2048  # cache length of the ``auto`` decision's benchmark


def attention_reference(queries, keys, values, scale: float, mask=None):
    """MLX's attention; what mlx-lm's ``scaled_dot_product_attention`` runs
    for an unquantised cache.

    queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D]; mask: None,
    "causal" or an array. Returns [B, Hq, T, D] in the queries' dtype.
    """
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask
    )


def mtp_attention_reference(queries, keys, values, scale: float, mask=None):
    """The MTP head's attention as it runs now: the stored (float16) cache
    upcast to the queries' dtype, then MLX's attention."""
    dt = queries.dtype
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(dt), values.astype(dt), scale=scale, mask=mask
    )


_PASS1 = """
    // q: [B, Hq, T, D]; k, v: [B, Hkv, N', D] (strided, N' >= N)
    // one split: out [B, Hq, T, D]; else o_part [B*Hkv, S, R, D] and
    // ml [B*Hkv, S, R, 2] (running max, sum) in float32
    constexpr int EPL = D / 32;
    constexpr int R = G * T;
    constexpr int NT = 32 * NSG;
    threadgroup KT kt[BK * D];
    threadgroup KT vt[BK * D];

    int Hq = q_shape[1];
    int Hkv = Hq / G;
    int bh = threadgroup_position_in_grid.z;
    int b = bh / Hkv;
    int kvh = bh % Hkv;
    int split = threadgroup_position_in_grid.y;
    int n_splits = threadgroups_per_grid.y;
    uint sg = simdgroup_index_in_threadgroup;
    uint lane = thread_index_in_simdgroup;
    uint tid = thread_index_in_threadgroup;
    int offset = N - T;
    int n_begin = split * SPLIT;
    int n_end = min(N, n_begin + SPLIT);

    float qr[RPS][EPL];
    float acc[RPS][EPL];
    float m[RPS];
    float l[RPS];
    for (int i = 0; i < RPS; ++i) {
      int r = min(int(sg) + i * NSG, R - 1);
      int head = kvh * G + r / T;
      auto qp = q + b * q_strides[0] + head * q_strides[1] + (r % T) * q_strides[2];
      for (int e = 0; e < EPL; ++e) {
        qr[i][e] = scale * static_cast<float>(qp[(lane * EPL + e) * q_strides[3]]);
        acc[i][e] = 0.0f;
      }
      m[i] = -FLT_MAX;
      l[i] = 0.0f;
    }

    auto kb = k + b * k_strides[0] + kvh * k_strides[1];
    auto vb = v + b * v_strides[0] + kvh * v_strides[1];
    for (int n0 = n_begin; n0 < n_end; n0 += BK) {
      int cnt = min(BK, n_end - n0);
      for (int idx = tid; idx < BK * D; idx += NT) {
        int j = idx / D;
        int d = idx % D;
        if (j < cnt) {
          kt[idx] = kb[(n0 + j) * k_strides[2] + d * k_strides[3]];
          vt[idx] = vb[(n0 + j) * v_strides[2] + d * v_strides[3]];
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = 0; i < RPS; ++i) {
        int r = int(sg) + i * NSG;
        // positions n0 .. n0 + jmax - 1 are visible to row r
        int jmax = r < R ? min(cnt, offset + r % T - n0 + 1) : 0;
        if (jmax > 0) {
          float s[BK];
          float mt = m[i];
          for (int j = 0; j < BK; ++j) {
            if (j < jmax) {
              float dot = 0.0f;
              for (int e = 0; e < EPL; ++e) {
                dot += qr[i][e] * static_cast<float>(kt[j * D + lane * EPL + e]);
              }
              dot = simd_sum(dot);
              s[j] = dot;
              mt = max(mt, dot);
            }
          }
          if (mt != m[i]) {
            float f = metal::exp(m[i] - mt);
            l[i] *= f;
            for (int e = 0; e < EPL; ++e) {
              acc[i][e] *= f;
            }
            m[i] = mt;
          }
          for (int j = 0; j < BK; ++j) {
            if (j < jmax) {
              float p = metal::exp(s[j] - mt);
              l[i] += p;
              for (int e = 0; e < EPL; ++e) {
                acc[i][e] += p * static_cast<float>(vt[j * D + lane * EPL + e]);
              }
            }
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    for (int i = 0; i < RPS; ++i) {
      int r = int(sg) + i * NSG;
      if (r < R) {
        WRITE_OUTPUT
      }
    }
"""

_WRITE_DIRECT = """
        int head = kvh * G + r / T;
        auto op = out + ((b * Hq + head) * T + r % T) * D + lane * EPL;
        for (int e = 0; e < EPL; ++e) {
          op[e] = static_cast<InT>(acc[i][e] / l[i]);
        }
"""

_WRITE_SPLIT = """
        int row = (bh * n_splits + split) * R + r;
        for (int e = 0; e < EPL; ++e) {
          o_part[row * D + lane * EPL + e] = acc[i][e];
        }
        if (lane == 0) {
          ml[2 * row] = m[i];
          ml[2 * row + 1] = l[i];
        }
"""

_PASS2 = """
    // o_part: [B*Hkv, S, R, D], ml: [B*Hkv, S, R, 2] -> out: [B, Hq, T, D]
    constexpr int R = G * T;
    int d = thread_position_in_grid.x;
    int r = thread_position_in_grid.y;
    int bh = thread_position_in_grid.z;
    int n_splits = o_part_shape[1];
    int Hkv = threads_per_grid.z / B;
    int b = bh / Hkv;
    int kvh = bh % Hkv;
    float M = -FLT_MAX;
    for (int s = 0; s < n_splits; ++s) {
      M = max(M, ml[2 * ((bh * n_splits + s) * R + r)]);
    }
    float num = 0.0f;
    float den = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      int row = (bh * n_splits + s) * R + r;
      float ms = ml[2 * row];
      float w = ms == M ? 1.0f : metal::exp(ms - M);
      num += o_part[row * D + d] * w;
      den += ml[2 * row + 1] * w;
    }
    int head = kvh * G + r / T;
    out[((b * Hkv * G + head) * T + r % T) * D + d] = static_cast<InT>(num / den);
"""


def _make_pass1(direct: bool):
    outputs = ["out"] if direct else ["o_part", "ml"]
    return mx.fast.metal_kernel(
        name="mlx_spec_attention_" + ("direct" if direct else "split"),
        input_names=["q", "k", "v", "N", "scale"],
        output_names=outputs,
        source=_PASS1.replace("SPLIT", str(SPLIT)).replace(
            "WRITE_OUTPUT", _WRITE_DIRECT if direct else _WRITE_SPLIT
        ),
        ensure_row_contiguous=False,
    )


def _make_pass2():
    return mx.fast.metal_kernel(
        name="mlx_spec_attention_combine",
        input_names=["o_part", "ml"],
        output_names=["out"],
        source=_PASS2,
    )


def tile_keys(D: int, kv_dtype) -> int:
    """Cache positions per threadgroup tile (K and V tiles <= 16 KiB)."""
    elems = 4096 if kv_dtype.size <= 2 else 2048
    return max(1, min(32, elems // D))


def attention_kernel(queries, keys, values, scale: float):
    """Causal GQA attention of the last ``T`` positions (the kernel).

    queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D] (any strides, e.g.
    a ``KVCache`` view). Returns [B, Hq, T, D] in the queries' dtype.
    """
    B, Hq, T, D = queries.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    R = G * T
    nsg = min(32, R)
    rps = -(-R // nsg)
    n_splits = -(-N // SPLIT)
    direct = n_splits == 1
    kernel = cached_kernel(("attn", direct), lambda: _make_pass1(direct))
    template = [
        ("InT", queries.dtype),
        ("KT", keys.dtype),
        ("D", D),
        ("G", G),
        ("T", T),
        ("NSG", nsg),
        ("RPS", rps),
        ("BK", tile_keys(D, keys.dtype)),
    ]
    common = dict(
        inputs=[queries, keys, values, N, float(scale)],
        template=template,
        grid=(32 * nsg, n_splits, B * Hkv),
        threadgroup=(32 * nsg, 1, 1),
        stream=kernel_stream(),
    )
    if direct:
        return kernel(
            output_shapes=[(B, Hq, T, D)], output_dtypes=[queries.dtype], **common
        )[0]
    o_part, ml = kernel(
        output_shapes=[(B * Hkv, n_splits, R, D), (B * Hkv, n_splits, R, 2)],
        output_dtypes=[mx.float32, mx.float32],
        **common,
    )
    combine = cached_kernel(("attn-combine",), _make_pass2)
    return combine(
        inputs=[o_part, ml],
        template=[("InT", queries.dtype), ("D", D), ("G", G), ("T", T), ("B", B)],
        grid=(D, R, B * Hkv),
        threadgroup=(min(D, 256), 1, 1),
        output_shapes=[(B, Hq, T, D)],
        output_dtypes=[queries.dtype],
        stream=kernel_stream(),
    )[0]


def kernel_supported(queries, keys, values, mask) -> bool:
    B, Hq, T, D = queries.shape
    Hkv, N = keys.shape[1], keys.shape[2]
    causal = mask is None if T == 1 else (isinstance(mask, str) and mask == "causal")
    return (
        causal
        and 1 <= T <= MAX_T
        and T <= N
        and D in HEAD_DIMS
        and values.shape == keys.shape
        and keys.shape[0] == B
        and Hq % Hkv == 0
        and queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and keys.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and values.dtype == keys.dtype
    )


def faster_on_family(dims, Ts, reference, N: Optional[int] = None) -> bool:
    """The ``auto`` decision for a family of shapes: is the kernel faster in
    total over ``T`` in ``Ts`` at a cache of ``N`` positions?"""
    B, Hq, Hkv, D, q_dtype, kv_dtype = dims
    N = N or AUTO_BENCH_N
    k = mx.random.normal((B, Hkv, N, D)).astype(kv_dtype)
    v = mx.random.normal((B, Hkv, N, D)).astype(kv_dtype)
    kernel_t = reference_t = 0.0
    for T in Ts:
        q = mx.random.normal((B, Hq, T, D)).astype(q_dtype)
        mask = "causal" if T > 1 else None
        mx.eval(q, k, v)
        kernel_t += time_call(lambda: attention_kernel(q, k, v, D**-0.5), 1, 3)
        reference_t += time_call(lambda: reference(q, k, v, D**-0.5, mask), 1, 3)
    return kernel_t < reference_t


def _dims(queries, keys):
    B, Hq, T, D = queries.shape
    return (B, Hq, keys.shape[1], D, queries.dtype, keys.dtype)


def _dispatch(name, reference, bench_tokens, queries, keys, values, scale, mask):
    """The attention kernel or ``reference(queries, keys, values, scale,
    mask)``; ``auto`` decides per family by timing ``bench_tokens`` sizes."""
    if not kernel_supported(queries, keys, values, mask):
        return reference(queries, keys, values, scale, mask)
    dims = _dims(queries, keys)
    T, n_splits = queries.shape[2], -(-keys.shape[2] // SPLIT)
    return dispatch(
        name,
        lambda: attention_kernel(queries, keys, values, scale),
        lambda: reference(queries, keys, values, scale, mask),
        probe_key=dims + (T, n_splits == 1),
        family=dims,
        decide=lambda: faster_on_family(dims, bench_tokens, reference),
    )


def verify_attention(queries, keys, values, scale: float, mask=None):
    """Attention of a verify pass (or any T <= 16 step); the kernel where the
    switch allows it. Same arguments and result as ``attention_reference``.

    queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D] float16/bfloat16.
    """
    return _dispatch(
        "attention", attention_reference, (1, 4, 8), queries, keys, values, scale, mask
    )


def mtp_attention(queries, keys, values, scale: float, mask=None):
    """The MTP head's attention over its stored cache (float16), queries in
    the head's dtype. Same arguments and result as
    ``mtp_attention_reference``.

    queries: [B, Hq, L, D]; keys, values: [B, Hkv, N, D] (the stored rows).
    """
    return _dispatch(
        "mtp_attention",
        mtp_attention_reference,
        (1,),
        queries,
        keys,
        values,
        scale,
        mask,
    )
