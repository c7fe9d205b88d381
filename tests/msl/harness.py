"""Run ``mx.fast.metal_kernel`` kernels on a machine without Metal.

The harness takes the same arguments as ``mx.fast.metal_kernel``, writes the
kernel function the way MLX does (same parameters, same rules for which
shape/stride/thread-position parameters appear), compiles it as C++ against
``msl_shim.h`` and runs the grid with ``msl_runtime.cpp``, which executes
every GPU thread as a fiber so that SIMD-group functions and threadgroup
barriers have their GPU meaning.

Typical use::

    from msl.harness import use_harness   # tests/ on sys.path

    with use_harness(debug=True):
        kernel = mx.fast.metal_kernel(name=..., input_names=..., ...)
        out = kernel(inputs=..., grid=..., threadgroup=..., ...)

See tests/msl/README.md for the supported MSL subset and the limits.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_HEADER = os.path.join(HERE, "msl_shim.h")
RUNTIME_SOURCE = os.path.join(HERE, "msl_runtime.cpp")

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
# Kernel text -> C++
# ---------------------------------------------------------------------------
FILE_SOURCE = 0
FILE_HEADER = 1
_FILE_NAMES = {FILE_SOURCE: "source", FILE_HEADER: "header"}


def _mask_comments_and_strings(text: str) -> str:
    """Same length as text; comments and literals blanked (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            for k in range(i + 1, j - 1):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "<[(":
            depth += 1
        elif ch in ">])":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


_COLLECTIVE_RE = re.compile(
    r"(?:(?:::)?\bmetal::)?\b("
    + "|".join(COLLECTIVES)
    + r")\b(?=\s*(?:<[^;(){}]*>)?\s*\()"
)
_THREADGROUP_RE = re.compile(r"\bthreadgroup\b")
_HALF_LITERAL_RE = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b"
)
_REINTERPRET_RE = re.compile(r"\breinterpret_cast\s*<")
_DECL_FIRST_RE = re.compile(
    r"^\s*(.*?\S)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)*)$", re.S
)
_DECL_MORE_RE = re.compile(r"^\s*([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)*)$", re.S)
_ALIGNAS_RE = re.compile(r"\balignas\s*\([^()]*\)")


@dataclass
class _Site:
    file: int
    line: int
    col: int
    op: str

    def describe(self) -> str:
        return f"{_FILE_NAMES[self.file]} line {self.line}, column {self.col}"


class _Translator:
    """Rewrites MSL kernel text into C++ for msl_shim.h (positions kept)."""

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name
        self.sites: dict[int, _Site] = {}
        self.tg_count = 0

    def error(self, file: int, text: str, pos: int, what: str) -> MSLTranslationError:
        line, col = _line_col(text, pos)
        return MSLTranslationError(
            f"[msl harness] kernel '{self.kernel_name}': {what} "
            f"({_FILE_NAMES[file]} line {line}, column {col})"
        )

    def translate(self, text: str, file: int) -> str:
        masked = _mask_comments_and_strings(text)
        edits: list[tuple[int, int, str]] = []  # (start, end, replacement)

        for m in _COLLECTIVE_RE.finditer(masked):
            start = m.start()
            prev = masked[start - 1] if start > 0 else " "
            if prev == "." or masked[max(0, start - 2) : start] == "->":
                continue
            line, col = _line_col(text, m.start(1))
            if line >= (1 << 18) or col >= (1 << 10):
                site = 0
            else:
                site = (file << 28) | (line << 10) | col
                self.sites[site] = _Site(file, line, col, m.group(1))
            edits.append((start, m.end(), f"__msl_at<{site}u>::{m.group(1)}"))

        for m in _THREADGROUP_RE.finditer(masked):
            edit = self._threadgroup_decl(text, masked, m, file)
            if edit is not None:
                edits.append(edit)

        for m in _HALF_LITERAL_RE.finditer(masked):
            edits.append((m.start(), m.end(), f"(static_cast<half>({m.group(1)}))"))

        for m in _REINTERPRET_RE.finditer(masked):
            edits.append((m.start(), m.end(), "::msl::reinterpret_ptr<"))

        edits.sort()
        out, last = [], 0
        for start, end, rep in edits:
            if start < last:
                continue
            out.append(text[last:start])
            out.append(rep)
            last = end
        out.append(text[last:])
        return "".join(out)

    def _threadgroup_decl(self, text, masked, m, file):
        """`threadgroup T name[N];` -> storage shared by the threadgroup."""
        end = masked.find(";", m.end())
        if end < 0:
            return None
        seg = masked[m.end() : end]
        seg_plain = _ALIGNAS_RE.sub(" ", seg)
        flat = seg_plain
        while True:
            reduced = re.sub(r"\[[^\[\]]*\]", "", flat)
            if reduced == flat:
                break
            flat = reduced
        if any(ch in flat for ch in "*&(){}="):
            return None  # pointer, reference, parameter, cast or function
        parts = _split_top_level(seg_plain)
        first = _DECL_FIRST_RE.match(parts[0])
        if not first or not first.group(1).strip():
            raise self.error(
                file, text, m.start(), "unsupported threadgroup declaration"
            )
        type_name = " ".join(first.group(1).split())
        decls = [(first.group(2), first.group(3))]
        for extra in parts[1:]:
            d = _DECL_MORE_RE.match(extra)
            if not d:
                raise self.error(
                    file, text, m.start(), "unsupported threadgroup declaration"
                )
            decls.append((d.group(1), d.group(2)))
        code = []
        for name, dims in decls:
            self.tg_count += 1
            k = self.tg_count
            dims = "".join(dims.split())
            alias = f"__msl_tg_t{k}"
            code.append(
                f"using {alias} = {type_name}{dims}; auto& {name} = "
                f"*static_cast<{alias}*>(::msl::tg_alloc({k}, sizeof({alias}), "
                f"alignof({alias})));"
            )
        # keep the newlines of the declaration so that line numbers hold
        newlines = text[m.start() : end + 1].count("\n")
        return (m.start(), end + 1, " ".join(code) + "\n" * newlines)


# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------
def _cache_dir() -> str:
    d = os.environ.get("MLX_SPEC_MSL_CACHE")
    if not d:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        d = os.path.join(tempfile.gettempdir(), f"mlx_spec_msl-{uid}")
    os.makedirs(d, exist_ok=True)
    return d


_STUB_HEADERS = (
    "metal_stdlib",
    "metal_atomic",
    "metal_common",
    "metal_compute",
    "metal_integer",
    "metal_math",
    "metal_relational",
    "metal_geometric",
    "metal_simdgroup",
    "metal_stdlib.h",
)


def compiler() -> Optional[str]:
    """The C++ compiler the harness uses ($CXX, else g++, else c++)."""
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    return None


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise MSLCompileError(
            f"[msl harness] {what}: compiler failed\n$ {' '.join(cmd)}\n"
            + (proc.stderr or proc.stdout)[-6000:]
        )


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


_BASE_FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-w",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    # large frames probe every page, so they hit the guard page below each
    # GPU thread's stack instead of landing in the neighbour's
    "-fstack-clash-protection",
]
_lock = threading.RLock()
_runtime_libs: dict[tuple, tuple[ctypes.CDLL, str]] = {}
_kernel_libs: dict[str, ctypes.CDLL] = {}


def _atomic_build(target: str, build) -> None:
    if os.path.exists(target):
        return
    tmp = f"{target}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        build(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _runtime(use_ucontext: bool = False) -> tuple[ctypes.CDLL, str]:
    key = ("ucontext" if use_ucontext else "default",)
    with _lock:
        if key in _runtime_libs:
            return _runtime_libs[key]
        cxx = compiler()
        if cxx is None:
            raise MSLCompileError("[msl harness] no C++ compiler found (set $CXX)")
        flags = _BASE_FLAGS + ["-pthread", "-fvisibility=hidden"]
        if use_ucontext:
            flags.append("-DMSL_RT_USE_UCONTEXT")
        digest = _digest(_read(RUNTIME_SOURCE), _read(SHIM_HEADER), cxx, *flags)
        path = os.path.join(_cache_dir(), f"mslrt-{digest}.so")
        _atomic_build(
            path,
            lambda tmp: _run(
                [cxx, *flags, "-shared", "-I", HERE, RUNTIME_SOURCE, "-o", tmp],
                "building msl_runtime.cpp",
            ),
        )
        lib = ctypes.CDLL(path)  # local: kernels link to it by path
        lib.msl_rt_launch.restype = ctypes.c_int
        lib.msl_rt_launch.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        _runtime_libs[key] = (lib, path)
        return lib, path


def _stub_include_dir() -> str:
    d = os.path.join(_cache_dir(), "include")
    os.makedirs(d, exist_ok=True)
    for name in _STUB_HEADERS:
        p = os.path.join(d, name)
        if not os.path.exists(p):
            with open(p, "w") as f:
                f.write("// metal_stdlib stand-in: everything is in msl_shim.h\n")
    return d


def _build_kernel(
    cpp: str, kernel_name: str, debug: bool, use_ucontext: bool
) -> ctypes.CDLL:
    _, rt_path = _runtime(use_ucontext)
    cxx = compiler()
    flags = list(_BASE_FLAGS)
    if debug:
        flags.append("-fsanitize=bounds")
    digest = _digest(cpp, _read(SHIM_HEADER), rt_path, cxx, *flags)
    with _lock:
        lib = _kernel_libs.get(digest)
        if lib is not None:
            return lib
        cache = _cache_dir()
        so = os.path.join(cache, f"kern-{digest}.so")
        src = os.path.join(cache, f"kern-{digest}.cpp")
        inc = _stub_include_dir()

        def build(tmp):
            # private file names while building (another process may be
            # building the same kernel); the C++ is kept as kern-<hash>.cpp
            tmp_src = tmp + ".cpp"
            obj = tmp + ".o"
            with open(tmp_src, "w") as f:
                f.write(cpp)
            what = f"kernel '{kernel_name}' (C++ in {src})"
            include = ["-I", HERE, "-I", inc]
            try:
                if not debug:
                    # one step; the runtime is recorded by absolute path
                    _run(
                        [cxx, *flags, *include, "-shared", tmp_src, rt_path, "-o", tmp],
                        what,
                    )
                else:
                    # -fsanitize=bounds would link libubsan; the runtime has the
                    # handler instead, so compile and link separately
                    _run([cxx, *flags, *include, "-c", tmp_src, "-o", obj], what)
                    _run([cxx, "-shared", obj, rt_path, "-o", tmp], f"linking {what}")
            finally:
                os.replace(tmp_src, src)
                if os.path.exists(obj):
                    os.unlink(obj)

        _atomic_build(so, build)
        lib = ctypes.CDLL(so)
        _kernel_libs[digest] = lib
        return lib


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint32 * 3),
        ("tg", ctypes.c_uint32 * 3),
        ("nargs", ctypes.c_uint32),
        ("workers", ctypes.c_uint32),
        ("schedule", ctypes.c_uint32),
        ("simd_width", ctypes.c_uint32),
        ("stack_bytes", ctypes.c_uint64),
        ("args", ctypes.POINTER(ctypes.c_void_p)),
        ("lo", ctypes.POINTER(ctypes.c_void_p)),
        ("hi", ctypes.POINTER(ctypes.c_void_p)),
    ]


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


# ---------------------------------------------------------------------------
# The kernel object
# ---------------------------------------------------------------------------
@dataclass
class _Param:
    kind: str  # "buffer", "scalar", "shape", "strides", "ndim", "output"
    name: str
    ctype: str  # element type in C++
    msl: str  # the MSL declaration (for verbose output)


def _to_array(x) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


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


class HarnessKernel:
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

    # -- signature ---------------------------------------------------------
    def _params(self, inputs: list[mx.array], output_dtypes) -> list[_Param]:
        params = []
        for name, arr, (want_shape, want_strides, want_ndim) in zip(
            self.input_names, inputs, self.shape_infos
        ):
            t = _type_string(arr.dtype)
            space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
            if arr.ndim == 0:
                params.append(_Param("scalar", name, t, f"const {space} {t}& {name}"))
                continue
            params.append(_Param("buffer", name, t, f"const {space} {t}* {name}"))
            if want_shape:
                params.append(
                    _Param(
                        "shape",
                        f"{name}_shape",
                        "int",
                        f"const constant int* {name}_shape",
                    )
                )
            if want_strides:
                params.append(
                    _Param(
                        "strides",
                        f"{name}_strides",
                        "int64_t",
                        f"const constant int64_t* {name}_strides",
                    )
                )
            if want_ndim:
                params.append(
                    _Param(
                        "ndim",
                        f"{name}_ndim",
                        "int",
                        f"const constant int& {name}_ndim",
                    )
                )
        for name, dtype in zip(self.output_names, output_dtypes):
            t = _type_string(dtype)
            if self.atomic_outputs:
                params.append(
                    _Param(
                        "output",
                        name,
                        f"metal::atomic<{t}>",
                        f"device atomic<{t}>* {name}",
                    )
                )
            else:
                params.append(_Param("output", name, t, f"device {t}* {name}"))
        return params

    def _kernel_name(self, inputs, output_dtypes, template) -> str:
        kname = f"custom_kernel_{self.name}"
        if template:
            tdef = "<" + ", ".join(v for _, _, v in template) + ">"
            h = re.sub(r"<|>|, ", "_", tdef)[:-1]
            kname += "_" + h
        for a in inputs:
            kname += "_" + _type_string(a.dtype)
            if a.ndim == 0:
                kname += "s"
            elif a.size < MAX_CONSTANT_ARRAY_SIZE:
                kname += "c"
        for d in output_dtypes:
            kname += "_" + _type_string(d)
        return kname

    @staticmethod
    def _template_args(template) -> list[tuple[str, str, str]]:
        """(name, MSL parameter kind, value text) for each template arg."""
        out = []
        for name, value in template or []:
            if isinstance(value, mx.Dtype):
                out.append((name, "typename", _type_string(value)))
            elif isinstance(value, (bool, np.bool_)):
                # MLX streams bools as 1/0 into the kernel name and source
                out.append((name, "bool", "1" if value else "0"))
            elif isinstance(value, (int, np.integer)):
                out.append((name, "int", str(int(value))))
            else:
                raise TypeError(
                    f"[metal_kernel] template argument {name!r} must be a Dtype, int or bool"
                )
        return out

    def metal_source(self, inputs, output_dtypes, template=None) -> str:
        """The Metal source MLX would generate for these arguments."""
        inputs = [_to_array(x) for x in inputs]
        targs = self._template_args(template)
        params = self._params(inputs, output_dtypes)
        kname = self._kernel_name(inputs, output_dtypes, targs)
        src = self.header
        if targs:
            src += "template <" + ", ".join(f"{k} {n}" for n, k, _ in targs) + ">\n"
        lines = [f"  {p.msl} [[buffer({i})]]" for i, p in enumerate(params)]
        lines += [f"  {t} {a} [[{a}]]" for a, t in self.attributes]
        src += f"[[kernel]] void {kname}(\n" + ",\n".join(lines) + ") {\n"
        src += self.source + "\n}\n"
        if targs:
            inst = kname + "<" + ", ".join(v for _, _, v in targs) + ">"
            src += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
        return src

    def _cpp_source(self, params, targs, debug) -> tuple[str, _Translator]:
        tr = _Translator(self.name)
        header = tr.translate(self.header, FILE_HEADER)
        body = tr.translate(self.source, FILE_SOURCE)

        def ptype(p: _Param) -> str:
            if p.kind == "scalar":
                return f"const {p.ctype}&"
            if p.kind == "ndim":
                return "const int&"
            elem = p.ctype if p.kind == "output" else f"const {p.ctype}"
            return f"::msl::dptr<{elem}>" if debug else f"{elem}*"

        sig = [f"  {ptype(p)} {p.name}" for p in params]
        sig += [
            f"  {'metal::uint3' if t == 'uint3' else 'uint'} {a}"
            for a, t in self.attributes
        ]
        call = []
        for i, p in enumerate(params):
            if p.kind in ("scalar", "ndim"):
                ct = "int" if p.kind == "ndim" else p.ctype
                call.append(f"*static_cast<const {ct}*>(__d->args[{i}])")
                continue
            elem = p.ctype if p.kind == "output" else f"const {p.ctype}"
            raw = f"static_cast<{elem}*>(__d->args[{i}])"
            if debug:
                call.append(
                    f'::msl::dptr<{elem}>({raw}, __d->lo[{i}], __d->hi[{i}], "{p.name}")'
                )
            else:
                call.append(raw)
        for a, t in self.attributes:
            field = _ATTRIBUTE_FIELD[a]
            call.append(
                f"::msl::u3(__ti->{field})" if t == "uint3" else f"__ti->{field}"
            )
        tmpl = ""
        inst = ""
        if targs:
            tmpl = "template <" + ", ".join(f"{k} {n}" for n, k, _ in targs) + ">\n"
            inst = "<" + ", ".join(v for _, _, v in targs) + ">"
        parts = [
            f"// kernel '{self.name}', generated by tests/msl/harness.py\n",
            '#include "msl_shim.h"\n',
            '#line 1 "msl-header"\n',
            header,
            "\n",
            '#line 1 "msl-signature"\n',
            tmpl,
            "void __msl_kernel(\n" + ",\n".join(sig) + ") {\n",
            '#line 1 "msl-source"\n',
            body,
            "\n}\n",
            '#line 1 "msl-launch"\n',
            'extern "C" void msl_thread(const msl_launch_desc* __d, '
            "const msl_thread_info* __ti) {\n",
            f"  (void)__ti;\n  __msl_kernel{inst}(\n    "
            + ",\n    ".join(call)
            + ");\n}\n",
        ]
        return "".join(parts), tr

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
