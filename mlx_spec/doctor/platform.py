"""The doctor's platform part: the machine, the versions, and which BLAS
MLX's CPU matmuls run on.

The BLAS matters twice on a CPU: the wheel's reference BLAS makes a verify
pass over T tokens cost nearly T one-token steps (so speculation seldom
pays), and a BLAS whose rows round differently with the number of rows can
make greedy speculative text leave plain decoding's (README, Losslessness).
"""

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from ..mlx_lm_compat import MLX_LM_VERSION, TESTED_MLX_LM
from .result import FAIL, PASS, SKIP, Part

OPENBLAS_HINT = (
    "install OpenBLAS (e.g. apt install libopenblas0-pthread) and start with "
    "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3: a verify "
    "pass then costs much closer to a one-token step"
)
# Library names of the BLAS implementations told apart, first match wins.
_BLAS_NAMES = (
    ("openblas", "OpenBLAS"),
    ("mkl", "Intel MKL"),
    ("blis", "BLIS"),
    ("blas", "reference BLAS"),
)
# Libraries that vendor a BLAS for themselves under renamed symbols (numpy,
# scipy): loaded into the process, but never what MLX calls.
_VENDORED = ("numpy.libs", "scipy.libs", "scipy_openblas")


def loaded_libraries(maps: Path = Path("/proc/self/maps")) -> List[str]:
    """The shared libraries mapped into this process (Linux; [] elsewhere)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in lines if ".so" in line})


def _blas_name(library: str) -> Optional[str]:
    base = library.lower()
    return next((name for needle, name in _BLAS_NAMES if needle in base), None)


def blas_in_use(
    libraries: Optional[List[str]] = None, preload: Optional[str] = None
) -> dict:
    """``{"name", "library", "advice"}``: the BLAS MLX's CPU matmuls call.

    On macOS, Accelerate. On Linux a BLAS in ``LD_PRELOAD`` comes first in
    symbol lookup, so it wins (an OpenBLAS preloaded as ``libblas.so.3`` is
    told by its ``openblas`` directory); else the BLAS the mlx wheel links
    (the reference BLAS it bundles), read from the libraries mapped into the
    process, leaving out the ones numpy and scipy vendor for themselves."""
    if sys.platform == "darwin":
        return {"name": "Accelerate", "library": "", "advice": ""}
    preload = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    libraries = loaded_libraries() if libraries is None else libraries
    preloaded = [p for p in re.split(r"[:\s]+", preload) if _blas_name(p)]
    mapped = [
        lib
        for lib in libraries
        if _blas_name(Path(lib).name) and not any(v in lib for v in _VENDORED)
    ]
    # the wheel's own BLAS before any other mapped one
    mapped.sort(key=lambda lib: "mlx" not in lib)
    for library in preloaded + mapped:
        name = _blas_name(library)
        if name == "reference BLAS" and "openblas" in library.lower():
            name = "OpenBLAS"
        return {
            "name": name,
            "library": library,
            "advice": OPENBLAS_HINT if name == "reference BLAS" else "",
        }
    return {"name": "unknown", "library": "", "advice": OPENBLAS_HINT}


def chip_name() -> str:
    """The CPU (Apple Silicon: e.g. "Apple M3 Max") as the OS names it."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gb() -> Optional[float]:
    """Physical memory in GB (None where it cannot be read)."""
    if mx.metal.is_available():
        size = mx.device_info().get("memory_size")
        if size:
            return round(size / 1e9, 1)
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _minor(version: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def check_platform(part: Part) -> Part:
    metal = bool(mx.metal.is_available())
    blas = blas_in_use()
    part.facts.update(
        os=platform.system(),
        os_version=(
            platform.release() if sys.platform != "darwin" else platform.mac_ver()[0]
        ),
        machine=platform.machine(),
        chip=chip_name(),
        cpu_count=os.cpu_count(),
        memory_gb=memory_gb(),
        python=platform.python_version(),
        mlx=mx.__version__,
        mlx_lm=MLX_LM_VERSION,
        mlx_spec=_version("mlx-spec"),
        device=str(mx.default_device()),
        metal=metal,
        gpu=str(mx.device_info().get("device_name", "")) if metal else "",
        blas=blas["name"],
        blas_library=blas["library"],
        ld_preload=os.environ.get("LD_PRELOAD", ""),
    )
    tested = {_minor(v) for v in TESTED_MLX_LM}
    if _minor(MLX_LM_VERSION) in tested:
        part.check("mlx-lm", PASS, f"{MLX_LM_VERSION} is a tested version")
    else:
        part.check(
            "mlx-lm",
            FAIL,
            f"{MLX_LM_VERSION} is not a tested version ({', '.join(TESTED_MLX_LM)}); "
            "install mlx-spec's pinned range",
        )
    if metal:
        part.check("device", PASS, f"Metal available ({part.facts['gpu']})")
    else:
        part.check("device", SKIP, f"no Metal: MLX runs on {part.facts['device']}")
    advice = f"; advice: {blas['advice']}" if blas["advice"] else ""
    part.check(
        "blas",
        SKIP if blas["advice"] else PASS,
        f"{blas['name']}{' (' + blas['library'] + ')' if blas['library'] else ''}"
        f"{advice}",
    )
    return part.settle(
        f"{part.facts['os']} {part.facts['machine']}, {part.facts['chip']}, "
        f"MLX {mx.__version__} on {part.facts['device']}"
    )
