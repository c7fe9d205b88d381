"""``mlx_spec convert``; loading the MTP head from raw, converted and sidecar converted_dirs."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

import mlx_spec
from mlx_spec.commands.convert import build_parser, convert, main
from mlx_spec.core.stats import SpecStats
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.models.mtp import MTP_NORMS
from mlx_spec.models.mtp.discovery import model_shards_with_mtp
from mlx_spec.session import DecodeOptions, Session
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.mtp_heads import sidecar_metadata

PROMPT = "def push(self, value: int) -> None:\n"


class Recording(MTPDrafter):
    def __init__(self, head):
        super().__init__(head)
        self.drafts = []

    def draft(self, k):
        self.drafts.append(super().draft(k))
        return self.drafts[-1]


def run(model, tok, k=3, max_tokens=20):
    drafter, stats = Recording(model.mtp_head), SpecStats()
    session = Session(model, DecodeOptions(drafter, num_draft_tokens=k), stats=stats)
    gen = session.generate(tok.encode(PROMPT), max_tokens=max_tokens)
    return [t for t, _, _ in gen], drafter.drafts, stats


def head_params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.mtp_head.parameters())}


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_and_sidecar_give_same_drafts(converted_dirs, family):
    raw, mlx = converted_dirs[family]
    a, tok = mlx_spec.load(raw)
    b, _ = mlx_spec.load(mlx)
    pa, pb = head_params(a), head_params(b)
    assert pa.keys() == pb.keys()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    out_a, drafts_a, stats = run(a, tok)
    out_b, drafts_b, _ = run(b, tok)
    assert drafts_a == drafts_b and out_a == out_b
    assert stats.accepted > 0


def test_sidecar_metadata(converted_dirs):
    raw, mlx = converted_dirs["qwen3_5_moe"]
    meta = sidecar_metadata(mlx)
    assert meta["mlx_spec.sanitized"] == "true" and meta["mlx_spec.kind"] == "mtp"
    assert meta["mlx_spec.model_type"] == "qwen3_5_moe"
    assert meta["mlx_spec.hidden_size"] == "64" and meta["mlx_spec.vocab_size"] == "512"
    assert len(meta["mlx_spec.fingerprint"]) == 16
    assert meta["mlx_spec.dtype"] == "float32" and meta["mlx_spec.bits"] == "0"


def test_norms_shift_exactly_once(converted_dirs, tmp_path):
    raw, mlx = converted_dirs["qwen3_next"]
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


def test_reconvert_into_same_dir_is_idempotent(converted_dirs, tmp_path):
    raw, mlx = converted_dirs["qwen3_5"]
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
def test_quantized_target_bf16_head(converted_dirs, tmp_path, bits):
    """mlx_lm.convert -q target (made by `mlx_spec convert`) + default bf16 sidecar."""
    raw, _ = converted_dirs["qwen3_5_moe"]
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
    assert sidecar_metadata(q)["mlx_spec.dtype"] == "bfloat16"
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


def test_8bit_head(converted_dirs, tmp_path):
    raw, mlx = converted_dirs["qwen3_next"]
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


def test_4bit_head_refused_unless_forced(converted_dirs, tmp_path, capsys):
    raw, mlx = converted_dirs["qwen3_5"]
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
    assert sidecar_metadata(d)["mlx_spec.bits"] == "4"
    assert "destroy" in " ".join(build_parser().format_help().split())


def test_sharded_checkpoint_reads_only_mtp_shards(converted_dirs, tmp_path):
    raw, mlx = converted_dirs["qwen3_5_moe"]
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
    assert model_shards_with_mtp(d) == [d / "model-00003-of-00003.safetensors"]
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
