"""The default model: a small trained Qwen3-Next-architecture model that ships with the package,
and the DFlash block drafter trained for it.

``mlx_spec/data/demo/`` is a raw Hugging Face ``qwen3_next`` checkpoint
(Gated-DeltaNet + gated attention + MoE with a shared expert, and its one-layer
MTP head under ``mtp.*``), trained on the Python standard library's own source
by ``scripts/train_demo/build_demo.py``; its model card is
``mlx_spec/data/demo/README.md``. It loads like a downloaded Qwen checkpoint:
``mlx_spec.load(default_model_path())``.

``mlx_spec/data/demo_dflash/`` is a ``DFlashDraftModel`` checkpoint for it,
trained by ``scripts/train_dflash/train_dflash.py`` (card: its README.md):
``mlx_spec.load_drafter(default_drafter_path(), model)``. The demo model is
the one model that brings its own drafter: :func:`bundled_drafter` says which
drafter goes with a model the user named, so the commands need no special case.
"""

from pathlib import Path
from typing import Optional, Union

DATA_DIR = Path(__file__).resolve().parent / "data"
DEMO_DIR = DATA_DIR / "demo"
DRAFTER_DIR = DATA_DIR / "demo_dflash"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_DRAFTER_FILES = ("config.json", "model.safetensors")


def _complete(directory: Path, files, what: str, rebuild: str) -> Path:
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled {what} in {directory} is missing {', '.join(missing)}; "
            f"reinstall mlx-spec, {rebuild}"
        )
    return directory


def default_model_path() -> Path:
    """Directory of the bundled demo checkpoint (raises if it is incomplete)."""
    return _complete(
        DEMO_DIR,
        _FILES,
        "demo model",
        "rebuild it with scripts/train_demo/build_demo.py, or pass --model",
    )


def default_drafter_path() -> Path:
    """Directory of the bundled demo model's DFlash drafter (raises if it is
    incomplete)."""
    return _complete(
        DRAFTER_DIR,
        _DRAFTER_FILES,
        "DFlash drafter",
        "retrain it with scripts/train_dflash/train_dflash.py, or pass --draft-model",
    )


def is_demo_model(model: Union[str, Path, None]) -> bool:
    """Whether ``model`` (a ``--model`` value; None: the default) names the
    bundled demo model."""
    if model is None:
        return True
    path = Path(model)
    return path.is_dir() and path.resolve() == DEMO_DIR


def bundled_drafter(model: Union[str, Path, None]) -> Optional[Path]:
    """The DFlash drafter that ships with ``model`` (a ``--model`` value;
    None: the default model): the demo model's, else None."""
    return default_drafter_path() if is_demo_model(model) else None
