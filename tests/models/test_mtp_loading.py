"""Loading an MTP head: refusing what does not belong to the model, and
configs that declare their head or not."""

import json
import re
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

import mlx_spec
from mlx_spec.commands.convert import convert, main
from mlx_spec.drafters import make_drafter
from mlx_spec.models.mtp import (
    MTPDisabledWarning,
    MTPUnavailableError,
    MTPWeightsError,
    mtp_head_of,
)
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.mtp_heads import sidecar_metadata, write_predictive_checkpoint


def load_without_head(path, match, **kwargs):
    """Load ``path``: the model loads, its head is refused with a warning
    matching ``match``, and MTP drafting then says the same."""
    with pytest.warns(MTPDisabledWarning, match=match):
        model, _ = mlx_spec.load(path, **kwargs)
    assert model.mtp_head is None
    with pytest.raises(MTPUnavailableError, match=match):
        mtp_head_of(model)
    make_drafter("ngram", model)  # n-gram drafting is unaffected
    return model


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "bad", "qwen3_5_moe")
    w = load_file(str(path / "model.safetensors"))
    name = "mtp.layers.0.self_attn.q_proj.weight"
    w[name] = w[name][:-8]
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    load_without_head(path, re.escape(name))
    with pytest.raises(MTPWeightsError, match="q_proj"):
        convert(path, tmp_path / "out")


def test_sidecar_of_another_model_names_the_file(
    converted_dirs, tmp_path, save_mlx_dir
):
    _, donor = converted_dirs["qwen3_next"]
    for fam, overrides in (("qwen3_5_moe", {}), ("qwen3_next", {"vocab_size": 640})):
        raw = write_tiny_checkpoint(tmp_path / f"{fam}_raw", fam, **overrides)
        mlx = save_mlx_dir(raw, tmp_path / f"{fam}_mlx")
        shutil.copy(donor / "mtp.safetensors", mlx / "mtp.safetensors")
        # found with the model: disabled, the model still loads
        load_without_head(mlx, re.escape(str(mlx / "mtp.safetensors")))
        # asked for explicitly: refused
        with pytest.raises(MTPWeightsError, match="another model"):
            mlx_spec.load(raw, mtp_path=donor / "mtp.safetensors")
        # Converting a raw checkpoint into another model's MLX dir is refused too.
        with pytest.raises(MTPWeightsError, match="is not the model"):
            convert(converted_dirs["qwen3_next"][0], mlx)


def test_sidecar_of_another_model_with_the_same_config_is_refused(
    converted_dirs, tmp_path, save_mlx_dir
):
    """Same config, other weights (another seed): the weight signature tells."""
    raw0, mlx0 = converted_dirs["qwen3_next"]
    raw1 = write_predictive_checkpoint(tmp_path / "seed1_raw", "qwen3_next", seed=1)
    mlx1 = save_mlx_dir(raw1, tmp_path / "seed1_mlx")
    assert main(["--hf-path", str(raw1), "--mlx-path", str(mlx1), "--no-progress"]) == 0
    assert (
        sidecar_metadata(mlx1)["mlx_spec.fingerprint"]
        == sidecar_metadata(mlx0)["mlx_spec.fingerprint"]
    )  # the configs agree
    other = mlx1 / "mtp.safetensors"
    for target in (mlx0, raw0):
        with pytest.raises(MTPWeightsError, match=f"{other}.*another model's"):
            mlx_spec.load(target, mtp_path=other)
    assert mlx_spec.load(mlx1)[0].mtp_head is not None  # its own model takes it


def test_sidecar_without_weight_signature_is_refused(converted_dirs, tmp_path):
    _, mlx = converted_dirs["qwen3_5"]
    weights, meta = mx.load(str(mlx / "mtp.safetensors"), return_metadata=True)
    del meta["mlx_spec.weights"]
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), weights, metadata=meta)
    with pytest.raises(MTPWeightsError, match="older mlx_spec convert"):
        mlx_spec.load(mlx, mtp_path=old)


def test_missing_mtp_path_names_the_path(converted_dirs, tmp_path):
    raw, _ = converted_dirs["qwen3_5"]
    missing = tmp_path / "nowhere" / "mtp.safetensors"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mlx_spec.load(raw, mtp_path=missing)


def test_not_a_sidecar(converted_dirs):
    raw, mlx = converted_dirs["qwen3_5"]
    with pytest.raises(MTPWeightsError, match="no MTP tensors"):
        mlx_spec.load(mlx, mtp_path=mlx / "model.safetensors")


def test_dir_without_mtp_weights_says_what_to_run(tmp_path, capsys, save_mlx_dir):
    raw = write_tiny_checkpoint(tmp_path / "raw", "qwen3_5")
    mlx = save_mlx_dir(raw, tmp_path / "mlx")
    model, _ = mlx_spec.load(mlx)  # loading works; only MTP drafting fails
    assert model.mtp_head is None
    for draft in ("mtp", "mtp+ngram"):
        with pytest.raises(
            MTPUnavailableError,
            match=f"mlx_spec convert --mtp-from .* --mlx-path {mlx}`",
        ):
            make_drafter(draft, model)
    assert main(["--hf-path", str(mlx), "--mlx-path", str(mlx)]) == 2
    assert "no MTP weights" in capsys.readouterr().err


def test_mlx_shard_with_unmarked_mtp_decided_by_values(tmp_path, save_mlx_dir):
    """Raw mtp.* tensors in a shard mlx-lm wrote: no metadata and no release
    provenance, so the norms' values decide (all seven zero-centred)."""
    raw = write_tiny_checkpoint(tmp_path / "raw", "qwen3_5")
    mlx = save_mlx_dir(raw, tmp_path / "mlx")
    w = dict(mx.load(str(mlx / "model.safetensors")))
    w.update(
        {
            k: v
            for k, v in mx.load(str(raw / "model.safetensors")).items()
            if k.startswith("mtp.")
        }
    )
    mx.save_safetensors(str(mlx / "model.safetensors"), w, metadata={"format": "mlx"})
    index = json.loads((mlx / "model.safetensors.index.json").read_text())
    index["weight_map"].update(
        {k: "model.safetensors" for k in w if k.startswith("mtp.")}
    )
    (mlx / "model.safetensors.index.json").write_text(json.dumps(index))
    model = mlx_spec.load(mlx)[0]
    assert model.mtp_info.shift.add_one
    assert model.mtp_info.shift.evidence.startswith("norm values")
    raw_head = mlx_spec.load(raw)[0].mtp_head
    want = dict(tree_flatten(raw_head.parameters()))
    for k, v in tree_flatten(model.mtp_head.parameters()):
        assert mx.array_equal(v, want[k]).item(), k


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_config_mtp_num_hidden_layers_with_or_without(tmp_path, family):
    """Configs may declare the head (as released ones do) or not (the
    checkpoint's mtp.* tensors decide): 1 or absent loads it, 0 means none,
    more than one is refused naming the file."""
    raw = write_tiny_checkpoint(tmp_path / "raw", family)
    config_file = raw / "config.json"
    config = json.loads(config_file.read_text())
    text = config.get("text_config", config)

    def load_with(value):
        if value is None:
            text.pop("mtp_num_hidden_layers", None)
        else:
            text["mtp_num_hidden_layers"] = value
        config_file.write_text(json.dumps(config))
        return mlx_spec.load(raw)[0]

    assert load_with(None).mtp_head is not None
    assert load_with(1).mtp_head is not None
    model = load_with(0)
    assert model.mtp_head is None and "mtp_num_hidden_layers=0" in model.mtp_missing
    text["mtp_num_hidden_layers"] = 2
    config_file.write_text(json.dumps(config))
    load_without_head(raw, "config.json: mtp_num_hidden_layers=2")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_config_mtp_attention_window(tmp_path, family):
    """The head attends to every position unless the config declares the
    window it was trained on; a bad value is refused naming it."""
    raw = write_tiny_checkpoint(tmp_path / "raw", family)
    config_file = raw / "config.json"
    config = json.loads(config_file.read_text())
    text = config.get("text_config", config)

    def window_of(value):
        text["mtp_attention_window"] = value
        config_file.write_text(json.dumps(config))
        head = mlx_spec.load(raw)[0].mtp_head
        return head.attention_window, head.make_cache()[0].window

    assert mlx_spec.load(raw)[0].mtp_head.attention_window is None
    assert window_of(300) == (300, 300)
    for bad in (0, -1, 2.5, "512", True):
        text["mtp_attention_window"] = bad
        config_file.write_text(json.dumps(config))
        load_without_head(raw, re.escape(f"mtp_attention_window={bad!r}"))


def test_demo_config_declares_its_head():
    from mlx_spec.demo import default_model_path

    config = json.loads((default_model_path() / "config.json").read_text())
    training = json.loads((default_model_path() / "training.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    # its head attends as far back as it was trained to
    assert config["mtp_attention_window"] == training["config"]["seq_len"]
    head = mlx_spec.load(default_model_path())[0].mtp_head
    assert head.attention_window == training["config"]["seq_len"]
