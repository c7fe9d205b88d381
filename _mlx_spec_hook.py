"""The ``MLX_SPEC_PLUGIN=1`` switch: enables :mod:`mlx_spec.plugin` inside a
program the user does not change, once that program imports mlx-lm.

``mlx_spec_plugin.pth`` (installed next to this module in site-packages)
calls :func:`install` at every interpreter start where the variable is set
and not ``0``; otherwise it costs one environment lookup and imports
nothing.

This module imports only the standard library at start-up: mlx, mlx-lm and
mlx-spec are imported when the program itself imports mlx-lm (a program
that never does pays nothing more). It is a top-level module, not part of
the ``mlx_spec`` package, because importing anything under ``mlx_spec``
runs the package's ``__init__``, which imports mlx-lm.

Nothing here may stop the user's program: a bad value, an mlx-spec that
cannot be imported, options it refuses, all end as one line on stderr and
the program runs on mlx-lm's own code.
"""

# Built-in modules only (no importlib.abc, threading: tens of milliseconds
# more at every start-up with the switch on).
import _thread
import atexit
import os
import sys

VARIABLE = "MLX_SPEC_PLUGIN"
ON, OFF = ("1",), ("", "0")
# The plugin is enabled when both have been imported: mlx-lm (what it
# routes) and mlx-spec (a program that imports mlx_spec first imports mlx-lm
# from inside mlx_spec's __init__: enabling then would import a package
# half initialised).
_WATCHED = ("mlx_lm", "mlx_spec")
_PREFIX = "mlx_spec.plugin (MLX_SPEC_PLUGIN): "

_lock = _thread.allocate_lock()
_read = False
_finder = None
_plugin = None


def _warn(message: str) -> None:
    try:
        sys.stderr.write(_PREFIX + message[:300].replace("\n", " ") + "\n")
    except Exception:  # no stderr (pythonw, a closed stream): say nothing
        pass


def install() -> None:
    """Read ``MLX_SPEC_PLUGIN``; with ``1``, arrange for the plugin to be
    enabled as soon as mlx-lm is imported (at once if it already is)."""
    global _finder, _read
    # Once per process: a virtual environment's lib64 link makes Python
    # read the same site-packages, and so the .pth line, twice.
    with _lock:
        if _read:
            return
        _read = True
    value = os.environ.get(VARIABLE, "").strip()
    if value in OFF:
        return
    if value not in ON:
        _warn(f"must be 1 (on) or 0 (off), got {value!r:.40}; the plugin stays off")
        return
    with _lock:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
    _maybe_enable()


def _maybe_enable() -> None:
    """Enable the plugin once mlx-lm and mlx-spec are both fully imported
    (modules whose import is under way are in sys.modules already)."""
    global _plugin, _finder
    with _lock:
        if _finder is None or _finder.loading:
            return
        if "mlx_lm" not in sys.modules:
            return
        finder, _finder = _finder, None
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass
    try:
        from mlx_spec.plugin import enable_from_environment

        _plugin = enable_from_environment()
    except Exception as error:  # the program goes on with mlx-lm's code
        _warn(f"not enabled: {type(error).__name__}: {error}")
        return
    atexit.register(_report)


def _report() -> None:
    # Only a program that generated says anything: a tool that merely
    # imports mlx-lm keeps its stderr as it was.
    try:
        from mlx_spec.plugin import report

        if _plugin is not None and _plugin.decisions:
            sys.stderr.write(report(_plugin) + "\n")
    except Exception:
        pass


class _Finder:
    """Finds nothing itself: for ``mlx_lm`` and ``mlx_spec`` it asks the
    other finders and wraps the loader they return, to learn when the
    module's code has finished running."""

    def __init__(self):
        self.loading = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self)
        return spec


class _Loader:
    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module sees its real loader (importlib.resources, inspect and
        # pickle ask it), never this wrapper.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        name = module.__name__
        self.finder.loading.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            self.finder.loading.discard(name)
        _maybe_enable()
