"""The few-token MoE expert kernel (mlx_spec.kernels.moe) run by the MSL harness.

Checks: against mlx-lm's ``SwitchGLU`` (the per-(token, expert) outputs
``[..., K, H]``, no weighted sum) on the real expert
dims (hidden 2048, expert width 512, top-10 for Qwen3-Next-80B-A3B, top-8 for
Qwen3.5-35B-A3B; fewer experts than the models have, to keep memory small)
and tiny odd shapes, for float and mlx affine 4/8-bit weights; a token's
result does not depend on the other tokens (bit for bit); unsupported
layers use the reference; ``FastSwitchGLU`` (the class ``enable_fast_layers``
gives an MoE block's ``SwitchGLU``) runs the kernel.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_spec.kernels import switch as kernels
from mlx_spec.kernels.moe import (
    experts_kernel,
    experts_reference,
    kernel_plan,
    moe_experts,
    moe_kernel,
    moe_reference,
)

from . import harness

# (M tokens, H, I, E, K, dtype, bits)
REAL = [
    (4, 2048, 512, 12, 10, mx.bfloat16, 4),
    (9, 2048, 512, 10, 8, mx.float16, 8),
    (1, 2048, 512, 10, 10, mx.float16, 0),
]
TINY = [
    (3, 40, 24, 5, 2, mx.float32, 0),
    (5, 64, 128, 7, 3, mx.float32, 4),
    (2, 128, 64, 4, 2, mx.float32, 8),
    (6, 64, 64, 3, 2, mx.float16, 4),  # every expert shared by many tokens
    (16, 24, 8, 3, 3, mx.float32, 0),  # all 16 tokens on all 3 experts
]


def rel_err(a, b) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def make_case(M, H, I, E, K, dtype, bits, seed=0):
    """(layer, float32 layer with the same (dequantised) weights, x, inds, scores)."""
    mx.random.seed(seed)
    sw = SwitchGLU(H, I, E)
    sw.set_dtype(dtype)
    exact = SwitchGLU(H, I, E)
    exact.update(sw.parameters())
    if bits:
        nn.quantize(sw, group_size=64, bits=bits)
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(sw, name)
            w = mx.dequantize(q.weight, q.scales, q.biases, 64, bits)
            getattr(exact, name).weight = w
    exact.set_dtype(mx.float32)
    x = mx.random.normal((1, M, H)).astype(dtype)
    logits = mx.random.normal((1, M, E))
    inds = mx.argpartition(logits, kth=-K, axis=-1)[..., -K:]
    scores = mx.softmax(mx.take_along_axis(logits, inds, -1), -1).astype(dtype)
    return sw, exact, x, inds, scores


def on_harness(fn, *args):
    with harness.use_harness(), kernels.use_mode("on"):
        out = fn(*args)
        mx.eval(out)
    return out


@pytest.mark.parametrize("case", REAL + TINY)
@pytest.mark.slow
def test_matches_reference(case):
    sw, exact, x, inds, scores = make_case(*case)
    dtype = case[5]
    assert kernel_plan(x, inds, sw) is not None
    out = on_harness(moe_experts, x, inds, sw)
    assert out.shape == inds.shape + (x.shape[-1],) and out.dtype == dtype
    if dtype == mx.float32:
        assert rel_err(out, experts_reference(x, inds, sw)) < 1e-5
    else:
        # against the exact answer for these weights and inputs
        want = experts_reference(x.astype(mx.float32), inds, exact)
        assert rel_err(out, want) < (1e-3 if dtype == mx.float16 else 1e-2)
    if case == TINY[0]:  # the bench pair: + mlx-lm's weighted sum
        plan = kernel_plan(x, inds, sw)
        y = on_harness(moe_kernel, x, inds, scores, plan)
        assert rel_err(y, moe_reference(x, inds, scores, sw)) < 1e-5


def test_tokens_do_not_depend_on_each_other():
    sw, _, x, inds, scores = make_case(5, 64, 64, 3, 2, mx.float16, 4, seed=3)
    plan = kernel_plan(x, inds, sw)
    with harness.use_harness():
        full = experts_kernel(x, inds, plan)
        for m in range(x.shape[1]):
            sl = slice(m, m + 1)
            one = experts_kernel(x[:, sl], inds[:, sl], plan)
            assert mx.array_equal(one[:, 0], full[:, m]), m


def test_fast_switch_glu_runs_the_kernel(monkeypatch):
    from mlx_spec.kernels import moe
    from mlx_spec.models.fast_layers import FastSwitchGLU

    sw, _, x, inds, _ = make_case(3, 40, 24, 5, 2, mx.float32, 0, seed=4)
    want = experts_reference(x, inds, sw)
    sw.__class__ = FastSwitchGLU
    launches = []

    def counting(*args):
        launches.append(1)
        return experts_kernel(*args)

    monkeypatch.setattr(moe, "experts_kernel", counting)
    out = on_harness(sw, x, inds)
    assert launches and rel_err(out, want) < 1e-5
    with kernels.use_mode("off"):
        assert mx.array_equal(sw(x, inds), want)
    assert len(launches) == 1


def test_unsupported_layers_use_the_reference():
    sw, _, x, inds, scores = make_case(3, 64, 64, 4, 2, mx.float32, 0)
    with_bias = SwitchGLU(64, 64, 4, bias=True)
    g32 = SwitchGLU(64, 64, 4)
    nn.quantize(g32, group_size=32, bits=4)
    many = mx.random.normal((1, 17, 64))
    many_inds = mx.zeros((1, 17, 2), dtype=mx.int32) + mx.array([0, 1])
    for layer, args in [
        (with_bias, (x, inds)),
        (g32, (x, inds)),
        (sw, (many, many_inds)),
    ]:
        assert kernel_plan(args[0], args[1], layer) is None
        out = on_harness(moe_experts, *args, layer)
        assert mx.array_equal(out, experts_reference(*args, layer))
