"""The DFlash drafter shipped with the demo model (mlx_spec/data/demo_dflash):
it loads against the demo model and fits, it is packaged, and it drafts
losslessly with some drafts accepted."""

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate

import mlx_spec
from mlx_spec.demo import (
    bundled_drafter,
    default_drafter_path,
    default_model_path,
    is_demo_model,
)

ROOT = Path(__file__).resolve().parents[2]
# Stdlib-like code: the distribution both models were trained on.
PROMPT = (
    "import os\nimport sys\n\n\nclass Config:\n"
    '    """Settings read from the environment."""\n\n'
    "    def __init__(self, name, default=None):\n        "
)
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def demo():
    return mlx_spec.load(default_model_path())


def test_the_drafter_is_a_small_bf16_dflash_checkpoint():
    path = default_drafter_path()
    assert path.name == "demo_dflash" and path.parent == default_model_path().parent
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 16
    target = json.loads((default_model_path() / "config.json").read_text())
    # the mask token is the EOS id: the vocabulary has no spare id, and a
    # block never starts with EOS (generation stops there)
    assert dflash["mask_token_id"] == target["eos_token_id"]
    tensors = mx.load(str(path / "model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {mx.bfloat16}
    assert not any("embed" in k or "lm_head" in k for k in tensors)
    assert (path / "model.safetensors").stat().st_size < 8 * 1024 * 1024
    assert (path / "README.md").is_file() and (path / "training.json").is_file()


def test_it_loads_against_the_demo_model_and_fits(demo):
    model, _ = demo
    drafter = mlx_spec.load_drafter(default_drafter_path(), model)
    target = json.loads((default_model_path() / "config.json").read_text())
    assert drafter.config.hidden_size == target["hidden_size"]
    assert drafter.config.num_target_layers == target["num_hidden_layers"]
    assert all(
        0 <= i < target["num_hidden_layers"] for i in drafter.config.target_layer_ids
    )


def test_only_the_demo_model_brings_a_drafter(tmp_path):
    assert is_demo_model(None) and is_demo_model(str(default_model_path()))
    assert bundled_drafter(None) == default_drafter_path()
    assert bundled_drafter(tmp_path) is None
    assert bundled_drafter("Qwen/Qwen3-Next-80B-A3B-Instruct") is None


def test_the_package_ships_it():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"mlx_spec.data.demo_dflash"' in text
    patterns = re.search(r"mlx_spec = \[(.*)\]", text).group(1)
    assert '"data/**/*"' in patterns  # every file under data/, this one's too


def test_it_drafts_greedily_as_mlx_lm_decodes_with_drafts_accepted(demo):
    model, tok = demo
    ids = mx.array(tok.encode(PROMPT))
    reference = [
        r.token for r in mlx_stream_generate(model, tok, ids, max_tokens=MAX_TOKENS)
    ]
    stats = mlx_spec.SpecStats()
    tokens = [
        r.token
        for r in mlx_spec.stream_generate(
            model,
            tok,
            PROMPT,
            max_tokens=MAX_TOKENS,
            draft="dflash",
            draft_model=default_drafter_path(),
            num_draft_tokens=15,
            stats=stats,
        )
    ]
    assert tokens == reference
    assert stats.drafted > 0 and stats.accepted > 0
    assert stats.verify_passes < MAX_TOKENS  # some passes emitted several tokens
