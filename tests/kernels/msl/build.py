"""Compiling kernels: the compiler, the on-disk/in-process library cache.

Libraries are cached by a hash of the generated C++, the compiler flags, the
shim headers and the runtime, so each distinct kernel text and template
instance compiles once.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Optional

from .common import MSLCompileError

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_HEADER = os.path.join(HERE, "msl_shim.h")
RUNTIME_SOURCE = os.path.join(HERE, "msl_runtime.cpp")


def _shim_bytes() -> bytes:
    """msl_shim.h and the headers it includes (msl_shim_*.h), in name order."""
    paths = [SHIM_HEADER] + sorted(glob.glob(os.path.join(HERE, "msl_shim_*.h")))
    return b"".join(_read(p) for p in paths)


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
        digest = _digest(_read(RUNTIME_SOURCE), _shim_bytes(), cxx, *flags)
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
    digest = _digest(cpp, _shim_bytes(), rt_path, cxx, *flags)
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
