"""mlx-lm is reached from one module, with the versions it was tested on declared."""

import ast
import pathlib
import re

from mlx_spec import mlx_lm_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNTIME = ["mlx_spec", "metal_kernels"]
ALLOWED = {"mlx_spec/mlx_lm_compat.py"}


def _imports_of_mlx_lm(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        yield from (n for n in names if n == "mlx_lm" or n.startswith("mlx_lm."))


def test_only_the_compat_module_imports_mlx_lm():
    offenders = []
    for package in RUNTIME:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in ALLOWED and any(_imports_of_mlx_lm(path)):
                offenders.append(rel)
    assert offenders == []


def test_declared_range_covers_the_tested_versions():
    text = (ROOT / "pyproject.toml").read_text()
    lower, upper = re.search(r'"mlx-lm>=([\d.]+),<([\d.]+)"', text).groups()
    assert lower == mlx_lm_compat.TESTED_MLX_LM[0]
    for version in mlx_lm_compat.TESTED_MLX_LM:
        assert _parts(lower) <= _parts(version) < _parts(upper)


def _parts(version: str):
    return tuple(int(p) for p in version.split("."))
