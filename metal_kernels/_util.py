"""Helpers shared by the kernel modules (no dependency on ``mlx_spec``).

Kernel objects are built lazily, on first use, through whatever
``mx.fast.metal_kernel`` is at that moment (MLX's, or the MSL harness's under
``tests/msl/harness.use_harness``), and cached per (kernel, factory) pair.
"""

from typing import Callable, Dict, Tuple

import mlx.core as mx

_kernels: Dict[Tuple, object] = {}


def cached_kernel(key: Tuple, build: Callable[[], object]):
    """The kernel object for ``key``, built by ``build()`` on first use.

    The cache is keyed by the current ``mx.fast.metal_kernel`` too, so a
    kernel built under the harness is never launched on Metal or vice versa.
    """
    full = (key, mx.fast.metal_kernel)
    kernel = _kernels.get(full)
    if kernel is None:
        kernel = _kernels[full] = build()
    return kernel


def clear_kernel_cache():
    _kernels.clear()


def is_float(dtype) -> bool:
    return dtype in (mx.float16, mx.bfloat16, mx.float32)


def kernel_stream():
    """The stream kernels run on (the GPU, whatever the default device is)."""
    return mx.gpu
