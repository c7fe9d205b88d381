"""Where mlx_spec keeps what it computes once per machine: measured verify
costs, the digests of weight files."""

import os
from pathlib import Path

CACHE_DIR_ENV = "MLX_SPEC_CACHE_DIR"  # default: ~/.cache/mlx_spec


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "mlx_spec")
