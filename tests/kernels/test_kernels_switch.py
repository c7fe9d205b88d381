"""The MLX_SPEC_KERNELS switch, the references and the layer wiring (no Metal).

* the switch: modes, one warning without Metal, fallback with one warning
  when a kernel fails, the ``auto`` decision cached per family;
* each reference equals the mlx-lm path it replaces;
* ``enable_fast_layers`` (``FastAttention`` and ``FastSwitchGLU`` swapped in
  for mlx_spec's models only): layers compute exactly what mlx-lm's do, bit
  for bit, and models mlx_spec did not load are untouched;
* generation with ``MLX_SPEC_KERNELS=on`` on this machine (no Metal) warns
  once and gives mlx-lm's tokens;
* ``mlx_spec bench-kernels`` without Metal times the references.
"""

import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models import gated_delta as gd
from mlx_lm.models import qwen3_next
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_spec.commands import bench_kernels
from mlx_spec.kernels import switch as kernels
from mlx_spec.kernels.attention import (
    attention_reference,
    mtp_attention_reference,
    verify_attention,
)
from mlx_spec.kernels.gated_delta import gated_delta_steps, gated_delta_steps_reference
from mlx_spec.kernels.moe import experts_reference, moe_experts, moe_reference
from mlx_spec.models import fast_layers
from mlx_spec.models.fast_layers import FastAttention, FastSwitchGLU, enable_fast_layers
from mlx_spec.testing.reference import OracleDrafter, reference_tokens, spec_tokens

pytestmark = pytest.mark.skipif(
    mx.metal.is_available(), reason="checks the behaviour without Metal"
)


def kernel_warnings(record):
    return [w for w in record if issubclass(w.category, kernels.KernelWarning)]


def gdn_inputs(B=1, T=3, Hk=2, Hv=4, Dk=32, Dv=16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = gd.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    return q, k, v, a, b, mx.random.normal((Hv,)), mx.random.normal((Hv,)), None


def test_mode_parsing(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.mode() == "auto"
    monkeypatch.setenv(kernels.ENV, " ON ")
    assert kernels.mode() == "on"
    with kernels.use_mode("off"):
        assert kernels.mode() == "off"
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.warns(kernels.KernelWarning, match="not one of"):
        assert kernels.mode() == "auto"
    with pytest.raises(ValueError):
        with kernels.use_mode("maybe"):
            pass


def test_on_without_metal_warns_once_and_uses_references(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "on")
    args = gdn_inputs()
    q = mx.random.normal((1, 4, 3, 64))
    k = v = mx.random.normal((1, 2, 10, 64))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            y, states = gated_delta_steps(*args)
            out = verify_attention(q, k, v, 0.125, "causal")
    assert len(kernel_warnings(record)) == 1
    assert "no Metal" in str(kernel_warnings(record)[0].message)
    y_ref, states_ref = gated_delta_steps_reference(*args)
    assert isinstance(states, list) and mx.array_equal(y, y_ref)
    assert all(mx.array_equal(s, r) for s, r in zip(states, states_ref))
    assert mx.array_equal(out, attention_reference(q, k, v, 0.125, "causal"))


@pytest.mark.parametrize("value", ["auto", "off"])
def test_auto_and_off_without_metal_are_silent(monkeypatch, value):
    monkeypatch.setenv(kernels.ENV, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        gated_delta_steps(*gdn_inputs())
    assert not kernel_warnings(record)


def test_launch_failure_falls_back_with_one_warning(monkeypatch):
    """Metal claimed but absent: every launch raises; each kernel warns once."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    args = gdn_inputs()
    q = mx.random.normal((1, 4, 3, 64))
    k = v = mx.random.normal((1, 2, 10, 64))
    with kernels.use_mode("on"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            y, _ = gated_delta_steps(*args)
            out = verify_attention(q, k, v, 0.125, "causal")
    got = kernel_warnings(record)
    assert len(got) == 2 and all("failed" in str(w.message) for w in got)
    assert mx.array_equal(y, gated_delta_steps_reference(*args)[0])
    assert mx.array_equal(out, attention_reference(q, k, v, 0.125, "causal"))


def test_auto_decision_is_cached_per_family(monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    calls = []

    def decide():
        calls.append(1)
        return False

    with kernels.use_mode("auto"):
        for probe in range(3):  # e.g. three values of T, one family
            out = kernels.dispatch(
                "fake",
                lambda: mx.array(1),
                lambda: mx.array(2),
                probe_key=probe,
                family="dims",
                decide=decide,
            )
            assert out.item() == 2
    assert len(calls) == 1
    with kernels.use_mode("auto"):
        fast = kernels.dispatch(
            "fake2", lambda: mx.array(1), lambda: mx.array(2), "p", decide=lambda: True
        )
    assert fast.item() == 1


def test_gdn_reference_equals_gated_delta_update():
    args = gdn_inputs(B=2, T=5)
    y, states = gated_delta_steps_reference(*args)
    y_all, final = gd.gated_delta_update(*args)
    assert mx.array_equal(y, y_all) and mx.array_equal(states[-1], final)


@pytest.mark.parametrize("T,N", [(1, 17), (4, 30), (9, 9)])
def test_attention_references_equal_mlx_lm(T, N):
    mx.random.seed(1)
    q = mx.random.normal((1, 8, T, 64)).astype(mx.float16)
    cache = KVCache()
    if N > T:  # earlier positions
        cache.update_and_fetch(
            mx.random.normal((1, 2, N - T, 64)).astype(mx.float16),
            mx.random.normal((1, 2, N - T, 64)).astype(mx.float16),
        )
    k, v = cache.update_and_fetch(
        mx.random.normal((1, 2, T, 64)).astype(mx.float16),
        mx.random.normal((1, 2, T, 64)).astype(mx.float16),
    )
    mask = create_attention_mask(q.transpose(0, 2, 1, 3), cache)
    assert mask == ("causal" if T > 1 else None)
    want = scaled_dot_product_attention(q, k, v, cache=cache, scale=0.125, mask=mask)
    assert mx.array_equal(attention_reference(q, k, v, 0.125, mask), want)
    for mode in ("off", "on", "auto"):  # no Metal: mlx-lm's function
        with kernels.use_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fast_layers.scaled_dot_product_attention(
                q, k, v, cache=cache, scale=0.125, mask=mask
            )
        assert mx.array_equal(got, want)
    # the causal rule: query t sees positions < N - T + t + 1
    pos = mx.arange(N)[None] < (N - T + mx.arange(T)[:, None] + 1)
    explicit = attention_reference(q, k, v, 0.125, pos)
    assert mx.allclose(explicit, want, atol=2e-3)
    # MTP: a float16 cache read in the head's float32
    q32 = q.astype(mx.float32)
    want32 = scaled_dot_product_attention(
        q32, k.astype(mx.float32), v.astype(mx.float32), None, 0.125, mask
    )
    assert mx.array_equal(mtp_attention_reference(q32, k, v, 0.125, mask), want32)


def tiny_args(**over):
    from mlx_lm.models.qwen3_next import ModelArgs

    from mlx_spec.testing.checkpoints import tiny_config

    cfg = tiny_config("qwen3_next", **over)
    cfg["model_type"] = "qwen3_next"
    return ModelArgs.from_dict(cfg)


def test_enable_fast_layers_hooks_without_copies():
    from mlx_spec.models.mtp.head import MTPHead

    args = tiny_args()
    tree = nn.Module()  # a stand-in module tree
    tree.layers = [Qwen3NextAttention(args), Qwen3NextSparseMoeBlock(args)]
    tree.other = SwitchGLU(8, 8, 2)  # not an MoE block's: left alone
    head = MTPHead(args, "qwen3_next")
    object.__setattr__(tree, "mtp_head", head)  # outside the tree, as attached
    assert enable_fast_layers(tree) == 4 and enable_fast_layers(tree) == 0
    assert type(tree.layers[1].switch_mlp) is FastSwitchGLU
    assert type(head.layers[0].mlp.switch_mlp) is FastSwitchGLU
    assert type(tree.other) is SwitchGLU
    assert type(tree.layers[0]) is FastAttention
    assert type(head.layers[0].self_attn) is FastAttention
    # mlx-lm's own code object, resolving the attention function to ours
    fast_call, plain_call = FastAttention.__call__, Qwen3NextAttention.__call__
    assert fast_call.__code__ is plain_call.__code__
    sdpa = fast_call.__globals__["scaled_dot_product_attention"]
    assert sdpa is fast_layers.scaled_dot_product_attention
    # and nothing of mlx-lm's module changed
    assert qwen3_next.scaled_dot_product_attention is scaled_dot_product_attention


def test_models_mlx_spec_did_not_load_stay_mlx_lm(checkpoint_dirs, models, family):
    """A model loaded by mlx-lm next to mlx_spec's runs exactly mlx-lm's code:
    no class of it is swapped and mlx-lm's modules are as imported."""
    import mlx_spec

    mlx_spec.load(checkpoint_dirs[family])
    plain, _ = mlx_lm.load(str(checkpoint_dirs[family]))
    ours = models[family][0]
    for module in plain.modules():
        assert not type(module).__module__.startswith("mlx_spec"), type(module)
    assert any(isinstance(m, FastAttention) for m in ours.modules())
    assert qwen3_next.scaled_dot_product_attention is scaled_dot_product_attention
    assert qwen3_next.Qwen3NextAttention.__call__.__globals__ is vars(qwen3_next)


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_fast_layers_equal_mlx_lm_layers(mode):
    """Bit for bit: attention (no cache, a KVCache, the MTP head's f16 cache)
    and the MoE block, with every mode (no Metal here)."""
    from mlx_spec.models.mtp.head import MTPKVCache

    args = tiny_args()
    mx.random.seed(2)
    attn, moe = Qwen3NextAttention(args), Qwen3NextSparseMoeBlock(args)
    plain_attn, plain_moe = Qwen3NextAttention(args), Qwen3NextSparseMoeBlock(args)
    plain_attn.update(attn.parameters())
    plain_moe.update(moe.parameters())
    tree = nn.Module()
    tree.layers = [attn, moe]
    enable_fast_layers(tree)
    x = mx.random.normal((1, 5, args.hidden_size))
    inds = mx.array([[[0, 1], [1, 2], [3, 3], [0, 2], [1, 0]]])
    with kernels.use_mode(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mx.array_equal(moe(x), plain_moe(x))
        y = moe.switch_mlp(x, inds)
        assert mx.array_equal(y, plain_moe.switch_mlp(x, inds))
        assert mx.array_equal(moe_experts(x, inds, moe.switch_mlp), y)
        assert type(attn) is FastAttention
        assert mx.array_equal(attn(x, "causal"), plain_attn(x, "causal"))
        for make in (KVCache, MTPKVCache):
            c1, c2 = make(), make()
            for xs, mask in ((x, "causal"), (x[:, :1], None), (x[:, :3], "causal")):
                want = plain_attn(xs, mask, c2)
                assert mx.array_equal(attn(xs, mask, c1), want)
    assert y.shape == (1, 5, 2, args.hidden_size)
    assert mx.array_equal(experts_reference(x, inds, moe.switch_mlp), y)
    scores = mx.full((1, 5, 2), 0.5)
    want = (y * scores[..., None]).sum(axis=-2)
    assert mx.array_equal(moe_reference(x, inds, scores, moe.switch_mlp), want)


def test_generation_with_kernels_on_without_metal(tmp_path, monkeypatch):
    import mlx_spec
    from mlx_spec.testing.checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_next", seed=0)
    plain_model, tokenizer = mlx_lm.load(str(path))
    model, _ = mlx_spec.load(path)
    enable_fast_layers(model)
    prompt = [1, 5, 9, 5, 9, 5, 9, 2]
    want = reference_tokens(plain_model, tokenizer, prompt, 24)
    monkeypatch.setenv(kernels.ENV, "on")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = spec_tokens(model, tokenizer, prompt, 24)
        drafter = OracleDrafter(prompt + want, error=0.3)
        got_oracle = spec_tokens(
            model, tokenizer, prompt, 24, draft=drafter, num_draft_tokens=4
        )
    assert got == want and got_oracle == want
    assert len(kernel_warnings(record)) == 1


def test_bench_kernels_without_metal(capsys):
    assert bench_kernels.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "timing the MLX reference paths only" in out and "BLAS" in out
    for name in ("gdn", "attention", "moe", "mtp_attention"):
        assert any(line.startswith(name + " ") for line in out.splitlines())
    # MLX's CPU gather_mm runs float32 only: the bfloat16 expert case is
    # reported as skipped, with the reason, and the command still succeeds
    bf16_moe = [l for l in out.splitlines() if l.startswith("moe ") and "bfloat16" in l]
    assert bf16_moe and "skipped, this device cannot run it" in bf16_moe[0]
    assert "float32" in bf16_moe[0]
