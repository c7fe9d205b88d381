"""Benchmark cases for ``mlx_spec bench-kernels``: real model shapes.

Shapes are those of Qwen3-Next-80B-A3B (docs/kernels.md): GDN
16 key / 32 value heads of dim 128; attention 16 query / 2 KV heads of dim
256; MoE hidden 2048, expert width 512, top-10. The MoE cases hold 64
experts, not 512, to keep the benchmark's memory small (the cost per distinct
expert is the same; random routing over 64 experts shares more experts
between tokens than routing over 512 would).
"""

from typing import Callable, Iterable, List, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_compat import SwitchGLU, compute_g, normalize_qk
from . import attention as attn
from . import gated_delta as gdn
from . import moe


def _dt(dtype) -> str:
    return str(dtype).split(".")[-1]


class BenchCase(NamedTuple):
    kernel_name: str
    label: str
    kernel: Callable[[], object]  # the raw kernel (no dispatcher)
    reference: Callable[[], object]  # the built-in MLX path it replaces


def _gdn_case(B, T, Hk, Hv, Dk, Dv, dtype) -> BenchCase:
    q = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk)).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    a = mx.random.normal((B, T, Hv)).astype(dtype)
    b = mx.random.normal((B, T, Hv)).astype(dtype)
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk))
    mx.eval(q, k, v, a, b, A_log, dt_bias, state)

    def kernel():
        g = compute_g(A_log, a, dt_bias)
        return gdn.gated_delta_steps_kernel(q, k, v, g, mx.sigmoid(b), state)

    def reference():
        return gdn.gated_delta_steps_reference(q, k, v, a, b, A_log, dt_bias, state)

    label = f"B{B} T{T} Hk{Hk} Hv{Hv} Dk{Dk} Dv{Dv} {_dt(dtype)}"
    return BenchCase("gdn", label, kernel, reference)


def _attn_case(name, B, Hq, Hkv, T, N, D, q_dtype, kv_dtype) -> BenchCase:
    cap = -(-N // 256) * 256  # a KVCache buffer, viewed to N positions
    q = mx.random.normal((B, Hq, T, D)).astype(q_dtype)
    kbuf = mx.random.normal((B, Hkv, cap, D)).astype(kv_dtype)
    vbuf = mx.random.normal((B, Hkv, cap, D)).astype(kv_dtype)
    mx.eval(q, kbuf, vbuf)
    k, v = kbuf[:, :, :N], vbuf[:, :, :N]
    mask = "causal" if T > 1 else None
    scale = D**-0.5
    ref = attn.mtp_attention_reference if name == "mtp_attention" else None
    ref = ref or attn.attention_reference
    label = f"Hq{Hq} Hkv{Hkv} T{T} N{N} D{D} {_dt(q_dtype)}/{_dt(kv_dtype)}"
    return BenchCase(
        name,
        label,
        lambda: attn.attention_kernel(q, k, v, scale),
        lambda: ref(q, k, v, scale, mask),
    )


def _moe_case(M, H, I, E, K, dtype, bits) -> BenchCase:
    sw = SwitchGLU(H, I, E)
    sw.set_dtype(dtype)
    if bits:
        nn.quantize(sw, group_size=64, bits=bits)
    x = mx.random.normal((1, M, H)).astype(dtype)
    logits = mx.random.normal((1, M, E))
    inds = mx.argpartition(logits, kth=-K, axis=-1)[..., -K:]
    scores = mx.softmax(mx.take_along_axis(logits, inds, -1), -1).astype(dtype)
    mx.eval(sw.parameters(), x, inds, scores)
    plan = moe.kernel_plan(x, inds, sw)
    distinct = len(set(inds.reshape(-1).tolist()))
    label = f"T{M} H{H} I{I} E{E} K{K} {f'{bits}-bit' if bits else _dt(dtype)}"
    label += f" ({distinct} distinct)"
    return BenchCase(
        "moe",
        label,
        lambda: moe.moe_kernel(x, inds, scores, plan),
        lambda: moe.moe_reference(x, inds, scores, sw),
    )


def _specs(quick: bool):
    bf16, f16 = mx.bfloat16, mx.float16
    if quick:
        yield "gdn", lambda: _gdn_case(1, 2, 2, 4, 32, 32, bf16)
        yield "attention", lambda: _attn_case(
            "attention", 1, 4, 2, 2, 40, 64, bf16, bf16
        )
        yield "moe", lambda: _moe_case(2, 64, 64, 4, 2, bf16, 4)
        yield "moe", lambda: _moe_case(2, 64, 64, 4, 2, bf16, 0)
        yield "mtp_attention", lambda: _attn_case(
            "mtp_attention", 1, 4, 2, 1, 40, 64, bf16, f16
        )
        return
    for T in (1, 4, 9):
        yield "gdn", lambda T=T: _gdn_case(1, T, 16, 32, 128, 128, bf16)
    for N in (1024, 4096):
        for T in (1, 4, 9):
            yield "attention", lambda T=T, N=N: _attn_case(
                "attention", 1, 16, 2, T, N, 256, bf16, bf16
            )
    for bits in (4, 0):
        for T in (1, 4, 9):
            yield "moe", lambda T=T, bits=bits: _moe_case(
                T, 2048, 512, 64, 10, bf16, bits
            )
    for N in (1024, 4096):
        yield "mtp_attention", lambda N=N: _attn_case(
            "mtp_attention", 1, 16, 2, 1, N, 256, bf16, f16
        )


def bench_cases(
    quick: bool = False, only: Optional[List[str]] = None
) -> Iterable[BenchCase]:
    """The cases, built lazily (one set of inputs alive at a time)."""
    mx.random.seed(0)
    for name, make in _specs(quick):
        if only is None or name in only:
            yield make()
