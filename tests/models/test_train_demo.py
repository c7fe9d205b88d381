"""The demo-model training scripts (scripts/train_demo/): pieces and a tiny end-to-end run."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts" / "train_demo"
sys.path.insert(0, str(SCRIPTS))

from chunked_gdn import (  # noqa: E402
    ShiftConv1d,
    chunked_gated_delta,
    chunked_gated_delta_update,
    chunked_gdn,
    log_decay,
)
from demo_config import get_config  # noqa: E402

import mlx_spec  # noqa: E402
from mlx_spec.testing.checkpoints import tensor_shapes  # noqa: E402


def _gdn_inputs(B=2, T=45, Hk=2, Hv=4, Dk=16, Dv=8, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv))
    b = 2.0 * mx.random.normal((B, T, Hv))
    A_log = mx.log(mx.random.uniform(0.5, 16.0, (Hv,)))
    dt_bias = mx.ones(Hv)
    state = 0.3 * mx.random.normal((B, Hv, Dv, Dk))
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_gdn_matches_recurrent_ops(chunk):
    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs()
    g, beta = compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(
        q, k, v, log_decay(a, A_log, dt_bias), beta, state, chunk=chunk
    )
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert mx.abs(y - y_ref).max().item() < 1e-4
    assert mx.abs(s - s_ref).max().item() < 1e-4
    # zero initial state (the training case)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, None)
    y, s = chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, chunk=chunk)
    assert mx.abs(y - y_ref).max().item() < 1e-4
    assert mx.abs(s - s_ref).max().item() < 1e-4


def test_chunked_gdn_gradients_match_recurrent_ops():
    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs(T=21)

    def ref(q, k, v, a, b):
        y, s = gated_delta_ops(
            q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state
        )
        return (y**2).sum() + s.sum()

    def chunked(q, k, v, a, b):
        y, s = chunked_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, chunk=8)
        return (y**2).sum() + s.sum()

    args = (q, k, v, a, b)
    g_ref = mx.grad(ref, argnums=tuple(range(5)))(*args)
    g_new = mx.grad(chunked, argnums=tuple(range(5)))(*args)
    for x, y in zip(g_ref, g_new):
        assert mx.abs(x - y).max().item() < 1e-4


def test_shift_conv_matches_conv1d():
    conv = nn.Conv1d(24, 24, 4, groups=24, bias=False)
    x = mx.random.normal((2, 13, 24))
    ref = conv(x)
    conv.__class__ = ShiftConv1d
    assert mx.abs(conv(x) - ref).max().item() < 1e-6


def test_training_forward_matches_mlx_lm_forward():
    from demo_train import build_target

    cfg = get_config("tiny")
    model = build_target(cfg, 511)
    mx.eval(model.parameters())
    x = mx.array(np.random.default_rng(0).integers(0, 511, (2, 37)).astype(np.int32))
    ref = model(x)
    model.train()
    with chunked_gdn(8, model):
        got = model(x)
    types = {
        type(layer.linear_attn.conv1d) for layer in model.layers if layer.is_linear
    }
    assert types == {nn.Conv1d}  # restored on exit
    assert mx.abs(got - ref).max().item() < 1e-4


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    import build_demo as build

    root = tmp_path_factory.mktemp("train_demo")
    work, out = root / "work", root / "out"
    results = build.run("tiny", work, out)
    return work, out, results


def test_tiny_build_end_to_end(tiny_build):
    work, out, results = tiny_build
    corpus = json.loads((work / "corpus.json").read_text())
    assert corpus["python_version"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert len(corpus["file_list_sha256"]) == 64
    assert corpus["eval_files"] and not set(corpus["eval_files"]) & set(
        corpus["train_files"]
    )
    assert corpus["eos_token_id"] == corpus["vocab_size"] - 1
    assert corpus["round_trip_failures"] == 0
    for stage in ("target", "mtp"):
        assert np.isfinite(results[stage]["train_seconds"])
    check = results["export"]["check"]
    assert check["target_argmax_agreement"] == 1.0
    assert check["mtp_argmax_agreement"] == 1.0
    assert check["target_logits_max_abs_diff"] < 1e-4
    assert check["mtp_logits_max_abs_diff"] < 1e-4
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file()
    assert (out / "tokenizer_config.json").is_file()


def test_tiny_export_is_the_raw_qwen3_next_layout(tiny_build):
    _, out, _ = tiny_build
    cfg = get_config("tiny")
    dims = {
        k: getattr(cfg, k)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "vocab_size",
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        )
    }
    want = tensor_shapes("qwen3_next", **dims)
    got = {
        k: tuple(v.shape) for k, v in mx.load(str(out / "model.safetensors")).items()
    }
    assert got == want
    _, meta = mx.load(str(out / "model.safetensors"), return_metadata=True)
    assert meta.get("format") == "pt"


def test_tiny_export_stores_norms_zero_centred(tiny_build):
    work, out, _ = tiny_build
    trained = mx.load(str(work / "target.safetensors"))
    head = mx.load(str(work / "mtp_head.safetensors"))
    raw = mx.load(str(out / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert mx.allclose(raw[name] + 1.0, trained[name], atol=1e-6)
    gdn_norm = "model.layers.0.linear_attn.norm.weight"
    assert mx.array_equal(raw[gdn_norm], trained[gdn_norm])
    for name in ("pre_fc_norm_embedding.weight", "norm.weight"):
        assert mx.allclose(raw["mtp." + name] + 1.0, head[name], atol=1e-6)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert mx.array_equal(raw[conv], trained[conv].moveaxis(2, 1))


def test_tiny_export_loads_and_generates(tiny_build):
    _, out, _ = tiny_build
    model, tok = mlx_spec.load(out)
    assert model.mtp_head is not None
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text)) == text
    stats = mlx_spec.SpecStats()
    tokens = [
        r.token
        for r in mlx_spec.stream_generate(
            model, tok, "import os\n", max_tokens=6, draft="mtp", stats=stats
        )
    ]
    assert 1 <= len(tokens) <= 6 and stats.verify_passes > 0


def test_build_is_deterministic(tiny_build, tmp_path):
    import build_demo as build

    work, _, _ = tiny_build
    again = tmp_path / "work"
    build.run("tiny", again, tmp_path / "out", stages=("data", "target"))
    for name in ("tokenizer.json", "corpus.json"):
        assert (again / name).read_text() == (work / name).read_text()
    for name in ("train_tokens.npy", "eval_tokens.npy"):
        assert np.array_equal(np.load(again / name), np.load(work / name))
    a = mx.load(str(again / "target.safetensors"))
    b = mx.load(str(work / "target.safetensors"))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)


def test_stopped_and_resumed_training_equals_one_run(tiny_build, tmp_path):
    import build_demo as build

    work, _, _ = tiny_build
    again = tmp_path / "work"
    build.run("tiny", again, tmp_path / "out", stages=("data",))
    for stage in ("target", "mtp"):
        # stop after one step (3 and 2 in all), then run to the end
        r = build.run("tiny", again, tmp_path / "out", (stage,), stop_after=1)
        assert r[stage] is None
        assert json.loads((again / f"{stage}_ckpt.json").read_text())["step"] == 1
        build.run("tiny", again, tmp_path / "out", (stage,))
        meta = json.loads((again / f"{stage}_ckpt.json").read_text())
        assert meta["step"] == get_config("tiny").__dict__[f"{stage}_steps"]
    for name in ("target.safetensors", "mtp_head.safetensors"):
        a, b = mx.load(str(again / name)), mx.load(str(work / name))
        assert a.keys() == b.keys()
        assert all(mx.array_equal(a[k], b[k]) for k in a), name


def test_a_second_cycle_keeps_the_first_cycles_rates_and_warms_again():
    from demo_train import lr_schedule

    peak, warmup = 2e-3, 5
    one = lr_schedule(peak, warmup, (40,), 0.2)
    two = lr_schedule(peak, warmup, (40, 20), 0.2)
    rate = lambda s, i: s(mx.array(i)).item()  # noqa: E731
    assert all(rate(one, i) == pytest.approx(rate(two, i)) for i in range(41))
    assert rate(two, 40) == pytest.approx(peak * 0.1)  # where the decay ended
    assert rate(two, 45) == pytest.approx(peak)  # warmed up again
    assert rate(two, 60) == pytest.approx(peak * 0.1)  # decayed again
    assert rate(one, 45) == pytest.approx(peak * 0.1)  # control: one cycle stays low


def test_a_finished_run_extended_by_more_cycles_equals_one_run(tiny_build, tmp_path):
    """Resuming a finished target with ``target_extra_steps`` continues from its
    last step, twice, and ends with the weights of a run that trained the three
    cycles at once."""
    import shutil

    import build_demo as build

    work, _, _ = tiny_build
    extended = tmp_path / "extended"
    shutil.copytree(work, extended)
    for extra in (2, [2, 3]):
        build.run(
            "tiny", extended, tmp_path / "o1", ("target",), target_extra_steps=extra
        )
    log = [json.loads(line) for line in open(extended / "train_target.log.jsonl")]
    runs = [r for r in log if "from_step" in r]  # the log is appended to
    assert [(r["from_step"], r["steps"]) for r in runs] == [(0, 3), (3, 5), (5, 8)]
    straight = tmp_path / "straight"
    build.run(
        "tiny", straight, tmp_path / "o2", ("data", "target"), target_extra_steps=[2, 3]
    )
    a = mx.load(str(extended / "target.safetensors"))
    b = mx.load(str(straight / "target.safetensors"))
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    c = mx.load(str(work / "target.safetensors"))  # control: the 3-step target
    assert not all(mx.array_equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize(
    "field, value",
    [
        ("target_extra_steps", -5),
        ("mtp_extra_steps", [300, 0]),
        ("mtp_steps", 0),
        ("target_steps", 2.5),
    ],
)
def test_a_bad_training_budget_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **{field: value})
    good = get_config("tiny", **{field: 3}).__dict__[field]  # control
    assert good == ((3,) if field.endswith("extra_steps") else 3)


def test_extra_cycles_are_a_list_and_an_int_is_one_cycle():
    assert get_config("tiny", mtp_extra_steps=[300, 700]).mtp_extra_steps == (300, 700)
    assert get_config("tiny", mtp_extra_steps=300).mtp_extra_steps == (300,)
    assert get_config("tiny", mtp_extra_steps=0).mtp_extra_steps == ()


def test_repeated_share_counts_windows_seen_before():
    from evaluate import repeated_share

    assert repeated_share(list(range(40))) == 0.0
    # period 10: of the 25 windows of 16 tokens, those from index 10 on repeat
    assert repeated_share(list(range(10)) * 4) == 15 / 25


def test_loop_shares_tell_looping_code_from_plain_code(tiny_build):
    from evaluate import loop_shares

    _, out, _ = tiny_build
    model, tok = mlx_spec.load(out)
    plain = "def plain(a, b):\n" + "".join(
        f"    v{i} = a * {i} + b - {i * 7}\n" for i in range(8)
    )
    looping = "def looping(a):\n" + "    a = a + 1\n    a = a * 2\n" * 8
    held = {"plain.py": plain, "looping.py": looping + "\n"}
    res = loop_shares(model, tok, held, n=5, max_tokens=48)
    assert res["prompts"] == 2
    assert res["code"]["looping"] == 1
    assert 0.0 < res["code"]["mean_share"] < 1.0
    assert 0.0 <= res["model"]["mean_share"] <= 1.0
    assert 0 <= res["model"]["looping"] <= 2


@pytest.mark.parametrize("flag", ["--loop-prompts", "--prompts", "--copies"])
def test_evaluate_refuses_a_count_below_one_by_name(flag, capsys):
    from evaluate import main

    with pytest.raises(SystemExit):
        main([flag, "0"])
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err
