"""The default model: works offline on a fresh machine.

Until a trained demo model ships with the package, the default is a tiny
random-weight ``qwen3_next`` checkpoint (real tensor layout, GDN + attention +
MoE + MTP tensors) built on first use. Its text is noise and its drafts are
rarely accepted; it exercises the whole path, not the speed.
"""

import os
import shutil
from pathlib import Path

from .tiny_checkpoint import write_tiny_checkpoint

_TINY_NAME = "tiny-qwen3_next-seed0"


def default_model_path() -> Path:
    """Path of the default model, building it under the cache dir if needed."""
    root = Path(os.environ.get("MLX_SPEC_CACHE", Path.home() / ".cache" / "mlx_spec"))
    path = root / _TINY_NAME
    if not (path / "config.json").exists():
        tmp = root / (_TINY_NAME + f".tmp{os.getpid()}")
        write_tiny_checkpoint(tmp, "qwen3_next", seed=0)
        try:
            tmp.rename(path)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
