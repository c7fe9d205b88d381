"""``mlx_spec convert``; loading the MTP head from raw, converted and sidecar dirs."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import mlx_spec
from mlx_spec.commands.convert import build_parser, convert, main
from mlx_spec.core.decode import speculative_generate_step
from mlx_spec.core.stats import SpecStats
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.mtp import MTP_NORMS, MTPUnavailableError, MTPWeightsError
from mlx_spec.models.mtp.weights import mtp_shards
from mlx_spec.testing.checkpoints import FAMILIES, write_tiny_checkpoint
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint

PROMPT = "def push(self, value: int) -> None:\n"


def save_mlx_dir(raw, out):
    """An mlx-community style directory: mlx-lm's own format, no mtp.* tensors."""
    model, _, config = mlx_lm.load(str(raw), return_config=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(raw / f, out / f)
    return out


class Recording(MTPDrafter):
    def __init__(self, head):
        super().__init__(head)
        self.drafts = []

    def draft(self, k):
        self.drafts.append(super().draft(k))
        return self.drafts[-1]


def run(model, tok, k=3, max_tokens=20):
    drafter, stats = Recording(model.mtp_head), SpecStats()
    gen = speculative_generate_step(
        mx.array(tok.encode(PROMPT)),
        model,
        drafter,
        num_draft_tokens=k,
        max_tokens=max_tokens,
        stats=stats,
    )
    return [t for t, _, _ in gen], drafter.drafts, stats


def head_params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.mtp_head.parameters())}


def sidecar_meta(path):
    with safe_open(str(path / "mtp.safetensors"), framework="numpy") as f:
        return f.metadata()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """family -> (raw dir, MLX dir + float32 sidecar)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for fam in FAMILIES:
        raw = write_predictive_checkpoint(root / f"{fam}_raw", fam)
        mlx = save_mlx_dir(raw, root / f"{fam}_mlx")
        assert not any(
            k.startswith("mtp.") for k in mx.load(str(mlx / "model.safetensors"))
        )
        assert (
            main(
                [
                    "--hf-path",
                    str(raw),
                    "--mlx-path",
                    str(mlx),
                    "--mtp-dtype",
                    "float32",
                    "--no-progress",
                ]
            )
            == 0
        )
        out[fam] = raw, mlx
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_and_sidecar_give_same_drafts(dirs, family):
    raw, mlx = dirs[family]
    a, tok = mlx_spec.load(raw)
    b, _ = mlx_spec.load(mlx)
    pa, pb = head_params(a), head_params(b)
    assert pa.keys() == pb.keys()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    out_a, drafts_a, stats = run(a, tok)
    out_b, drafts_b, _ = run(b, tok)
    assert drafts_a == drafts_b and out_a == out_b
    assert stats.accepted > 0


def test_sidecar_metadata(dirs):
    raw, mlx = dirs["qwen3_5_moe"]
    meta = sidecar_meta(mlx)
    assert meta["mlx_spec.sanitized"] == "true" and meta["mlx_spec.kind"] == "mtp"
    assert meta["mlx_spec.model_type"] == "qwen3_5_moe"
    assert meta["mlx_spec.hidden_size"] == "64" and meta["mlx_spec.vocab_size"] == "512"
    assert len(meta["mlx_spec.models.fingerprint"]) == 16
    assert meta["mlx_spec.dtype"] == "float32" and meta["mlx_spec.bits"] == "0"


def test_norms_shift_exactly_once(dirs, tmp_path):
    raw, mlx = dirs["qwen3_next"]
    raw_w = load_file(str(raw / "model.safetensors"))
    # Converting a converted checkpoint (its sidecar is the source) copies it.
    again = tmp_path / "again"
    assert (
        main(
            [
                "--hf-path",
                str(mlx),
                "--mlx-path",
                str(again),
                "--mtp-dtype",
                "float32",
                "--no-progress",
            ]
        )
        == 0
    )
    side = [load_file(str(d / "mtp.safetensors")) for d in (mlx, again)]
    loads = [head_params(mlx_spec.load(p)[0]) for p in (raw, raw, mlx, mlx, again)]
    # The same sidecar given explicitly to a raw directory: the sidecar wins.
    loads.append(head_params(mlx_spec.load(raw, mtp_path=mlx / "mtp.safetensors")[0]))
    for name in MTP_NORMS:
        want = raw_w[name] + 1.0
        for s in side:
            np.testing.assert_array_equal(s[name], want)
        for p in loads:
            np.testing.assert_array_equal(p[name[len("mtp.") :]], want)


def test_reconvert_into_same_dir_is_idempotent(dirs, tmp_path):
    raw, mlx = dirs["qwen3_5"]
    d = shutil.copytree(mlx, tmp_path / "d")
    before = load_file(str(d / "mtp.safetensors"))
    assert (
        main(
            [
                "--hf-path",
                str(d),
                "--mlx-path",
                str(d),
                "--mtp-dtype",
                "float32",
                "--no-progress",
            ]
        )
        == 0
    )
    after = load_file(str(d / "mtp.safetensors"))
    assert before.keys() == after.keys()
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_target_bf16_head(dirs, tmp_path, bits):
    """mlx_lm.convert -q target (made by `mlx_spec convert`) + default bf16 sidecar."""
    raw, _ = dirs["qwen3_5_moe"]
    q = tmp_path / "q"
    argv = [
        "--hf-path",
        str(raw),
        "--mlx-path",
        str(q),
        "-q",
        "--q-bits",
        str(bits),
        "--q-group-size",
        "32",
    ]
    assert main(argv + ["--no-progress"]) == 0
    assert json.loads((q / "config.json").read_text())["quantization"]["bits"] == bits
    assert sidecar_meta(q)["mlx_spec.dtype"] == "bfloat16"
    model, tok = mlx_spec.load(q)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.mtp_head.fc.weight.dtype == mx.bfloat16
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=20)]
    stats = SpecStats()
    out = mlx_spec.stream_generate(
        model, tok, PROMPT, max_tokens=20, draft="mtp", num_draft_tokens=3, stats=stats
    )
    assert [r.token for r in out] == ref
    assert stats.accepted > 0


def test_8bit_head(dirs, tmp_path):
    raw, mlx = dirs["qwen3_next"]
    d = shutil.copytree(mlx, tmp_path / "d")
    assert (
        main(
            [
                "--hf-path",
                str(raw),
                "--mlx-path",
                str(d),
                "--mtp-bits",
                "8",
                "--no-progress",
            ]
        )
        == 0
    )
    model, tok = mlx_spec.load(d)
    assert isinstance(model.mtp_head.fc, nn.QuantizedLinear)
    out, _, stats = run(model, tok)
    assert out[:20] == [
        r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=20)
    ]
    assert stats.accepted > 0


def test_4bit_head_refused_unless_forced(dirs, tmp_path, capsys):
    raw, mlx = dirs["qwen3_5"]
    d = shutil.copytree(mlx, tmp_path / "d")
    with pytest.raises(SystemExit) as e:
        main(["--hf-path", str(raw), "--mlx-path", str(d), "--mtp-bits", "4"])
    assert e.value.code == 2 and "--force-4bit" in capsys.readouterr().err
    with pytest.raises(ValueError, match="4 bits"):
        convert(raw, d, mtp_bits=4)
    assert (
        main(
            [
                "--hf-path",
                str(raw),
                "--mlx-path",
                str(d),
                "--mtp-bits",
                "4",
                "--force-4bit",
                "--no-progress",
            ]
        )
        == 0
    )
    assert sidecar_meta(d)["mlx_spec.bits"] == "4"
    assert "destroy" in " ".join(build_parser().format_help().split())


def test_sharded_checkpoint_reads_only_mtp_shards(dirs, tmp_path):
    raw, mlx = dirs["qwen3_5_moe"]
    d = shutil.copytree(raw, tmp_path / "sharded")
    w = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(w)
    groups = {
        "model-00001-of-00003.safetensors": [
            n for n in names if n.startswith("model.")
        ][:40],
        "model-00003-of-00003.safetensors": [n for n in names if n.startswith("mtp.")],
    }
    groups["model-00002-of-00003.safetensors"] = [
        n for n in names if not any(n in g for g in groups.values())
    ]
    for f, ns in groups.items():
        save_file({n: w[n] for n in ns}, str(d / f), metadata={"format": "pt"})
    index = {
        "metadata": {},
        "weight_map": {n: f for f, ns in groups.items() for n in ns},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert mtp_shards(d) == [d / "model-00003-of-00003.safetensors"]
    out = tmp_path / "out"
    shutil.copytree(mlx, out)
    assert (
        main(["--hf-path", str(d), "--mlx-path", str(out), "--mtp-dtype", "float32"])
        == 0
    )
    a, b = load_file(str(out / "mtp.safetensors")), load_file(
        str(mlx / "mtp.safetensors")
    )
    assert all(np.array_equal(a[k], b[k]) for k in b)
    pa, pb = head_params(mlx_spec.load(d)[0]), head_params(mlx_spec.load(raw)[0])
    assert all(np.array_equal(pa[k], pb[k]) for k in pb)


# ----------------------------------------------------------------- bad input


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "bad", "qwen3_5_moe")
    w = load_file(str(path / "model.safetensors"))
    name = "mtp.layers.0.self_attn.q_proj.weight"
    w[name] = w[name][:-8]
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MTPWeightsError, match=name.replace(".", r"\.")):
        mlx_spec.load(path)
    with pytest.raises(MTPWeightsError, match="q_proj"):
        convert(path, tmp_path / "out")


def test_sidecar_of_another_model_names_the_file(dirs, tmp_path):
    _, donor = dirs["qwen3_next"]
    for fam, overrides in (("qwen3_5_moe", {}), ("qwen3_next", {"vocab_size": 640})):
        raw = write_tiny_checkpoint(tmp_path / f"{fam}_raw", fam, **overrides)
        mlx = save_mlx_dir(raw, tmp_path / f"{fam}_mlx")
        shutil.copy(donor / "mtp.safetensors", mlx / "mtp.safetensors")
        with pytest.raises(MTPWeightsError, match=str(mlx / "mtp.safetensors")):
            mlx_spec.load(mlx)
        with pytest.raises(MTPWeightsError, match="another model"):
            mlx_spec.load(raw, mtp_path=donor / "mtp.safetensors")
        # Converting a raw checkpoint into another model's MLX dir is refused too.
        with pytest.raises(MTPWeightsError, match="is not the model"):
            convert(dirs["qwen3_next"][0], mlx)


def test_sidecar_of_another_model_with_the_same_config_is_refused(dirs, tmp_path):
    """Same config, other weights (another seed): the weight signature tells."""
    raw0, mlx0 = dirs["qwen3_next"]
    raw1 = write_predictive_checkpoint(tmp_path / "seed1_raw", "qwen3_next", seed=1)
    mlx1 = save_mlx_dir(raw1, tmp_path / "seed1_mlx")
    assert main(["--hf-path", str(raw1), "--mlx-path", str(mlx1), "--no-progress"]) == 0
    assert (
        sidecar_meta(mlx1)["mlx_spec.models.fingerprint"]
        == sidecar_meta(mlx0)["mlx_spec.models.fingerprint"]
    )  # the configs agree
    other = mlx1 / "mtp.safetensors"
    for target in (mlx0, raw0):
        with pytest.raises(MTPWeightsError, match=f"{other}.*another model's"):
            mlx_spec.load(target, mtp_path=other)
    assert mlx_spec.load(mlx1)[0].mtp_head is not None  # its own model takes it


def test_sidecar_without_weight_signature_is_refused(dirs, tmp_path):
    _, mlx = dirs["qwen3_5"]
    weights, meta = mx.load(str(mlx / "mtp.safetensors"), return_metadata=True)
    del meta["mlx_spec.weights"]
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), weights, metadata=meta)
    with pytest.raises(MTPWeightsError, match="older mlx_spec convert"):
        mlx_spec.load(mlx, mtp_path=old)


def test_missing_mtp_path_names_the_path(dirs, tmp_path):
    raw, _ = dirs["qwen3_5"]
    missing = tmp_path / "nowhere" / "mtp.safetensors"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        mlx_spec.load(raw, mtp_path=missing)


def test_not_a_sidecar(dirs):
    raw, mlx = dirs["qwen3_5"]
    with pytest.raises(MTPWeightsError, match="not an MTP sidecar"):
        mlx_spec.load(mlx, mtp_path=mlx / "model.safetensors")


def test_dir_without_mtp_weights_says_what_to_run(tmp_path, capsys):
    raw = write_tiny_checkpoint(tmp_path / "raw", "qwen3_5")
    mlx = save_mlx_dir(raw, tmp_path / "mlx")
    model, _ = mlx_spec.load(mlx)  # loading works; only MTP drafting fails
    assert model.mtp_head is None
    for draft in ("mtp", "mtp+ngram"):
        with pytest.raises(
            MTPUnavailableError, match=f"mlx_spec convert --hf-path .* --mlx-path {mlx}"
        ):
            make_drafter(draft, model)
    assert main(["--hf-path", str(mlx), "--mlx-path", str(mlx)]) == 2
    assert "no MTP weights" in capsys.readouterr().err


def test_mlx_shard_with_unmarked_mtp_is_refused(tmp_path):
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
    with pytest.raises(
        MTPWeightsError, match="cannot tell whether its norms were shifted"
    ):
        mlx_spec.load(mlx)


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
    with pytest.raises(MTPWeightsError, match="config.json: mtp_num_hidden_layers=2"):
        load_with(2)


def test_demo_config_declares_its_head():
    from mlx_spec.demo import default_model_path

    config = json.loads((default_model_path() / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1
    assert mlx_spec.load(default_model_path())[0].mtp_head is not None
