"""The mlx-lm versions the package was tested on are declared (that only
mlx_lm_compat imports mlx_lm is checked in test_layout.py)."""

import pathlib
import re

from mlx_spec import mlx_lm_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_declared_range_covers_the_tested_versions():
    text = (ROOT / "pyproject.toml").read_text()
    lower, upper = re.search(r'"mlx-lm>=([\d.]+),<([\d.]+)"', text).groups()
    assert lower == mlx_lm_compat.TESTED_MLX_LM[0]
    for version in mlx_lm_compat.TESTED_MLX_LM:
        assert _parts(lower) <= _parts(version) < _parts(upper)


def _parts(version: str):
    return tuple(int(p) for p in version.split("."))
