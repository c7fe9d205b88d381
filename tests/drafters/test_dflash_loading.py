"""Loading a DFlash drafter: the file dtypes, quantisation in memory, a repo
id through the (fake) hub, and every refusal as one line naming the field."""

import json
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest

import mlx_spec
from mlx_spec.errors import InputError
from mlx_spec.loading import load_drafter
from mlx_spec.models.dflash.config import spread_layer_ids
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import (
    dflash_config,
    random_features,
    write_dflash_checkpoint,
)
from mlx_spec.testing.fake_hub import FakeHub

FAMILY = "qwen3_5"
TIMEOUT = 300  # a subprocess imports mlx and mlx-lm


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("target"), FAMILY)


@pytest.fixture(scope="module")
def target(target_dir):
    return mlx_spec.load(target_dir)[0]


def _logits(drafter, seed=0):
    config = dflash_config(FAMILY)
    block = drafter.block(mx.array([7]))
    return drafter(block, random_features(config, 8, seed=seed), drafter.make_cache())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_files_load_as_they_are(tmp_path, target, dtype):
    full = load_drafter(write_dflash_checkpoint(tmp_path / "f32", FAMILY), target)
    half = load_drafter(
        write_dflash_checkpoint(tmp_path / dtype, FAMILY, dtype=dtype), target
    )
    assert half.fc.weight.dtype == getattr(mx, dtype)
    # The same random weights rounded to 8 (bf16) or 11 (f16) bits.
    want, got = _logits(full), _logits(half).astype(mx.float32)
    assert mx.allclose(got, want, atol=0.1)


def test_a_quantised_drafter_loads_and_drafts(tmp_path, target):
    path = write_dflash_checkpoint(tmp_path, FAMILY)
    full = load_drafter(path, target)
    want = _logits(full)
    linear = [m for _, m in full.named_modules() if isinstance(m, nn.Linear)]
    errors = {}
    for bits in (4, 8):
        small = load_drafter(path, target, quantize=bits)
        quantised = [
            m for _, m in small.named_modules() if isinstance(m, nn.QuantizedLinear)
        ]
        # Every input width (64, 128) is whole groups of 64: all are quantised.
        assert len(quantised) == len(linear) == 15
        assert {m.bits for m in quantised} == {bits}
        got = _logits(small)
        assert got.shape == want.shape and bool(mx.all(mx.isfinite(got)))
        errors[bits] = float(mx.abs(got - want).max() / mx.abs(want).max())
    # Rounded, not broken: 8 bits closer than 4, both near the full drafter.
    assert 0 < errors[8] < errors[4] < 0.5, errors


def test_an_unknown_quantisation_is_refused(tmp_path, target):
    with pytest.raises(InputError, match="quantize=3"):
        load_drafter(write_dflash_checkpoint(tmp_path, FAMILY), target, quantize=3)


def test_missing_target_layer_ids_are_spread_over_the_target():
    # The released 52-layer example: five draft layers read layers 1..49.
    assert spread_layer_ids(5, 52) == (1, 13, 25, 37, 49)
    assert spread_layer_ids(2, 8) == (1, 5)


def test_a_config_without_target_layer_ids_reads_spread_layers(tmp_path):
    target = mlx_spec.load(
        write_tiny_checkpoint(tmp_path / "t", FAMILY, num_hidden_layers=8)
    )[0]
    path = write_dflash_checkpoint(
        tmp_path / "d", FAMILY, target_layer_ids=None, num_target_layers=8
    )
    drafter = load_drafter(path, target)
    assert drafter.config.target_layer_ids == (1, 5)
    assert drafter.fc.weight.shape == (64, 128)


# config override -> what the one-line message must name
REFUSED_CONFIGS = {
    "version 2": ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    "architecture": ({"architectures": ["LlamaForCausalLM"]}, "architectures="),
    "hidden size": ({"hidden_size": 32}, "hidden_size=32"),
    "vocabulary": ({"vocab_size": 1024}, "vocab_size=1024"),
    "layer beyond": ({"target_layer_ids": [1, 4]}, "target_layer_ids=[1, 4]"),
    "layer ids": ({"target_layer_ids": "1,2"}, "target_layer_ids='1,2'"),
    "layer id": ({"target_layer_ids": [1.5, 2]}, "target_layer_ids=[1.5, 2]"),
    "no mask token": ({"mask_token_id": None}, "mask_token_id is missing"),
    "mask token": ({"mask_token_id": 512}, "mask_token_id=512"),
    "target layers": ({"num_target_layers": 40}, "num_target_layers=40"),
    "kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    "head dim": ({"head_dim": 0}, "head_dim=0"),
    "no window": (
        {"layer_types": ["sliding_attention", "full_attention"]},
        "sliding_window is missing",
    ),
    "layer type": (
        {"layer_types": ["linear_attention", "full_attention"]},
        "layer_types=",
    ),
    "causal": ({"is_causal": "yes"}, "is_causal='yes'"),
    "block": ({"block_size": 1}, "block_size=1"),
    "rope": ({"rope_parameters": {"rope_type": "yarn"}}, "rope_parameters="),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
def test_a_drafter_that_does_not_fit_is_one_line_naming_the_field(
    tmp_path, target, case
):
    overrides, named = REFUSED_CONFIGS[case]
    path = write_dflash_checkpoint(tmp_path, FAMILY, **overrides)
    with pytest.raises(InputError) as refused:
        load_drafter(path, target)
    message = str(refused.value)
    assert named in message and "\n" not in message, message


def _refusal(tmp_path, target, **kwargs) -> str:
    path = write_dflash_checkpoint(tmp_path, FAMILY, **kwargs)
    with pytest.raises(InputError) as refused:
        load_drafter(path, target)
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_missing_and_ill_shaped_tensors_are_named(tmp_path, target):
    name = "layers.1.mlp.up_proj.weight"
    assert f"tensor {name} is missing" in _refusal(tmp_path / "a", target, drop=[name])
    assert f"tensor {name} has shape [128, 32], expected [128, 64]" in _refusal(
        tmp_path / "b", target, reshape={name: (128, 32)}
    )


def test_broken_files_are_named(tmp_path, target):
    path = write_dflash_checkpoint(tmp_path, FAMILY)
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(InputError, match="model.safetensors: unreadable"):
        load_drafter(path, target)
    (path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json: unreadable"):
        load_drafter(path, target)
    (path / "config.json").unlink()
    with pytest.raises(InputError, match="no config.json"):
        load_drafter(path, target)


def test_integer_tensors_are_refused(tmp_path, target):
    path = write_dflash_checkpoint(tmp_path, FAMILY)
    tensors = mx.load(str(path / "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"].astype(mx.int32)
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    with pytest.raises(InputError, match="tensor norm.weight has dtype"):
        load_drafter(path, target)


def test_a_config_without_head_dim_divides_the_hidden_size(tmp_path, target):
    path = write_dflash_checkpoint(
        tmp_path, FAMILY, head_dim=None, num_attention_heads=4, num_key_value_heads=2
    )
    drafter = load_drafter(path, target)  # the tensors were written for 64 / 4
    assert drafter.config.head_dim == 16


def test_a_missing_path_is_named(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="drafter path"):
        load_drafter(str(tmp_path / "nowhere"), target)


_FROM_HUB = """
    import json, mlx.core as mx, mlx_spec
    from mlx_spec.errors import one_line
    from mlx_spec.loading import load_drafter
    target = mlx_spec.load({target!r})[0]
    drafter = load_drafter("z-lab/Tiny-DFlash", target)
    logits = drafter(drafter.block(mx.array([7])), None, drafter.make_cache())
    try:
        load_drafter("z-lab/No-Such-DFlash", target)
        missing = None
    except OSError as e:
        missing = one_line(e)
    print(json.dumps({{"ids": list(drafter.config.target_layer_ids),
        "shape": list(logits.shape), "missing": missing}}))
"""


def test_a_repo_id_is_fetched_through_the_hub(tmp_path, target_dir):
    drafter = write_dflash_checkpoint(tmp_path / "repo", FAMILY, block_size=5)
    with FakeHub() as hub:
        hub.add_repo("z-lab/Tiny-DFlash", drafter)
        env = dict(
            os.environ,
            HF_ENDPOINT=hub.url,
            HF_HOME=str(tmp_path / "hf_home"),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_TELEMETRY="1",
        )
        code = textwrap.dedent(_FROM_HUB.format(target=str(target_dir)))
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert hub.sent("z-lab/Tiny-DFlash", "model.safetensors") > 0
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ids"] == [0, 1] and out["shape"] == [1, 4, 512]
    assert "z-lab/No-Such-DFlash" in out["missing"]
    assert "no repo of that name" in out["missing"]
