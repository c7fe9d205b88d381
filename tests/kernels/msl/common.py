"""Constants, dtypes, errors and options shared by the harness modules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

# Inputs with fewer elements than this go to the constant address space
# (MLX: max_constant_array_size).
MAX_CONSTANT_ARRAY_SIZE = 8
MAX_THREADS_PER_THREADGROUP = 1024
SIMD_WIDTH = 32

# Thread-position attributes MLX recognises, in MLX's order, with their type.
METAL_ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
# Field of msl_thread_info holding each attribute.
_ATTRIBUTE_FIELD = {name: name for name, _ in METAL_ATTRIBUTES}
_ATTRIBUTE_FIELD["grid_size"] = "threads_per_grid"

# Calls that synchronise lanes or threads; each call site gets an id.
COLLECTIVES = (
    "threadgroup_barrier",
    "simdgroup_barrier",
    "simd_sum",
    "simd_product",
    "simd_max",
    "simd_min",
    "simd_and",
    "simd_or",
    "simd_xor",
    "simd_all",
    "simd_any",
    "simd_ballot",
    "simd_is_first",
    "simd_prefix_exclusive_sum",
    "simd_prefix_inclusive_sum",
    "simd_prefix_exclusive_product",
    "simd_prefix_inclusive_product",
    "simd_broadcast",
    "simd_broadcast_first",
    "simd_shuffle",
    "simd_shuffle_xor",
    "simd_shuffle_down",
    "simd_shuffle_up",
    "simd_shuffle_rotate_down",
    "simd_shuffle_rotate_up",
)

# MLX dtype -> (MSL type name, numpy dtype used to hold the bits)
_DTYPES = {
    mx.bool_: ("bool", np.bool_),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.float32: ("float", np.float32),
    mx.float64: ("double", np.float64),
}


class MSLError(RuntimeError):
    """Base class of the harness's errors."""


class MSLTranslationError(MSLError):
    """The kernel text uses something the harness cannot translate."""


class MSLCompileError(MSLError):
    """The C++ compiler rejected the translated kernel."""


class MSLKernelError(MSLError):
    """The kernel misbehaved while running (divergence, out-of-bounds, ...)."""


class MSLRaceError(MSLKernelError):
    """Outputs depend on the order threads run in (a data race)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _type_string(dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise MSLError(f"[msl harness] unsupported dtype {dtype}") from None


def _np_dtype(dtype):
    return _DTYPES[dtype][1]


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------
@dataclass
class Options:
    """How kernels run.  None means: take it from the environment."""

    debug: Optional[bool] = None  # MLX_SPEC_MSL_DEBUG
    race_check: Optional[bool] = None  # MLX_SPEC_MSL_RACE_CHECK
    workers: Optional[int] = None  # MLX_SPEC_MSL_WORKERS (default min(2, cpus))
    schedule: Optional[str] = None  # "forward" | "reverse"; MLX_SPEC_MSL_SCHEDULE
    stack_kb: Optional[int] = None  # MLX_SPEC_MSL_STACK_KB (default 128)
    use_ucontext: Optional[bool] = None  # portable context switch (testing)

    def merged(self, other: "Options") -> "Options":
        vals = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in vals:
            if getattr(other, k) is not None:
                vals[k] = getattr(other, k)
        return Options(**vals)

    def resolved(self) -> "Options":
        env = os.environ
        return Options(
            debug=(
                _env_flag("MLX_SPEC_MSL_DEBUG")
                if self.debug is None
                else bool(self.debug)
            ),
            race_check=(
                _env_flag("MLX_SPEC_MSL_RACE_CHECK")
                if self.race_check is None
                else bool(self.race_check)
            ),
            workers=int(
                self.workers
                if self.workers is not None
                else env.get("MLX_SPEC_MSL_WORKERS", min(2, os.cpu_count() or 1))
            ),
            schedule=self.schedule or env.get("MLX_SPEC_MSL_SCHEDULE", "forward"),
            stack_kb=int(
                self.stack_kb
                if self.stack_kb is not None
                else env.get("MLX_SPEC_MSL_STACK_KB", 128)
            ),
            use_ucontext=bool(self.use_ucontext),
        )
