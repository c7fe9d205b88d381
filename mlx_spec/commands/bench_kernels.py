"""``mlx_spec bench-kernels``: each Metal kernel against MLX's built-in path.

The cases are the real Qwen3-Next / Qwen3.5 shapes (``mlx_spec.kernels.cases``).
Without Metal only the MLX references are timed; a case the device cannot run
is reported as skipped with the reason.
"""

import argparse
import os
import sys

import mlx.core as mx

from ..kernels.cases import bench_cases
from ..kernels.switch import metal_available, time_call


def _blas_note() -> str:
    if sys.platform == "darwin":
        return "macOS (Accelerate)"
    pre = os.environ.get("LD_PRELOAD", "")
    if "openblas" in pre.lower():
        return f"OpenBLAS preloaded ({pre})"
    return "the mlx[cpu] wheel's reference BLAS (no OpenBLAS preloaded)"


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlx_spec bench-kernels",
        description="Time each Metal kernel against MLX's built-in path on the "
        "real Qwen3-Next / Qwen3.5 shapes (references only without Metal).",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        choices=("gdn", "attention", "moe", "mtp_attention"),
        help="only these kernels (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1 rep")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    reps = 1 if args.quick else max(1, args.reps)
    metal = metal_available()
    print(f"device: {mx.default_device()}, Metal: {'yes' if metal else 'no'}")
    if not metal:
        print("no Metal back-end here: timing the MLX reference paths only")
        print(f"BLAS: {_blas_note()}")
    header = f"{'kernel':<14} {'shape':<44} {'built-in':>12}"
    if metal:
        header += f" {'kernel':>12} {'speedup':>8}"
    print(header)
    for case in bench_cases(quick=args.quick, only=args.kernel):
        line = f"{case.kernel_name:<14} {case.label:<44}"
        try:
            ref_t = time_call(case.reference, 1, reps)
        except Exception as exc:  # e.g. CPU gather_mm: float32 only
            reason = " ".join(str(exc).split())
            print(f"{line} skipped, this device cannot run it: {reason}", flush=True)
            continue
        line += f" {_fmt(ref_t):>12}"
        if metal:
            try:
                ker_t = time_call(case.kernel, 1, reps)
                line += f" {_fmt(ker_t):>12} {ref_t / ker_t:7.2f}x"
            except Exception as exc:
                line += f" failed: {type(exc).__name__}: {exc}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
