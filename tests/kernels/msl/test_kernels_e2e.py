"""All kernels together, in the harness: generation and ``bench-kernels``.

A tiny Qwen3-Next checkpoint with head_dim 64 (so every kernel applies:
GDN verify recurrence, verify attention, MoE experts, and the MTP head's
attention when it drafts) decodes with ``MLX_SPEC_KERNELS=on`` and
speculative verify passes of several tokens, and gives the tokens of plain
mlx-lm decoding. The layers are mlx-lm's own, hooked by
``enable_fast_layers`` (its attention dispatcher and ``FastSwitchGLU``); the
test counts the dispatcher calls and the kernel launches.
"""

import contextlib
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from mlx_spec.commands import bench_kernels
from mlx_spec.kernels import attention, gated_delta, moe
from mlx_spec.kernels import switch as kernels
from mlx_spec.models.fast_layers import enable_fast_layers
from mlx_spec.testing.reference import OracleDrafter, reference_tokens, spec_tokens

from . import harness


@contextlib.contextmanager
def harness_counting_launches():
    """``harness.use_harness()``, recording (kernel name, template) of every
    launch of a kernel built inside the block."""
    launches = []
    with harness.use_harness() as build:

        def counting_build(*args, **kwargs):
            kernel = build(*args, **kwargs)

            def launch(**kw):
                launches.append((kernel.name, dict(kw.get("template") or ())))
                return kernel(**kw)

            return launch

        mx.fast.metal_kernel = counting_build
        try:
            yield launches
        finally:
            mx.fast.metal_kernel = build


@pytest.mark.parametrize("draft", ["oracle", "mtp"])
def test_generation_with_all_kernels_matches_mlx_lm(tmp_path, monkeypatch, draft):
    import mlx_spec
    from mlx_spec.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_next", head_dim=64)
    plain, tokenizer = mlx_lm.load(str(path))
    model, _ = mlx_spec.load(path)
    enable_fast_layers(model)
    prompt = [3, 7, 11, 7, 11, 7]
    want = reference_tokens(plain, tokenizer, prompt, 10)

    calls = {}
    real_dispatch = kernels.dispatch

    def counting(name, *args, **kw):
        calls[name] = calls.get(name, 0) + 1
        return real_dispatch(name, *args, **kw)

    for module in (gated_delta, attention, moe):  # each calls the switch's dispatch
        monkeypatch.setattr(module, "dispatch", counting)

    drafter = OracleDrafter(prompt + want, error=0.3, seed=1)
    if draft == "mtp":  # the MTP head drafts: its attention over its f16 cache
        drafter = "mtp"
    with harness_counting_launches() as launches, kernels.use_mode("on"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", kernels.KernelWarning)
            got = spec_tokens(
                model, tokenizer, prompt, 10, draft=drafter, num_draft_tokens=3
            )
    assert got == want
    assert {"gdn", "attention", "moe"} <= set(calls)
    assert ("mtp_attention" in calls) == (draft == "mtp")
    assert all(("failed" not in str(k)) for k in kernels._warned)
    # the kernels ran: the GDN recurrence, the expert launches (no combine:
    # mlx-lm's MoE block forms the weighted sum), attention over the target's
    # float32 cache and, when the MTP head drafts, over its float16 rows
    names = {name for name, _ in launches}
    assert {"mlx_spec_moe_gate_up_f", "mlx_spec_moe_down_f"} <= names
    assert any(name.startswith("mlx_spec_gated_delta") for name in names), names
    assert not any("combine" in name and "moe" in name for name in names)
    kv = [t["KT"] for name, t in launches if name.startswith("mlx_spec_attention_")]
    assert mx.float32 in kv
    assert (mx.float16 in kv) == (draft == "mtp")
    for name, t in launches:
        if name.startswith("mlx_spec_attention_") and t.get("KT") == mx.float16:
            assert t["InT"] == mx.float32  # the head's dtype; f16 rows read as is


def test_bench_kernels_with_metal(capsys):
    with harness.use_harness():
        assert (
            bench_kernels.main(["--quick", "--kernel", "attention", "--kernel", "moe"])
            == 0
        )
    out = capsys.readouterr().out
    assert "Metal: yes" in out and "speedup" in out
    lines = [l for l in out.splitlines() if l.startswith(("attention ", "moe "))]
    # attention, 4-bit experts, bfloat16 experts: each is timed or, where
    # this device cannot run the reference (MLX's CPU gather_mm is float32
    # only), reported as skipped with the reason; never a crash
    assert len(lines) == 3, out
    timed = [l for l in lines if l.rstrip().endswith("x")]
    skipped = [l for l in lines if "skipped, this device cannot run it" in l]
    assert len(timed) + len(skipped) == 3 and len(timed) >= 2, out
    assert all("bfloat16 (3 distinct)" in l for l in skipped), skipped


def test_auto_mode_decides_once_per_family(monkeypatch):
    """``auto`` times kernel and reference on synthetic shapes of the family
    (the harness is slow, so here the references usually win) and keeps the
    decision; either way the result is the reference's or the kernel's."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_spec.kernels import attention as attn
    from mlx_spec.kernels.attention import attention_reference, verify_attention
    from mlx_spec.kernels.moe import experts_reference, moe_experts

    monkeypatch.setattr(attn, "AUTO_BENCH_N", 64)
    mx.random.seed(0)
    q = mx.random.normal((1, 4, 2, 64))
    k = v = mx.random.normal((1, 2, 9, 64))
    sw = SwitchGLU(64, 64, 4)
    nn.quantize(sw, group_size=64, bits=4)
    x = mx.random.normal((1, 2, 64))
    inds = mx.array([[[0, 1], [1, 2]]])
    with harness.use_harness(), kernels.use_mode("auto"):
        for _ in range(2):
            out = verify_attention(q, k, v, 0.125, "causal")
            y = moe_experts(x, inds, sw)
    assert {name for name, _ in kernels._decisions} == {"attention", "moe"}
    assert mx.allclose(out, attention_reference(q, k, v, 0.125, "causal"), atol=1e-5)
    assert mx.allclose(y, experts_reference(x, inds, sw), atol=1e-4)
