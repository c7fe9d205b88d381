"""The package's import structure: one way in from mlx-lm, no import circle,
test support that the runtime never imports."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# folder -> the package it installs as (metal_kernels/ is mlx_spec.kernels)
PACKAGES = {"mlx_spec": "mlx_spec", "metal_kernels": "mlx_spec.kernels"}


def _modules():
    """module name -> (path, is_package) for every module of the package."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            out[".".join([package] + parts)] = (path, is_package)
    return out


MODULES = _modules()


def _imports(name):
    """Absolute names of everything module ``name`` imports (at any depth of
    its code, module level or inside functions)."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def _internal_edges():
    """module -> the package modules it imports (names that are not modules,
    e.g. a function imported from a module, resolve to that module)."""
    edges = {}
    for name in MODULES:
        targets = set()
        for imported in _imports(name):
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            if imported and imported != name and imported != "mlx_spec":
                targets.add(imported)
        edges[name] = targets
    return edges


def test_every_folder_is_found():
    assert "mlx_spec.kernels.switch" in MODULES
    assert "mlx_spec.core.decode" in MODULES and "mlx_spec.testing" in MODULES
    assert _folder("mlx_spec.models.mtp.head") == "mlx_spec.models"
    assert _folder("mlx_spec.session") == "mlx_spec.session"


def _circles(edges):
    """The import circles of the graph ``edges`` (node -> nodes it imports)."""
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def _folder(name):
    """The folder a module is in, under mlx_spec (``mlx_spec.core`` for
    ``mlx_spec.core.batch``); a top-level module is a folder of its own."""
    return ".".join(name.split(".")[:2])


def _folder_edges():
    """folder -> the other folders its modules import."""
    edges = {}
    for name, targets in _internal_edges().items():
        others = {_folder(t) for t in targets} - {_folder(name)}
        edges.setdefault(_folder(name), set()).update(others)
    return edges


def test_no_import_circle():
    assert _circles(_internal_edges()) == []


def test_no_import_circle_between_folders():
    """The folders are layers (docs/layout.md): none imports one that
    imports it back, through any number of others."""
    assert _circles(_folder_edges()) == []


def test_only_the_command_line_imports_the_commands():
    """The library, the server and the doctor sit below the commands."""
    allowed = {"mlx_spec.commands", "mlx_spec.__main__"}
    importers = {
        folder
        for folder, targets in _folder_edges().items()
        if "mlx_spec.commands" in targets
    }
    assert importers <= allowed, sorted(importers - allowed)


def test_runtime_never_imports_test_support():
    edges = _internal_edges()
    runtime = [m for m in MODULES if not m.startswith("mlx_spec.testing")]
    offenders = {
        m: sorted(t for t in edges[m] if t.startswith("mlx_spec.testing"))
        for m in runtime
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_kernels_depend_only_on_the_mlx_lm_module():
    edges = _internal_edges()
    for name in MODULES:
        if name.startswith("mlx_spec.kernels"):
            outside = {t for t in edges[name] if not t.startswith("mlx_spec.kernels")}
            assert outside <= {"mlx_spec.mlx_lm_compat"}, (name, outside)


def test_only_the_compat_module_imports_mlx_lm():
    offenders = [
        name
        for name in MODULES
        if name != "mlx_spec.mlx_lm_compat"
        and any(i == "mlx_lm" or i.startswith("mlx_lm.") for i in _imports(name))
    ]
    assert offenders == []


def test_the_wheel_lists_every_package():
    """pyproject's explicit package list (needed to install metal_kernels/ as
    mlx_spec.kernels) names every folder of modules."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(mlx_spec[\w.]*)"', text.split("[tool.setuptools]")[1]))
    folders = {name.rpartition(".")[0] for name, (_, pkg) in MODULES.items() if not pkg}
    packages = {name for name, (_, is_package) in MODULES.items() if is_package}
    assert folders <= packages, sorted(folders - packages)  # each has an __init__.py
    assert packages <= listed, sorted(packages - listed)


def test_test_modules_have_unique_names():
    """The test folders are no packages (pytest puts each on sys.path), so two
    test modules of one name in different folders would clash on import."""
    tests = ROOT / "tests"
    seen = {}
    for path in sorted(tests.rglob("test_*.py")):
        if (path.parent / "__init__.py").exists():
            continue  # inside a package (kernels/msl): imported by its dotted name
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in seen.items() if len(p) > 1} == {}
