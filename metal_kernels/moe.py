"""Expert dispatch for few-token MoE (the routed experts of a verify pass).

A drop-in for mlx-lm's ``SwitchGLU.__call__(x, indices)``: for the
``M = B * T`` tokens of a verify pass and their top-``K`` experts it returns
each (token, expert) pair's expert output ``[..., K, H]``; the MoE block
(mlx-lm's own code) then forms the score-weighted sum. Every distinct
selected expert's weights are read once for all the tokens routed to it
(mlx-lm's ``SwitchGLU`` below 64 (token, expert) pairs reads an expert once
per pair). Two launches after the routing:

0. routing (MLX ops, no sync): the ``P = M * K`` (token, expert) pairs
   sorted by expert, and where each expert's run of pairs starts.
1. gate/up: grid ``(32 * NSG, ceil(I / (NSG * RS)), min(P, E))``,
   threadgroup ``(128, 1, 1)`` (``NSG = 4`` SIMD groups of ``RS = 2`` rows
   each). Threadgroup ``z`` handles run ``z`` (one expert, its up to
   ``MT = M`` tokens; threadgroups past the last run exit at once): it stages
   blocks of 256 input columns of the run's tokens in threadgroup memory,
   each lane dots 8 columns of its rows of ``gate_proj`` and ``up_proj`` with
   every token, ``simd_sum`` per row and token, and writes
   ``silu(gate) * up`` (float32) per pair.
2. down: the same with ``down_proj`` on the pairs' hidden vectors, writing
   each pair's output (float32 ``[P, H]``, pair ``m * K + k`` in row
   ``m * K + k``), cast to x's dtype by an MLX op.

Weights: float16/bfloat16/float32 ``SwitchLinear`` or mlx affine
``QuantizedSwitchLinear`` (4 or 8 bits, group size 64; the dot uses
``scale * sum(q * x) + bias * sum(x)`` per group). Accumulation is float32;
a pair's result does not depend on the other tokens (each pair has its own
accumulators, sums run in a fixed order), so a verify pass computes what
one-token steps through this kernel would.
"""

from typing import Optional

import mlx.core as mx

from ..mlx_lm_compat import (
    QuantizedSwitchLinear,
    SwiGLU,
    SwitchGLU,
    SwitchLinear,
)
from .switch import cached_kernel, dispatch, kernel_stream, time_call

MAX_TOKENS = 16
NSG, RS, BLK = 4, 2, 256


def experts_reference(x: mx.array, inds: mx.array, switch_mlp) -> mx.array:
    """mlx-lm's expert path: ``SwitchGLU.__call__`` itself (also for a
    subclass of ``SwitchGLU``, whose own ``__call__`` may dispatch here).

    x: [..., H]; inds: [..., K]. Returns [..., K, H] in x's dtype.
    """
    return SwitchGLU.__call__(switch_mlp, x, inds)


def moe_reference(x: mx.array, inds: mx.array, scores: mx.array, switch_mlp):
    """The routed part of ``Qwen3NextSparseMoeBlock``: ``SwitchGLU`` then
    mlx-lm's score-weighted sum (what ``bench-kernels`` times).

    x: [..., H]; inds, scores: [..., K]. Returns [..., H] in x's dtype.
    """
    return weighted_sum(experts_reference(x, inds, switch_mlp), scores)


def weighted_sum(y: mx.array, scores: mx.array) -> mx.array:
    """mlx-lm's combine of the expert outputs y [..., K, H] (MLX ops)."""
    return (y * scores[..., None]).sum(axis=-2)


_MATVEC = """
    // inputs of one pair: IN values; weights: [E, OUT, IN] (or packed)
    constexpr int NT = 32 * NSG;
    threadgroup float xs[MT * BLK];
    int start = starts[threadgroup_position_in_grid.z];
    if (start < 0) {
      return;  // fewer runs than threadgroups
    }
    int e = sorted_e[start];
    int end = start + 1;
    while (end < P && sorted_e[end] == e) {
      ++end;
    }
    uint sg = simdgroup_index_in_threadgroup;
    uint lane = thread_index_in_simdgroup;
    uint tid = thread_index_in_threadgroup;
    int row0 = (int(threadgroup_position_in_grid.y) * NSG + int(sg)) * RS;

    // a run longer than MT (repeated experts in a token's top-k) in chunks
    for (int p = start; p < end; p += MT) {
      int c = min(MT, end - p);
      float acc[NMAT][RS][MT];
      for (int m = 0; m < NMAT; ++m) {
        for (int r = 0; r < RS; ++r) {
          for (int u = 0; u < MT; ++u) {
            acc[m][r][u] = 0.0f;
          }
        }
      }
      for (int c0 = 0; c0 < IN; c0 += BLK) {
        for (int idx = tid; idx < MT * BLK; idx += NT) {
          int u = idx / BLK;
          int j = c0 + idx % BLK;
          float val = 0.0f;
          if (u < c && j < IN) {
            val = LOAD_INPUT;
          }
          xs[idx] = val;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        int col = c0 + int(lane) * 8;
        if (col < IN) {
          for (int r = 0; r < RS; ++r) {
            long wrow = long(e) * OUT + min(row0 + r, OUT - 1);
            DOT_ROWS
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      for (int r = 0; r < RS; ++r) {
        for (int u = 0; u < MT; ++u) {
          if (u < c) {
            long dst = long(order[p + u]) * OUT + row0 + r;
            bool write = lane == 0 && row0 + r < OUT;
            EPILOGUE
          }
        }
      }
    }
"""

# One matrix W (scales S, biases Z when quantised) into acc[MAT].
_DOT_FLOAT = """
          {
            float w[8];
            for (int j = 0; j < 8; ++j) {
              w[j] = col + j < IN ? static_cast<float>(W[wrow * IN + col + j]) : 0.0f;
            }
            for (int u = 0; u < MT; ++u) {
              if (u < c) {
                float d = 0.0f;
                for (int j = 0; j < 8; ++j) {
                  d += w[j] * xs[u * BLK + lane * 8 + j];
                }
                acc[MAT][r][u] += d;
              }
            }
          }
"""

_DOT_QUANT = """
          {
            float w[8];
            UNPACK
            long g = wrow * (IN / 64) + col / 64;
            float sc = static_cast<float>(S[g]);
            float bi = static_cast<float>(Z[g]);
            for (int u = 0; u < MT; ++u) {
              if (u < c) {
                float d = 0.0f;
                float xsum = 0.0f;
                for (int j = 0; j < 8; ++j) {
                  float xv = xs[u * BLK + lane * 8 + j];
                  d += w[j] * xv;
                  xsum += xv;
                }
                acc[MAT][r][u] += sc * d + bi * xsum;
              }
            }
          }
"""

_UNPACK = {
    4: """
            uint32_t wq = W[wrow * (IN / 8) + col / 8];
            for (int j = 0; j < 8; ++j) {
              w[j] = static_cast<float>((wq >> (4 * j)) & 15u);
            }""",
    8: """
            uint32_t wq0 = W[wrow * (IN / 4) + col / 4];
            uint32_t wq1 = W[wrow * (IN / 4) + col / 4 + 1];
            for (int j = 0; j < 4; ++j) {
              w[j] = static_cast<float>((wq0 >> (8 * j)) & 255u);
              w[j + 4] = static_cast<float>((wq1 >> (8 * j)) & 255u);
            }""",
}

_EPI_SWIGLU = """
          float gv = simd_sum(acc[0][r][u]);
          float uv = simd_sum(acc[1][r][u]);
          if (write) {
            h[dst] = gv / (1.0f + metal::exp(-gv)) * uv;
          }
"""

_EPI_STORE = """
          float yv = simd_sum(acc[0][r][u]);
          if (write) {
            yp[dst] = yv;
          }
"""


def _weight_names(tag: str, bits: int):
    return [f"{tag}_w"] + ([f"{tag}_s", f"{tag}_z"] if bits else [])


def _dot(tag: str, mat: int, bits: int) -> str:
    src = _DOT_QUANT.replace("UNPACK", _UNPACK[bits]) if bits else _DOT_FLOAT
    src = src.replace("MAT", str(mat)).replace("W[", f"{tag}_w[")
    return src.replace("S[", f"{tag}_s[").replace("Z[", f"{tag}_z[")


def _make_matvec(gate_up: bool, bits: int):
    tags = ("gate", "up") if gate_up else ("down",)
    inputs = ["x" if gate_up else "h", "order", "sorted_e", "starts"]
    for t in tags:
        inputs += _weight_names(t, bits)
    load = (
        "static_cast<float>(x[(order[p + u] / K) * IN + j])"
        if gate_up
        else "h[long(order[p + u]) * IN + j]"
    )
    source = (
        _MATVEC.replace("NMAT", str(len(tags)))
        .replace("LOAD_INPUT", load)
        .replace("DOT_ROWS", "".join(_dot(t, i, bits) for i, t in enumerate(tags)))
        .replace("EPILOGUE", _EPI_SWIGLU if gate_up else _EPI_STORE)
        .replace("BLK", str(BLK))
    )
    return mx.fast.metal_kernel(
        name=f"mlx_spec_moe_{'gate_up' if gate_up else 'down'}_{bits or 'f'}",
        input_names=inputs,
        output_names=["h" if gate_up else "yp"],
        source=source,
    )


def _weights(layer) -> Optional[tuple]:
    """(bits, arrays) of a SwitchLinear (bits 0) / affine QuantizedSwitchLinear."""
    if "bias" in layer:
        return None
    if type(layer) is SwitchLinear:
        return 0, [layer.weight]
    if (
        type(layer) is QuantizedSwitchLinear
        and getattr(layer, "mode", "affine") == "affine"
        and layer.group_size == 64
        and layer.bits in (4, 8)
        and layer.get("biases") is not None
        and getattr(layer, "global_scale", None) is None
    ):
        return layer.bits, [layer.weight, layer.scales, layer.biases]
    return None


def kernel_plan(x, inds, switch_mlp) -> Optional[tuple]:
    """(bits, gate, up, down weight lists) when the kernel applies, else None.

    ``switch_mlp``: a ``SwitchGLU`` (or a subclass that keeps its
    computation, such as ``mlx_spec.models.fast_layers.FastSwitchGLU``) with the
    SwiGLU activation and no biases.
    """
    if not isinstance(switch_mlp, SwitchGLU) or not isinstance(
        switch_mlp.activation, SwiGLU
    ):
        return None
    parts = [_weights(switch_mlp.gate_proj), _weights(switch_mlp.up_proj)]
    parts.append(_weights(switch_mlp.down_proj))
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    M = x.size // x.shape[-1]
    if not (1 <= M <= MAX_TOKENS) or x.dtype not in (
        mx.float16,
        mx.bfloat16,
        mx.float32,
    ):
        return None
    if inds.shape[:-1] != x.shape[:-1]:
        return None
    return (parts[0][0], parts[0][1], parts[1][1], parts[2][1])


def route(inds: mx.array, num_experts: int):
    """The (token, expert) pairs sorted by expert, with MLX ops (no sync).

    inds: [..., K]. Returns order [P] (pair ids ``m * K + k`` in expert
    order), sorted_e [P] (their experts) and starts [min(P, E)] (the sorted
    position where each run of one expert starts, -1 past the last run).
    """
    flat = inds.reshape(-1).astype(mx.int32)
    P = flat.size
    order = mx.argsort(flat).astype(mx.int32)
    sorted_e = flat[order]
    prev = mx.concatenate([mx.array([-1], mx.int32), sorted_e[:-1]])
    is_start = sorted_e != prev
    n = min(P, num_experts)
    run = mx.cumsum(is_start.astype(mx.int32)) - 1
    dest = mx.where(is_start, run, n)  # non-starts land in a spare slot
    starts = mx.full((n + 1,), -1, mx.int32)
    starts[dest] = mx.arange(P, dtype=mx.int32)
    return order, sorted_e, starts[:n]


def experts_kernel(x, inds, plan) -> mx.array:
    """The two launches. x: [..., H]; inds: [..., K]; ``plan`` from
    ``kernel_plan``. Returns [..., K, H] in x's dtype (as ``SwitchGLU``)."""
    bits, gate, up, down = plan
    H, K = x.shape[-1], inds.shape[-1]
    M = x.size // H
    I = gate[0].shape[1]
    P = M * K
    E = gate[0].shape[0]
    order, sorted_e, starts = route(inds, E)
    xm = x.reshape(M, H)
    st = kernel_stream()

    def launch(gate_up: bool, rows, weights, IN, OUT):
        # rows: [M or P, IN] -> per-pair outputs [P, OUT] float32
        kernel = cached_kernel(
            ("moe1" if gate_up else "moe2", bits),
            lambda: _make_matvec(gate_up, bits),
        )
        (out,) = kernel(
            inputs=[rows, order, sorted_e, starts, *weights],
            template=[("IN", IN), ("OUT", OUT), ("K", K), ("P", P), ("MT", M)]
            + [("NSG", NSG), ("RS", RS)],
            grid=(32 * NSG, -(-OUT // (NSG * RS)), starts.size),
            threadgroup=(32 * NSG, 1, 1),
            output_shapes=[(P, OUT)],
            output_dtypes=[mx.float32],
            stream=st,
        )
        return out

    h = launch(True, xm, [*gate, *up], H, I)  # silu(gate) * up per pair
    yp = launch(False, h, down, I, H)
    return yp.reshape(*inds.shape, H).astype(x.dtype)


def moe_kernel(x, inds, scores, plan) -> mx.array:
    """``experts_kernel`` then mlx-lm's weighted sum (what ``bench-kernels``
    times against ``moe_reference``). Returns [..., H] in x's dtype."""
    return weighted_sum(experts_kernel(x, inds, plan), scores)


def moe_experts(x: mx.array, inds: mx.array, switch_mlp) -> mx.array:
    """``switch_mlp(x, inds)`` of few tokens: the kernel where the switch
    allows it, else ``SwitchGLU.__call__`` (``experts_reference``).

    x: [..., H]; inds (expert ids): [..., K]. Returns [..., K, H], the
    output of each (token, expert) pair, in x's dtype.
    """

    def reference():
        return experts_reference(x, inds, switch_mlp)

    plan = kernel_plan(x, inds, switch_mlp)
    if plan is None:
        return reference()
    M = x.size // x.shape[-1]
    I = plan[1][0].shape[1]
    family = (x.shape[-1], I, inds.shape[-1], plan[0], x.dtype, plan[1][0].dtype)
    return dispatch(
        "moe",
        lambda: experts_kernel(x, inds, plan),
        reference,
        probe_key=family + (M,),
        family=family,
        decide=lambda: faster_on_family(x, inds, switch_mlp, plan, (1, 4, 8)),
    )


def faster_on_family(x, inds, switch_mlp, plan, Ms) -> bool:
    """The ``auto`` decision for this layer's experts: is the kernel faster
    in total over ``M`` tokens in ``Ms`` with random routing?"""
    H, K = x.shape[-1], inds.shape[-1]
    E = plan[1][0].shape[0]
    kernel_t = reference_t = 0.0
    for M in Ms:
        xs = mx.random.normal((1, M, H)).astype(x.dtype)
        logits = mx.random.normal((1, M, E))
        ids = mx.argpartition(logits, kth=-K, axis=-1)[..., -K:]
        mx.eval(xs, ids)
        kernel_t += time_call(lambda: experts_kernel(xs, ids, plan), 1, 3)
        reference_t += time_call(lambda: experts_reference(xs, ids, switch_mlp), 1, 3)
    return kernel_t < reference_t
