"""The default model: a small trained Qwen3-Next-architecture model that ships with the package.

``mlx_spec/data/demo/`` is a raw Hugging Face ``qwen3_next`` checkpoint
(Gated-DeltaNet + gated attention + MoE with a shared expert, and its one-layer
MTP head under ``mtp.*``), trained on the Python standard library's own source
by ``scripts/train_demo/build_demo.py``; its model card is
``mlx_spec/data/demo/README.md``. It loads like a downloaded Qwen checkpoint:
``mlx_spec.load(default_model_path())``.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "data" / "demo"
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> Path:
    """Directory of the bundled demo checkpoint (raises if it is incomplete)."""
    missing = [f for f in _FILES if not (DEMO_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled demo model in {DEMO_DIR} is missing {', '.join(missing)}; "
            "reinstall mlx-spec, rebuild it with scripts/train_demo/build_demo.py, or "
            "pass --model"
        )
    return DEMO_DIR
