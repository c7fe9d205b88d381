"""Run ``mx.fast.metal_kernel`` kernels on a machine without Metal.

The harness takes the same arguments as ``mx.fast.metal_kernel``, writes the
kernel function the way MLX does (same parameters, same rules for which
shape/stride/thread-position parameters appear), compiles it as C++ against
``msl_shim.h`` and runs the grid with ``msl_runtime.cpp``, which executes
every GPU thread as a fiber so that SIMD-group functions and threadgroup
barriers have their GPU meaning.

Typical use::

    from msl.harness import use_harness   # tests/kernels/ on sys.path

    with use_harness(debug=True):
        kernel = mx.fast.metal_kernel(name=..., input_names=..., ...)
        out = kernel(inputs=..., grid=..., threadgroup=..., ...)

See tests/kernels/msl/README.md for the supported MSL subset and the limits.
The code is split by concept: ``common`` (constants, errors, options),
``translate`` (kernel text -> C++), ``signature`` (MLX's kernel signature),
``build`` (compiler and library cache), ``kernel`` (``HarnessKernel`` and
launching); this module is the public API.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence

import mlx.core as mx

from .build import (  # noqa: F401  (re-exported)
    HERE,
    RUNTIME_SOURCE,
    SHIM_HEADER,
    _kernel_libs,
    _runtime_libs,
    compiler,
)
from .common import (  # noqa: F401  (re-exported)
    MSLCompileError,
    MSLError,
    MSLKernelError,
    MSLRaceError,
    MSLTranslationError,
    Options,
)
from .kernel import HarnessKernel


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------
def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: Optional[dict] = None,
    *,
    debug: Optional[bool] = None,
    race_check: Optional[bool] = None,
    workers: Optional[int] = None,
    schedule: Optional[str] = None,
    stack_kb: Optional[int] = None,
    use_ucontext: Optional[bool] = None,
) -> HarnessKernel:
    """Drop-in for ``mx.fast.metal_kernel`` that runs on the CPU.

    The extra keyword arguments (also accepted when calling the kernel)
    control the harness: ``debug`` bounds-checks buffers and arrays,
    ``race_check`` runs the grid twice with opposite thread orders and
    compares, ``workers`` is the number of OS threads, ``schedule`` the
    thread order ("forward" or "reverse").
    """
    return HarnessKernel(
        name,
        input_names,
        output_names,
        source,
        header,
        ensure_row_contiguous,
        atomic_outputs,
        compile_options,
        Options(debug, race_check, workers, schedule, stack_kb, use_ucontext),
    )


_patch_lock = threading.Lock()


@contextlib.contextmanager
def use_harness(**options):
    """Make ``mx.fast.metal_kernel`` build harness kernels while active.

    Also makes ``mx.metal.is_available()`` return True, so code that only
    builds its kernels when Metal is present builds them.  ``options`` are
    the harness keywords of ``metal_kernel`` (debug, race_check, ...).
    Code that imported ``metal_kernel`` by name before entering keeps the
    MLX version.
    """
    opts = Options(**options)

    def patched(*args, **kwargs):
        mine = {
            k: kwargs.pop(k) for k in list(kwargs) if k in Options.__dataclass_fields__
        }
        kernel = metal_kernel(*args, **kwargs)
        kernel.options = opts.merged(Options(**mine))
        return kernel

    with _patch_lock:
        saved_kernel = mx.fast.metal_kernel
        saved_available = mx.metal.is_available
        mx.fast.metal_kernel = patched
        mx.metal.is_available = lambda: True
    try:
        yield patched
    finally:
        with _patch_lock:
            mx.fast.metal_kernel = saved_kernel
            mx.metal.is_available = saved_available


def available() -> bool:
    """True when a C++ compiler is there to build kernels."""
    return compiler() is not None


__all__ = [
    "HarnessKernel",
    "MSLCompileError",
    "MSLError",
    "MSLKernelError",
    "MSLRaceError",
    "MSLTranslationError",
    "Options",
    "available",
    "compiler",
    "metal_kernel",
    "use_harness",
]
