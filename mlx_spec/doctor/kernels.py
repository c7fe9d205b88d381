"""The doctor's kernels part, on the loaded model's own shapes.

Everywhere: each MLX reference path the kernel switch falls back to
(``mlx_spec.kernels``: the GDN recurrence token by token, MLX's attention,
the MTP head's attention over its float16 cache, mlx-lm's experts) is
compared with an independent computation of the same thing (mlx-lm's
whole-block GDN update, attention written out in float32, each expert's
matrices applied one token at a time), so a broken reference is reported,
not trusted.

Where Metal exists, each kernel then runs on the same inputs: its largest
error against the reference (the GDN kernel is designed to be bitwise equal
to mlx-lm's; the report says whether it was), and both timed, with the
choice the switch's ``auto`` would make (the faster). Without Metal the part
is skipped, naming the reference paths in use.
"""

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..kernels import attention as attn
from ..kernels import gated_delta as gdn
from ..kernels import moe
from ..kernels.switch import metal_available, time_call
from ..mlx_lm_compat import (
    Qwen3NextAttention,
    Qwen3NextSparseMoeBlock,
    compute_g,
    gated_delta_update,
    normalize_qk,
)
from ..models.mtp.head import text_args, text_model
from .result import FAIL, PASS, SKIP, Part, one_line

# The reference each kernel's dispatcher falls back to, as named in the report.
REFERENCES = {
    "gdn": "mlx_spec.kernels.gated_delta.gated_delta_steps_reference",
    "attention": "mlx_spec.kernels.attention.attention_reference",
    "mtp_attention": "mlx_spec.kernels.attention.mtp_attention_reference",
    "moe": "mlx_spec.kernels.moe.moe_reference",
}
# Largest relative error (to the largest magnitude) accepted, by dtype.
TOLERANCE = {mx.float32: 1e-4, mx.float16: 5e-3, mx.bfloat16: 3e-2}


def _tolerance(dtype) -> float:
    return TOLERANCE.get(dtype, 3e-2)


def relative_error(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    scale = max(mx.max(mx.abs(b)).item(), 1e-30)
    return mx.max(mx.abs(a - b)).item() / scale


class Case:
    """One kernel on the model's shapes: the reference, an independent
    computation of it, and (where it applies) the kernel."""

    def __init__(self, name, label, dtype, reference, independent, kernel=None):
        self.name, self.label, self.dtype = name, label, dtype
        self.reference: Callable[[], mx.array] = reference
        self.independent: Callable[[], mx.array] = independent
        self.kernel: Optional[Callable[[], mx.array]] = kernel


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _gdn_case(args, dtype, T: int) -> Case:
    Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
    Dk, Dv = args.linear_key_head_dim, args.linear_value_head_dim
    q = mx.random.normal((1, T, Hk, Dk)).astype(dtype)
    k = mx.random.normal((1, T, Hk, Dk)).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv)).astype(dtype)
    a = mx.random.normal((1, T, Hv)).astype(dtype)
    b = mx.random.normal((1, T, Hv)).astype(dtype)
    A_log, dt_bias = mx.random.normal((Hv,)), mx.random.normal((Hv,))
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk))
    mx.eval(q, k, v, a, b, A_log, dt_bias, state)

    def reference():
        y, states = gdn.gated_delta_steps_reference(
            q, k, v, a, b, A_log, dt_bias, state
        )
        return mx.concatenate([y.reshape(-1), states[-1].reshape(-1)])

    def independent():  # mlx-lm's update over the whole block at once
        y, final = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
        return mx.concatenate([y.reshape(-1), final.reshape(-1)])

    kernel = None
    if gdn.kernel_supported(q, v, state, None):

        def run_kernel():
            g = compute_g(A_log, a, dt_bias)
            y, states = gdn.gated_delta_steps_kernel(q, k, v, g, mx.sigmoid(b), state)
            return mx.concatenate([y.reshape(-1), states[-1].reshape(-1)])

        kernel = run_kernel

    label = f"T{T} Hk{Hk} Hv{Hv} Dk{Dk} Dv{Dv}"
    return Case("gdn", label, dtype, reference, independent, kernel)


def _attention_written_out(q, k, v, scale):
    """Causal attention of the last T positions in float32, GQA by repeat."""
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    T, N = q.shape[2], k.shape[2]
    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    visible = mx.arange(N)[None] <= (N - T + mx.arange(T))[:, None]
    scores = mx.where(visible, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ v


def _attention_case(name, args, dtype, T: int, N: int) -> Case:
    Hq, Hkv = args.num_attention_heads, args.num_key_value_heads
    D = getattr(args, "head_dim", None) or args.hidden_size // Hq
    kv_dtype = mx.float16 if name == "mtp_attention" else dtype
    q = mx.random.normal((1, Hq, T, D)).astype(dtype)
    k = mx.random.normal((1, Hkv, N, D)).astype(kv_dtype)
    v = mx.random.normal((1, Hkv, N, D)).astype(kv_dtype)
    mx.eval(q, k, v)
    scale = D**-0.5
    mask = "causal" if T > 1 else None
    ref = attn.mtp_attention_reference if name == "mtp_attention" else None
    ref = ref or attn.attention_reference
    kernel = None
    if attn.kernel_supported(q, k, v, mask):

        def run_kernel():
            return attn.attention_kernel(q, k, v, scale)

        kernel = run_kernel

    return Case(
        name,
        f"T{T} N{N} Hq{Hq} Hkv{Hkv} D{D}",
        dtype,
        lambda: ref(q, k, v, scale, mask),
        lambda: _attention_written_out(q, k, v, scale),
        kernel,
    )


def _expert_matrix(layer, e: int) -> mx.array:
    """Expert ``e``'s [out, in] matrix of a (quantised) switch linear."""
    if hasattr(layer, "scales"):
        return mx.dequantize(
            layer.weight[e],
            layer.scales[e],
            layer.get("biases")[e] if layer.get("biases") is not None else None,
            group_size=layer.group_size,
            bits=layer.bits,
        )
    return layer.weight[e]


def _experts_one_by_one(sw, x, inds, scores):
    """The routed experts token by token, expert by expert (SwiGLU)."""
    rows = []
    for t in range(x.shape[1]):
        out = 0
        for j in range(inds.shape[-1]):
            e = inds[0, t, j].item()
            xt = x[0, t].astype(mx.float32)
            gate = _expert_matrix(sw.gate_proj, e).astype(mx.float32) @ xt
            up = _expert_matrix(sw.up_proj, e).astype(mx.float32) @ xt
            down = _expert_matrix(sw.down_proj, e).astype(mx.float32)
            out = out + scores[0, t, j].astype(mx.float32) * (
                down @ (nn.silu(gate) * up)
            )
        rows.append(out)
    return mx.stack(rows)[None]


def _moe_case(model, dtype, T: int) -> Optional[Case]:
    block = next(
        (m for m in model.modules() if isinstance(m, Qwen3NextSparseMoeBlock)), None
    )
    if block is None:
        return None
    sw = block.switch_mlp
    E, H = sw.gate_proj.weight.shape[0], text_args(model).hidden_size
    K = min(getattr(text_args(model), "num_experts_per_tok", 2), E)
    dtype = sw.down_proj.scales.dtype if hasattr(sw.down_proj, "scales") else dtype
    x = mx.random.normal((1, T, H)).astype(dtype)
    logits = mx.random.normal((1, T, E))
    inds = mx.argpartition(logits, kth=-K, axis=-1)[..., -K:]
    scores = mx.softmax(mx.take_along_axis(logits, inds, -1), -1).astype(dtype)
    mx.eval(x, inds, scores)
    plan = moe.kernel_plan(x, inds, sw)
    kernel = None
    if plan is not None:

        def run_kernel():
            return moe.moe_kernel(x, inds, scores, plan)

        kernel = run_kernel

    return Case(
        "moe",
        f"T{T} H{H} E{E} K{K} (the model's first MoE layer)",
        dtype,
        lambda: moe.moe_reference(x, inds, scores, sw),
        lambda: _experts_one_by_one(sw, x, inds, scores),
        kernel,
    )


def model_cases(model, quick: bool) -> List[Case]:
    """The kernels' cases on ``model``'s shapes, for the layers that run
    through them (GDN, Qwen3-Next attention and MoE blocks, the MTP head):
    a verify pass of 4 tokens; without ``quick`` also 9 tokens and a longer
    cache."""
    args = text_args(model)
    embed = text_model(model).model.embed_tokens
    dtype = getattr(embed, "scales", getattr(embed, "weight", None)).dtype
    mx.random.seed(0)
    Ts = (4,) if quick else (4, 9)
    N = 256 if quick else 2048
    layers = text_model(model).model.layers
    gdn_layers = any(hasattr(layer, "linear_attn") for layer in layers)
    attention = any(isinstance(m, Qwen3NextAttention) for m in model.modules())
    cases = []
    for T in Ts:
        if gdn_layers:
            cases.append(_gdn_case(args, dtype, T))
        if attention:
            cases.append(_attention_case("attention", args, dtype, T, N))
        moe_case = _moe_case(model, dtype, T)
        if moe_case is not None:
            cases.append(moe_case)
    if getattr(model, "__dict__", {}).get("mtp_head") is not None:
        cases.append(_attention_case("mtp_attention", args, dtype, 1, N))
    return cases


def _check_reference(part: Part, case: Case) -> Dict:
    error = relative_error(case.reference(), case.independent())
    ok = error <= _tolerance(case.dtype)
    part.check(
        f"{case.name} reference {case.label}",
        PASS if ok else FAIL,
        f"{REFERENCES[case.name]} against an independent computation: relative "
        f"error {error:.2e} ({'within' if ok else 'beyond'} "
        f"{_tolerance(case.dtype):.0e})",
    )
    return {"reference_error": error, "reference_ok": ok}


def _check_kernel(part: Part, case: Case) -> Dict:
    name = f"{case.name} kernel {case.label}"
    if case.kernel is None:
        part.check(name, SKIP, "the kernel does not apply to these shapes")
        return {"kernel_applies": False}
    reference, kernel = case.reference(), case.kernel()
    error = relative_error(_first(kernel), reference)
    bitwise = bool(mx.array_equal(_first(kernel), reference).item())
    ref_s, ker_s = time_call(case.reference, 1, 5), time_call(case.kernel, 1, 5)
    auto = "kernel" if ker_s < ref_s else "reference"
    ok = error <= _tolerance(case.dtype)
    note = ""
    if case.name == "gdn" and not bitwise:
        note = "; NOT bitwise equal to mlx-lm's path, which the design expects"
    part.check(
        name,
        PASS if ok else FAIL,
        f"relative error {error:.2e}{', bitwise equal' if bitwise else ''}{note}; "
        f"{ker_s * 1e3:.3f} ms against {ref_s * 1e3:.3f} ms: auto uses the {auto}",
    )
    return {
        "kernel_applies": True,
        "kernel_error": error,
        "bitwise": bitwise,
        "kernel_ms": ker_s * 1e3,
        "reference_ms": ref_s * 1e3,
        "auto_choice": auto,
    }


def check_kernels(part: Part, model, quick: bool) -> Tuple[Part, Optional[bool]]:
    """Fill ``part``; also whether kernels help here (None: no Metal)."""
    metal = metal_available()
    part.facts["metal"] = metal
    part.facts["references"] = dict(REFERENCES)
    results = []
    cases = model_cases(model, quick)
    if not cases:
        part.status = SKIP
        part.reason = (
            f"skipped: no layer of this model ({getattr(model, 'model_type', '?')}) "
            "runs through mlx-spec's kernels (Qwen3-Next / Qwen3.5 layers only)"
        )
        return part, None
    for case in cases:
        row = {"kernel": case.name, "shape": case.label}
        try:
            row.update(_check_reference(part, case))
            if metal:
                row.update(_check_kernel(part, case))
        except Exception as e:  # one case's failure is that case's verdict
            part.check(f"{case.name} {case.label}", FAIL, one_line(e))
        results.append(row)
    part.facts["cases"] = results
    if metal:
        chosen = [r.get("auto_choice") == "kernel" for r in results]
        part.settle(
            f"{sum(chosen)} of {len(chosen)} kernel cases faster than their "
            "references on this machine"
        )
        return part, any(chosen)
    part.settle("")
    if part.status != FAIL:
        prefix = "mlx_spec.kernels."
        used = sorted({REFERENCES[r["kernel"]][len(prefix) :] for r in results})
        part.status = SKIP
        part.reason = (
            f"skipped: no Metal; the MLX reference paths run ({prefix[:-1]}: "
            f"{', '.join(used)}), each checked against an independent computation"
        )
    return part, None
