"""``HarnessKernel``: what ``metal_kernel`` returns; launching a grid."""

from __future__ import annotations

import ctypes
import re
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from .build import _build_kernel, _LaunchDesc, _runtime
from .common import (
    MAX_THREADS_PER_THREADGROUP,
    METAL_ATTRIBUTES,
    SIMD_WIDTH,
    MSLKernelError,
    MSLRaceError,
    Options,
    _np_dtype,
)
from .signature import SignatureMixin, _to_array
from .translate import _Translator


def _as_numpy(a: mx.array) -> np.ndarray:
    """A numpy view (no copy when possible) of an evaluated MLX array."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


def _extent(view: np.ndarray) -> tuple[int, int]:
    """[lo, hi) byte addresses the array's elements occupy."""
    base = view.ctypes.data
    if view.size == 0:
        return base, base
    lo = hi = 0
    for n, s in zip(view.shape, view.strides):
        span = (n - 1) * s
        if span < 0:
            lo += span
        else:
            hi += span
    return base + lo, base + hi + view.itemsize


class HarnessKernel(SignatureMixin):
    """What ``metal_kernel`` returns: call it like MLX's kernel object."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: Optional[dict] = None,
        options: Optional[Options] = None,
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.options = options or Options()
        # Same detection as MLX: a plain substring search of the source.
        self.shape_infos = [
            (f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
            for n in self.input_names
        ]
        self.attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]

    def __repr__(self) -> str:
        return f"<msl harness kernel {self.name!r}>"

    # -- running -----------------------------------------------------------
    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[Any],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Optional[Sequence[tuple[str, Any]]] = None,
        init_value: Optional[float] = None,
        verbose: bool = False,
        stream: Any = None,
        **overrides,
    ) -> list[mx.array]:
        del stream  # there is one device here
        opts = self.options.merged(Options(**overrides)).resolved()
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                f"but got size {len(inputs)}."
            )
        if len(output_shapes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_shapes` to have size "
                f"{len(self.output_names)} but got size {len(output_shapes)}."
            )
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_dtypes` to have size "
                f"{len(self.output_names)} but got size {len(output_dtypes)}."
            )
        grid = tuple(int(g) for g in grid)
        threadgroup = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(threadgroup) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must have 3 entries")
        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed "
                f"threads per threadgroup ({MAX_THREADS_PER_THREADGROUP})."
            )
        if tg_size <= 0:
            raise ValueError("[metal_kernel] threadgroup sizes must be positive")

        arrays = [_to_array(x) for x in inputs]
        mx.eval(arrays)
        targs = self._template_args(template)
        output_dtypes = list(output_dtypes)
        params = self._params(arrays, output_dtypes)
        if verbose:
            print(
                f"Generated source code for `{self.name}`:\n```\n"
                f"{self.metal_source(arrays, output_dtypes, template)}\n```"
            )
        cpp, tr = self._cpp_source(params, targs, opts.debug)
        lib = _build_kernel(cpp, self.name, opts.debug, opts.use_ucontext)
        rt, _ = _runtime(opts.use_ucontext)

        # Arguments, in parameter order.
        keep: list[np.ndarray] = []
        ptrs, los, his = [], [], []

        def add(view: np.ndarray):
            keep.append(view)
            lo, hi = _extent(view)
            ptrs.append(view.ctypes.data)
            los.append(lo)
            his.append(hi)

        in_views = []
        for a in arrays:
            v = _as_numpy(a)
            if self.ensure_row_contiguous and not v.flags.c_contiguous:
                v = np.ascontiguousarray(v)
            in_views.append(v)
        it = iter(zip(arrays, in_views))
        cur = None
        for p in params:
            if p.kind in ("buffer", "scalar"):
                cur = next(it)
                add(cur[1])
            elif p.kind == "shape":
                add(np.asarray(cur[1].shape, dtype=np.int32))
            elif p.kind == "strides":
                v = cur[1]
                add(np.asarray([s // v.itemsize for s in v.strides], dtype=np.int64))
            elif p.kind == "ndim":
                add(np.asarray(cur[1].ndim, dtype=np.int32))
        out_slots = len(ptrs)

        def fresh_outputs() -> list[np.ndarray]:
            outs = []
            for shape, dtype in zip(output_shapes, output_dtypes):
                o = np.empty(tuple(int(s) for s in shape), dtype=_np_dtype(dtype))
                if init_value is not None:
                    fill = (
                        np.array(mx.array(init_value, dtype=dtype).view(mx.uint16))
                        if (dtype == mx.bfloat16)
                        else init_value
                    )
                    o[...] = fill
                else:
                    # Uninitialised on the GPU: poison (NaN for floats).
                    o.view(np.uint8).fill(0xFF)
                outs.append(o)
            return outs

        clipped = tuple(min(t, g) if g > 0 else t for t, g in zip(threadgroup, grid))

        def launch(outs: list[np.ndarray], schedule: int) -> None:
            del ptrs[out_slots:], los[out_slots:], his[out_slots:]
            for o in outs:
                add(o)
            n = len(ptrs)
            desc = _LaunchDesc()
            desc.grid[:] = grid
            desc.tg[:] = clipped
            desc.nargs = n
            desc.workers = max(1, opts.workers)
            desc.schedule = schedule
            desc.simd_width = SIMD_WIDTH
            desc.stack_bytes = opts.stack_kb * 1024
            arr_t = ctypes.c_void_p * max(n, 1)
            a_args, a_lo, a_hi = arr_t(*ptrs), arr_t(*los), arr_t(*his)
            desc.args = ctypes.cast(a_args, ctypes.POINTER(ctypes.c_void_p))
            desc.lo = ctypes.cast(a_lo, ctypes.POINTER(ctypes.c_void_p))
            desc.hi = ctypes.cast(a_hi, ctypes.POINTER(ctypes.c_void_p))
            err = ctypes.create_string_buffer(8192)
            fn = ctypes.cast(lib.msl_thread, ctypes.c_void_p)
            if min(grid) <= 0:
                return
            rc = rt.msl_rt_launch(ctypes.byref(desc), fn, err, len(err))
            if rc != 0:
                raise MSLKernelError(
                    f"[msl harness] kernel '{self.name}': "
                    + _describe(err.value.decode(errors="replace"), tr)
                )

        schedule = 1 if opts.schedule == "reverse" else 0
        outs = fresh_outputs()
        launch(outs, schedule)
        if opts.race_check:
            again = fresh_outputs()
            launch(again, 1 - schedule)
            for name, a, b in zip(self.output_names, outs, again):
                if a.tobytes() != b.tobytes():
                    bad = np.flatnonzero(
                        a.view(np.uint8).ravel() != b.view(np.uint8).ravel()
                    )
                    first = int(bad[0]) // a.itemsize
                    raise MSLRaceError(
                        f"[msl harness] kernel '{self.name}': output '{name}' depends on "
                        f"the order threads run in (first difference at element {first}: "
                        f"{a.ravel()[first]!r} vs {b.ravel()[first]!r}); a missing "
                        "threadgroup_barrier or another data race?"
                    )
        result = []
        for o, dtype in zip(outs, output_dtypes):
            if dtype == mx.bfloat16:
                result.append(mx.array(o).view(mx.bfloat16))
            else:
                result.append(mx.array(o))
        return result


def _describe(message: str, tr: _Translator) -> str:
    def site(m):
        s = tr.sites.get(int(m.group(1)))
        return s.describe() if s else "an unknown place"

    message = re.sub(r"@@site:(\d+)@@", site, message)
    message = re.sub(
        r"msl-(source|header):(\d+):(\d+)", r"\1 line \2, column \3", message
    )
    return message
