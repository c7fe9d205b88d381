"""Shared fixtures: tiny raw checkpoints of every supported family, built by code."""

import os
import shutil

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import settings
from mlx_lm.utils import save_config, save_model

import mlx_spec
from mlx_spec.commands.convert import main as convert_main
from mlx_spec.kernels import switch as kernels
from mlx_spec.testing.checkpoints import FAMILIES, write_tiny_checkpoint
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint
from mlx_spec.testing.reference import register_twin

# Property tests draw the same examples on every run (CI included): a failure
# reproduces, and a passing suite never turns red by luck. HYPOTHESIS_PROFILE=
# explore draws fresh examples (and prints the seed of a failure) to search wider.
settings.register_profile("seeded", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Measured verify-cost profiles go to a folder of this test session (and
    of the commands it starts), never the user's cache."""
    from mlx_spec.cache_dir import CACHE_DIR_ENV

    saved = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("mlx_spec_cache"))
    yield
    if saved is None:
        os.environ.pop(CACHE_DIR_ENV)
    else:
        os.environ[CACHE_DIR_ENV] = saved


@pytest.fixture(autouse=True)
def _fresh_kernel_switch():
    """Every test starts and ends with the kernel switch's decisions,
    warnings and built kernels forgotten."""
    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_tiny_checkpoint(root / f, f, seed=0) for f in FAMILIES}


@pytest.fixture(scope="session")
def models(checkpoint_dirs, plain_models):
    """family -> (model, tokenizer), loaded once per session through mlx_spec.load."""
    loaded = {f: mlx_spec.load(p) for f, p in checkpoint_dirs.items()}
    for f, (model, _) in loaded.items():
        register_twin(model, plain_models[f][0])
    return loaded


@pytest.fixture
def no_eos(models):
    """Every tokenizer runs its full lengths (no EOS) in the test."""
    saved = {f: tok.eos_token_ids for f, (_, tok) in models.items()}
    for _, tok in models.values():
        tok.eos_token_ids = set()
    yield
    for f, (_, tok) in models.items():
        tok.eos_token_ids = saved[f]


@pytest.fixture(scope="session")
def plain_models(checkpoint_dirs):
    """family -> (model, tokenizer) loaded by mlx-lm alone: the references
    run exactly mlx-lm's code, never anything mlx_spec installs."""
    return {f: mlx_lm.load(str(p)) for f, p in checkpoint_dirs.items()}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def predictive_model(tmp_path_factory):
    """A tiny qwen3_next whose MTP head predicts the target well, so sampled
    MTP drafts are often, but not always, accepted."""
    from mlx_spec.testing.mtp_heads import write_predictive_checkpoint

    path = write_predictive_checkpoint(tmp_path_factory.mktemp("pred"), "qwen3_next")
    return mlx_spec.load(path)[0]


def _save_mlx_dir(raw, out):
    """An mlx-community style directory: mlx-lm's own format, no mtp.* tensors."""
    model, _, config = mlx_lm.load(str(raw), return_config=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(raw / f, out / f)
    return out


@pytest.fixture(scope="session")
def save_mlx_dir():
    """Write an mlx-community style copy of a raw checkpoint (no mtp.*)."""
    return _save_mlx_dir


@pytest.fixture(scope="session")
def converted_dirs(tmp_path_factory):
    """family -> (raw dir, MLX dir + float32 sidecar written by mlx_spec convert)."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for fam in FAMILIES:
        raw = write_predictive_checkpoint(root / f"{fam}_raw", fam)
        mlx = _save_mlx_dir(raw, root / f"{fam}_mlx")
        assert not any(
            k.startswith("mtp.") for k in mx.load(str(mlx / "model.safetensors"))
        )
        assert (
            convert_main(
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
