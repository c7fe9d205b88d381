"""The custom-kernel switch: which path each op takes, and the kernel cache.

``MLX_SPEC_KERNELS`` selects, per process, where the Metal kernels of this
package replace MLX's built-in paths:

* ``auto`` (default): a kernel is used only where Metal exists and, by a
  short benchmark run on first use, it beats the built-in path. The decision
  is cached per process and per *family* of shapes (the dims that do not
  change from one decoding step to the next), so a layer uses the same path
  for a one-token step and for a verify pass.
* ``on``: kernels wherever Metal exists; without Metal one warning and the
  MLX references.
* ``off``: the MLX references (exactly mlx-lm's behaviour).

Whatever the mode, a kernel that fails to compile or launch falls back to its
reference with one warning (per kernel); nothing crashes. Every kernel is
evaluated once per shape key on first use so that such failures surface
inside the dispatcher, not later at ``mx.eval``.
"""

import contextlib
import os
import statistics
import time
import warnings
from typing import Callable, Dict, Hashable, Optional, Set, Tuple

import mlx.core as mx

ENV = "MLX_SPEC_KERNELS"
MODES = ("auto", "on", "off")


class KernelWarning(RuntimeWarning):
    """A kernel could not be used and its MLX reference ran instead."""


_override: Optional[str] = None
_warned: Set[Hashable] = set()
_decisions: Dict[Tuple, bool] = {}
_probed: Set[Tuple] = set()
_broken: Set[Tuple] = set()
_kernels: Dict[Tuple, object] = {}


def mode() -> str:
    """The current mode: ``use_mode`` if active, else ``$MLX_SPEC_KERNELS``."""
    if _override is not None:
        return _override
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        warn_once(
            ("bad-mode", value),
            f"{ENV}={value!r} is not one of {'|'.join(MODES)}; using 'auto'",
        )
        return "auto"
    return value


@contextlib.contextmanager
def use_mode(value: str):
    """Force a mode for the duration of the block (tests, benchmarks)."""
    global _override
    if value not in MODES:
        raise ValueError(f"unknown kernel mode {value!r}; use one of {MODES}")
    saved, _override = _override, value
    try:
        yield
    finally:
        _override = saved


def metal_available() -> bool:
    return bool(mx.metal.is_available())


def warn_once(key: Hashable, message: str):
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, KernelWarning, stacklevel=3)


def reset():
    """Forget warnings, decisions, probes and built kernels (tests)."""
    _warned.clear()
    _decisions.clear()
    _probed.clear()
    _broken.clear()
    _kernels.clear()


def time_call(fn: Callable[[], object], warmup: int = 1, reps: int = 5) -> float:
    """Median wall time of ``mx.eval(fn())`` in seconds."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernels_wanted() -> bool:
    """True when a kernel may run now (mode not off and Metal present)."""
    m = mode()
    if m == "off":
        return False
    if not metal_available():
        if m == "on":
            warn_once(
                "no-metal",
                f"{ENV}=on but MLX has no Metal back-end on this machine; "
                "using the MLX reference paths",
            )
        return False
    return True


def dispatch(
    name: str,
    kernel: Callable[[], object],
    reference: Callable[[], object],
    probe_key: Hashable,
    family: Hashable = None,
    decide: Optional[Callable[[], bool]] = None,
):
    """Run ``kernel()`` or ``reference()`` (zero-argument callables).

    ``probe_key``: the kernel's shape/template key; the first call per key
    evaluates the kernel inside a ``try`` so that compile and launch errors
    fall back. ``family``: the key of the ``auto`` decision (defaults to
    ``probe_key``); ``decide()`` returns True when the kernel is faster
    (default: time both on this call's inputs).
    """
    if not kernels_wanted():
        return reference()
    pkey = (name, probe_key)
    if pkey in _broken:
        return reference()
    if mode() == "auto":
        dkey = (name, probe_key if family is None else family)
        if dkey not in _decisions:
            _decisions[dkey] = _decide(name, pkey, kernel, reference, decide)
        if not _decisions[dkey]:
            return reference()
    if pkey in _probed:
        return kernel()
    out = _probe(name, pkey, kernel)
    return reference() if out is None else out


def _probe(name, pkey, kernel):
    try:
        out = kernel()
        mx.eval(out)
    except Exception as exc:  # compile or launch failure: never crash
        _broken.add(pkey)
        warn_once(
            ("failed", name),
            f"metal kernel {name!r} failed ({type(exc).__name__}: {exc}); "
            "using its MLX reference",
        )
        return None
    _probed.add(pkey)
    return out


def _decide(name, pkey, kernel, reference, decide) -> bool:
    if pkey not in _probed and _probe(name, pkey, kernel) is None:
        return False
    try:
        if decide is not None:
            return bool(decide())
        return time_call(kernel, 1, 3) < time_call(reference, 1, 3)
    except Exception as exc:
        warn_once(
            ("bench-failed", name),
            f"benchmarking metal kernel {name!r} failed ({exc}); using its reference",
        )
        return False


# -- building kernels ---------------------------------------------------------
def cached_kernel(key: Tuple, build: Callable[[], object]):
    """The kernel object for ``key``, built by ``build()`` on first use.

    Built through whatever ``mx.fast.metal_kernel`` is current (MLX's, or the
    MSL harness's under ``tests/kernels/msl``) and cached per that function too, so a
    kernel built under the harness is never launched on Metal or vice versa.
    """
    full = (key, mx.fast.metal_kernel)
    kernel = _kernels.get(full)
    if kernel is None:
        kernel = _kernels[full] = build()
    return kernel


def is_float(dtype) -> bool:
    return dtype in (mx.float16, mx.bfloat16, mx.float32)


def kernel_stream():
    """The stream kernels run on (the GPU, whatever the default device is)."""
    return mx.gpu
