"""Every published MTP layout loads the same head, reported by load; broken
or foreign sidecars disable only the head; newer shapes; decoding with a
published head is lossless. The norm shift: test_mtp_norm_shift.py."""

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
from mlx_spec.mlx_lm_compat import dequantize_model
from mlx_spec.models.mtp import (
    MTPDisabledWarning,
    MTPWeightsError,
    build_head,
    find_mtp_weights,
)
from mlx_spec.models.mtp.head import text_args
from mlx_spec.models.mtp.weights import mtp_model_type
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.mtp_layouts import (
    target_copy,
    assert_same_bits,
    head_params,
    write_target,
    expected_weights,
    raw_head,
    shift_norms,
    write_head,
)

# (family, where, prefix, experts, storage, shifted, manifest) -> the evidence
# that must decide the norm shift.
CASES = [
    ("qwen3_5_moe", "shards", "mtp.", "per_expert", "float32", False, None, "release"),
    ("qwen3_5_moe", "shards", "model.language_model.mtp.", "fused", "float32", False, None, "norm values"),
    ("qwen3_5_moe", "sidecar", "language_model.mtp.", "fused", "float32", False, None, "norm values"),
    ("qwen3_5_moe", "sharded_sidecar", "mtp.", "fused", "float32", False, None, "norm values"),
    ("qwen3_5_moe", "model_mtp", "mtp.", "stacked", "float32", True, None, "norm values"),
    ("qwen3_5_moe", "mtp_dir", "language_model.mtp.", "stacked", "float32", True, {"rmsnorm_weight_format": "mlx_gamma"}, "manifest"),
    ("qwen3_5_moe", "config_path", "model.mtp.", "per_expert", "float32", True, None, "norm values"),
    ("qwen3_5_moe", "sidecar", "mtp.", "fused", "bfloat16", False, None, "norm values"),
    ("qwen3_5_moe", "sidecar", "mtp.", "per_expert", "float16", True, None, "norm values"),
    ("qwen3_5_moe", "sidecar", "language_model.mtp.", "stacked", "affine4", True, None, "norm values"),
    ("qwen3_5_moe", "model_mtp", "mtp.", "per_expert", "affine8", False, None, "norm values"),
    ("qwen3_5_moe", "shards", "mtp.", "per_expert", "fp8", False, None, "release"),
    ("qwen3_next", "sidecar", "language_model.mtp.", "per_expert", "bfloat16", False, None, "norm values"),
    ("qwen3_next", "mtp_dir", "mtp.", "stacked", "affine4", True, None, "norm values"),
    ("qwen3_next", "sidecar", "model.mtp.", "per_expert", "fp8", True, None, "norm values"),
    ("qwen3_5", "sidecar", "model.language_model.mtp.", "per_expert", "float32", False, None, "norm values"),
    ("qwen3_5", "model_mtp", "mtp.", "per_expert", "affine4", True, None, "norm values"),
    ("qwen3_5", "shards", "mtp.", "per_expert", "float16", False, None, "release"),
]  # fmt: skip
LOSSLESS = ("float32", "bfloat16", "float16", "fp8")  # fp8: dequantised exactly


@pytest.fixture(scope="module")
def targets(tmp_path_factory, save_mlx_dir):
    """family -> (raw dir, mlx-community style dir without a head, its model)."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        raw, mlx = write_target(root, family, save_mlx_dir)
        out[family] = (raw, mlx, mlx_spec.load(mlx)[0])
    return out


def head_logits(head, model, seed=0):
    """Logits and hm of ``head`` bound to ``model`` on fixed random input."""
    head.bind(model)
    ids = mx.array(np.random.default_rng(seed).integers(0, 399, (1, 6)))
    hidden = mx.array(np.random.default_rng(seed + 1).standard_normal((1, 6, 64)))
    logits, hm = head(ids, hidden.astype(mx.float32))
    mx.eval(logits, hm)
    return logits, hm


def case_id(case):
    return "-".join(str(x) for x in case[:5]) + ("-shifted" if case[5] else "")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_every_layout_loads_the_same_head(case, targets, tmp_path):
    family, where, prefix, experts, storage, shifted, manifest, evidence = case
    raw, mlx, model = targets[family]
    d = shutil.copytree(mlx, tmp_path / "model")
    tensors = raw_head(raw)
    args = text_args(model)
    E = getattr(args, "num_experts", 0) or 0
    stored = shift_norms(tensors) if shifted else tensors
    write_head(
        d,
        stored,
        where=where,
        prefix=prefix,
        experts=experts,
        storage=storage,
        num_experts=E,
        manifest=manifest,
    )
    weights, info = find_mtp_weights(d, args, family)
    # the report says what was read
    assert info.layout.prefix == prefix and info.layout.experts == (
        experts if E else "dense"
    )
    assert info.shift.add_one == (not shifted)
    assert info.shift.evidence.startswith(evidence), info.shift.evidence
    line = info.describe()
    assert "\n" not in line and prefix in line and info.shift.evidence in line
    head = build_head(args, family, weights, "layout")

    want = expected_weights(tensors, storage, E, shifted)
    ref = build_head(args, family, {"mtp." + k: v for k, v in _unprefixed(want)}, "ref")
    if storage.startswith("affine"):
        bits = int(storage[len("affine") :])
        # MoE router gates are 8-bit, as mlx-lm quantises them
        assert info.bits == (8 if E else bits) and f"{bits}-bit" in line
        logits, hm = head_logits(head, model)
        ref_logits, ref_hm = head_logits(ref, model)
        # the quantised head computes what its dequantised weights do
        assert mx.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4).item()
        dequantize_model(head)
        assert_same_bits(head_params(head), head_params(ref), "dequantised")
        return
    assert info.bits == 0
    assert_same_bits(head_params(head), head_params(ref), "weights")
    logits, hm = head_logits(head, model)
    ref_logits, ref_hm = head_logits(ref, model)
    assert mx.array_equal(logits, ref_logits).item()
    assert mx.array_equal(hm, ref_hm).item()
    if storage == "float32":
        # and it is the head the raw release checkpoint loads
        assert_same_bits(
            head_params(head), head_params(mlx_spec.load(raw)[0].mtp_head), "raw"
        )


def _unprefixed(weights):
    return [(k[len("mtp.") :], v) for k, v in weights.items()]


def test_load_reports_the_layout_and_uses_it(targets, tmp_path, capsys):
    """Through ``mlx_spec.load`` and ``mlx_spec generate``: the head is
    attached, and the command prints one line naming its file and layout."""
    from mlx_spec.commands.cli import main

    raw, mlx, _ = targets["qwen3_5_moe"]
    d = shutil.copytree(mlx, tmp_path / "model")
    file = write_head(d, raw_head(raw), prefix="language_model.mtp.", experts="fused")
    model = mlx_spec.load(d)[0]
    assert model.mtp_head is not None and model.mtp_info.files == (str(file),)
    argv = ["generate", "--model", str(d), "--max-tokens", "3", "--draft", "mtp"]
    assert main(argv + ["--prompt", "hello"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("MTP head:")]
    assert len(lines) == 1 and str(file) in lines[0], out
    assert "experts fused" in lines[0] and "language_model.mtp.*" in lines[0]


# ------------------------------------------------------------ bad files


def test_foreign_and_broken_sidecars_disable_mtp_only(targets, tmp_path):
    """Another family's head (no metadata), a truncated file and a config
    path leaving the directory: each disables MTP with a warning naming the
    file; the model still decodes with n-gram drafts and without."""
    raw_dense, _, _ = targets["qwen3_5"]
    raw, mlx, _ = targets["qwen3_5_moe"]
    cases = {}
    d = shutil.copytree(mlx, tmp_path / "foreign")
    cases[d] = str(write_head(d, raw_head(raw_dense)))
    d = shutil.copytree(mlx, tmp_path / "truncated")
    # (not model-mtp.safetensors: mlx-lm loads every model*.safetensors itself)
    file = write_head(d, raw_head(raw), where="sharded_sidecar")
    file = d / "mtp-00002-of-00002.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    cases[d] = str(file)
    d = shutil.copytree(mlx, tmp_path / "outside")
    config = json.loads((d / "config.json").read_text())
    config["mlx_lm_extra_tensors"] = {"mtp_file": "../elsewhere.safetensors"}
    (d / "config.json").write_text(json.dumps(config))
    cases[d] = "../elsewhere.safetensors"
    import mlx_lm

    for d, named in cases.items():
        with pytest.warns(MTPDisabledWarning, match=re.escape(named)):
            model, tok = mlx_spec.load(d)
        assert model.mtp_head is None and named in model.mtp_missing
        want = [
            r.token
            for r in mlx_lm.stream_generate(model, tok, "def f(x):", max_tokens=8)
        ]
        for draft in ("ngram", "none"):
            got = [
                r.token
                for r in mlx_spec.stream_generate(
                    model, tok, "def f(x):", max_tokens=8, draft=draft
                )
            ]
            assert got == want, (d.name, draft)


@pytest.mark.parametrize(
    "family, key, where",
    [
        ("qwen3_5", "mtp_num_hidden_layers", "text_config"),
        ("qwen3_next", "mtp_num_hidden_layers", "top"),
        ("qwen3_next", "num_nextn_predict_layers", "top"),
    ],
)
def test_declared_head_without_tensors_names_the_command(
    targets, tmp_path, family, key, where
):
    _, mlx, _ = targets[family]
    d = shutil.copytree(mlx, tmp_path / "model")
    config = json.loads((d / "config.json").read_text())
    target = config["text_config"] if where == "text_config" else config
    target.pop("mtp_num_hidden_layers", None)
    target[key] = 1
    (d / "config.json").write_text(json.dumps(config))
    model = mlx_spec.load(d)[0]
    assert model.mtp_head is None
    line = model.mtp_missing
    assert "\n" not in line and "declares an MTP head" in line
    assert "mlx_spec convert --mtp-from " in line and f"--mlx-path {d}`" in line


# ------------------------------------------------------ Qwen3.6 / 3.8 shapes


def test_model_type_from_text_config_and_architectures():
    """Qwen3.6 / 3.8 ship as qwen3_5 / qwen3_5_moe; the family is read from
    model_type, text_config.model_type or architectures, which must agree."""
    assert mtp_model_type({"model_type": "qwen3_5"}) == "qwen3_5"
    assert (
        mtp_model_type({"text_config": {"model_type": "qwen3_5_moe_text"}})
        == "qwen3_5_moe"
    )
    assert (
        mtp_model_type({"architectures": ["Qwen3_5ForConditionalGeneration"]})
        == "qwen3_5"
    )
    assert mtp_model_type({"model_type": "llama"}) is None
    with pytest.raises(MTPWeightsError, match="several model types"):
        mtp_model_type(
            {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_moe_text"}}
        )


# ------------------------------------------------------------ decoding

PROMPT = "def push(self, value: int) -> None:\n"
# family -> how its head is published here (where, prefix, experts, storage, shifted)
DECODE_LAYOUTS = {
    "qwen3_next": ("sidecar", "language_model.mtp.", "per_expert", "bfloat16", True),
    "qwen3_5": ("model_mtp", "model.language_model.mtp.", "per_expert", "affine8", False),
    "qwen3_5_moe": ("sharded_sidecar", "mtp.", "fused", "float32", False),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(DECODE_LAYOUTS))
def test_decoding_with_a_published_head_is_lossless(family, tmp_path, save_mlx_dir):
    """Greedy MTP drafting with a head from each family, published in another
    tool's layout, gives mlx-lm's greedy tokens, with drafts accepted."""
    import mlx_lm

    from mlx_spec.core.stats import SpecStats
    from mlx_spec.drafters.mtp import MTPDrafter
    from mlx_spec.session import DecodeOptions, Session
    from mlx_spec.testing.mtp_heads import write_predictive_checkpoint

    raw = write_predictive_checkpoint(tmp_path / "raw", family)
    d = save_mlx_dir(raw, tmp_path / "mlx")
    where, prefix, experts, storage, shifted = DECODE_LAYOUTS[family]
    tensors = raw_head(raw)
    write_head(
        d,
        shift_norms(tensors) if shifted else tensors,
        where=where,
        prefix=prefix,
        experts=experts,
        storage=storage,
    )
    model, tok = mlx_spec.load(d)
    assert model.mtp_info.layout.prefix == prefix
    want = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=24)]
    stats = SpecStats()
    got = [
        t
        for t, _, _ in Session(
            model, DecodeOptions(MTPDrafter(model.mtp_head), 3), stats=stats
        ).generate(tok.encode(PROMPT), max_tokens=24)
    ]
    assert got == want
    assert stats.accepted > 0


def test_explicit_mtp_path_in_any_layout(targets, tmp_path):
    """``mtp_path`` may name a published sidecar elsewhere, or a raw release
    directory (its shards are searched)."""
    raw, mlx, _ = targets["qwen3_5_moe"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text((mlx / "config.json").read_text())
    manifest = {"rmsnorm_weight_format": "mlx_gamma"}
    file = write_head(
        elsewhere,
        shift_norms(raw_head(raw)),
        where="mtp_dir",
        prefix="language_model.mtp.",
        storage="bfloat16",
        manifest=manifest,
    )
    model = mlx_spec.load(mlx, mtp_path=file)[0]
    assert model.mtp_info.shift.evidence.startswith("manifest")
    model = mlx_spec.load(mlx, mtp_path=raw)[0]
    assert model.mtp_info.found_as == "model shards"
    assert model.mtp_info.shift.evidence.startswith("release checkpoint")


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_generate_runs_past_a_broken_sidecar(targets, tmp_path, capsys, draft):
    """``mlx_spec generate --draft ngram|none`` with a truncated
    mtp.safetensors beside the model: it generates, and says in one line
    that MTP is disabled, naming the file."""
    from mlx_spec.commands.cli import main

    raw, mlx, _ = targets["qwen3_next"]
    d = shutil.copytree(mlx, tmp_path / "model")
    file = write_head(d, raw_head(raw))
    file.write_bytes(file.read_bytes()[:64])
    argv = ["generate", "--model", str(d), "--max-tokens", "3", "--draft", draft]
    assert main(argv + ["--prompt", "hello"]) == 0
    captured = capsys.readouterr()
    lines = [x for x in captured.out.splitlines() if x.startswith("MTP")]
    lines += [x for x in captured.err.splitlines() if "MTP" in x]
    assert len(lines) == 1, captured
    assert (
        lines[0].startswith("MTP head: none (MTP disabled: ") and str(file) in lines[0]
    )


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_6_shaped_release_and_its_conversion(family, tmp_path, save_mlx_dir):
    """A release in Qwen3.6's shape (qwen3_5 / qwen3_5_moe, a vision tower
    beside text_config): its head loads from the shards; its mlx-community
    conversion keeps the declaration but no tensors, and gets the command;
    a sidecar published for it loads the same head."""
    raw = write_tiny_checkpoint(tmp_path / "raw", family, vision=True)
    config = json.loads((raw / "config.json").read_text())
    assert "vision_config" in config and config["model_type"] == family
    assert mtp_model_type(config) == family
    release = mlx_spec.load(raw)[0]
    assert release.mtp_info.shift.evidence.startswith("release checkpoint")
    mlx = save_mlx_dir(raw, tmp_path / "mlx")
    converted = json.loads((mlx / "config.json").read_text())
    assert converted["text_config"]["mtp_num_hidden_layers"] == 1
    model = mlx_spec.load(mlx)[0]
    assert model.mtp_head is None and "--mtp-from" in model.mtp_missing
    write_head(mlx, raw_head(raw), prefix="language_model.mtp.", where="model_mtp")
    model = mlx_spec.load(mlx)[0]
    assert_same_bits(head_params(model.mtp_head), head_params(release.mtp_head), family)


def test_unforeseen_tensor_shapes_are_named_not_raised(targets, tmp_path):
    """Per-expert tensors that cannot even be stacked (one expert of another
    shape): the error names the file, and a load found with the model only
    disables MTP."""
    raw, d, model = target_copy(targets, tmp_path)
    tensors = raw_head(raw)
    name = "mtp.layers.0.mlp.experts.3.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    path = write_head(d, tensors)
    with pytest.raises(MTPWeightsError, match=re.escape(str(path))):
        find_mtp_weights(d, text_args(model), "qwen3_5_moe")
    with pytest.warns(MTPDisabledWarning, match=re.escape(str(path))):
        assert mlx_spec.load(d)[0].mtp_head is None


def test_convert_rewrites_a_published_head_as_an_mlx_spec_sidecar(targets, tmp_path):
    """``convert --hf-path`` accepts a directory whose head is published in
    another tool's layout; the sidecar it writes is decided by its metadata
    and holds the same head."""
    from mlx_spec.commands.convert import convert

    raw, mlx, _ = targets["qwen3_5_moe"]
    src = shutil.copytree(mlx, tmp_path / "published")
    write_head(
        src,
        shift_norms(raw_head(raw)),
        where="model_mtp",
        prefix="language_model.mtp.",
        experts="fused",
    )
    out = shutil.copytree(mlx, tmp_path / "out")
    convert(src, out, mtp_dtype="float32", progress=False)
    published, ours = mlx_spec.load(src)[0], mlx_spec.load(out)[0]
    assert ours.mtp_info.shift.evidence == "mlx-spec metadata"
    assert ours.mtp_info.found_as == "mtp.safetensors"
    assert_same_bits(
        head_params(ours.mtp_head), head_params(published.mtp_head), "convert"
    )
