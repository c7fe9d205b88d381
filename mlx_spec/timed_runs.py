"""Timed runs of plain and speculative decoding, what ``bench`` and the
doctor both measure: the workloads they run (the bundled ones, or a JSONL
file), one run of each kind with its tokens/s and host CPU per step, the
first token where a speculative run leaves plain decoding, the rounds that
alternate settings, and the machine they ran on.
"""

import json
import os
import platform
import sysconfig
import time
from importlib import resources
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from .core.stats import SpecStats
from .generate import stream_generate
from .mlx_lm_compat import plain_stream_generate

KINDS = ("copy", "free", "long")


def load_workloads(path=None, kinds=None, tokenizer=None) -> List[dict]:
    """Workloads from a JSONL file (default: the bundled one); ``ValueError``
    naming the file and line for one that cannot be read."""
    if path is None:
        text = resources.files("mlx_spec").joinpath("data/workloads.jsonl").read_text()
    else:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read workloads file {path}: {e}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
            if row is not None and not isinstance(
                row.get("prompt", row.get("stdlib")), (str, list)
            ):
                raise ValueError("needs a 'prompt' (or 'stdlib') field")
            if row is not None and not isinstance(row.get("kind"), str):
                raise ValueError("needs a 'kind' field")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path or 'workloads'} line {number}: {e}") from None
        if row is not None:
            rows.append(row)
    rows = [r for r in rows if kinds is None or r["kind"] in kinds]
    for r in rows:
        if "stdlib" in r:
            r["prompt"] = _stdlib_prompt(r, tokenizer)
    return rows


def _stdlib_prompt(row, tokenizer) -> str:
    """A long prompt: lines of the named standard-library files (of this
    interpreter) until it holds ``min_prompt_tokens`` tokens, then a new function."""
    root = Path(sysconfig.get_paths()["stdlib"])
    source = "\n\n".join((root / f).read_text() for f in row["stdlib"])
    lines, text, used = source.splitlines(), "", 0
    need = row["min_prompt_tokens"]
    while used < len(lines) and (
        tokenizer is None or len(tokenizer.encode(text)) < need
    ):
        text += "\n".join(lines[used : used + 20]) + "\n"
        used += 20
    return text + "\n\n\ndef main(argv=None):\n"


def blas_in_use() -> str:
    """Which BLAS MLX's CPU matmuls resolve to in this process."""
    if platform.system() == "Darwin":
        return "Accelerate"
    preload = os.environ.get("LD_PRELOAD", "")
    if "blas" in preload.lower():
        return f"preloaded: {preload}"
    # The Linux mlx[cpu] wheel links the reference (netlib) BLAS it bundles.
    maps = Path("/proc/self/maps")
    bundled = maps.exists() and any(
        "mlx" in line and "libblas" in line for line in maps.read_text().splitlines()
    )
    return "reference BLAS bundled with mlx" if bundled else "reference BLAS (assumed)"


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal": mx.metal.is_available(),
        "blas": blas_in_use(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cpu_count": os.cpu_count(),
    }


def _decode(responses):
    """Run a response stream; (last response, host CPU seconds after the
    first, the token ids). The host CPU is the calling thread's CPU time: MLX
    evaluates on its own threads and a host waiting for it uses none, so this
    is the host's own work (graph building and bookkeeping), whatever the
    device does."""
    first, last, tokens = None, None, []
    for last in responses:
        if first is None:
            first = time.thread_time()
        tokens.append(last.token)
    return last, time.thread_time() - first, tokens


def run_plain(model, tok, prompt, max_tokens):
    mx.reset_peak_memory()
    last, host, tokens = _decode(
        plain_stream_generate(model, tok, prompt, max_tokens=max_tokens)
    )
    steps = max(last.generation_tokens - 1, 1)
    return {
        "tps": last.generation_tps,
        "prompt_tps": last.prompt_tps,
        "host_s_per_step": host / steps,
        "tokens": tokens,
    }


def run_spec(model, tok, prompt, max_tokens, draft, k, timing=False):
    mx.reset_peak_memory()
    stats = SpecStats()
    responses = stream_generate(
        model,
        tok,
        prompt,
        max_tokens=max_tokens,
        draft=draft,
        num_draft_tokens=k,
        stats=stats,
        timing=timing,
    )
    last, host, tokens = _decode(responses)
    return {
        "tokens": tokens,
        "tps": last.generation_tps,
        "prompt_tps": last.prompt_tps,  # the drafter's prefill included
        # the first pass ran before the first response
        "host_s_per_step": host / max(stats.verify_passes - 1, 1),
        "peak_memory_gb": last.peak_memory,
        "stats": stats,
    }


def first_difference(plain_runs, spec_runs) -> Optional[int]:
    """The first position where a speculative run's greedy tokens leave the
    plain runs' (None: every run emitted the plain tokens; -1: the plain runs
    disagree among themselves, so nothing can be judged)."""
    reference = plain_runs[0]["tokens"]
    if any(r["tokens"] != reference for r in plain_runs):
        return -1
    for r in spec_runs:
        if r["tokens"] != reference:
            pairs = zip(r["tokens"], reference)
            same = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            return min(len(r["tokens"]), len(reference)) if same is None else same
    return None


def interleaved(settings: list, rounds: int):
    """(round, setting) for ``rounds`` rounds of every setting in turn, each
    round in the reverse order of the last, so that a busy spell of a shared
    machine falls on every setting alike (the doctor's and the scripts' rounds)."""
    for r in range(rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            yield r, setting
