"""The doctor's built-in prompts: a copy and a free-text prompt each.

``--quick`` uses two short ones (``data/doctor_prompts.jsonl``: a prompt
that continues a pattern it holds, and the start of a function), whose
prefill is short enough for the whole check to stay within a minute on a
small model; otherwise the first copy and the first free workload of
``mlx_spec bench`` (longer prompts, 128 new tokens).
"""

from importlib import resources
from pathlib import Path
from typing import List

from ..timed_runs import load_workloads

QUICK_FILE = "data/doctor_prompts.jsonl"


def doctor_prompts(quick: bool) -> List[dict]:
    """Workload rows (``name``, ``kind``, ``prompt``, ``max_tokens``)."""
    if quick:
        path = Path(str(resources.files("mlx_spec").joinpath(QUICK_FILE)))
        return load_workloads(path)
    rows = load_workloads(kinds=("copy", "free"))
    return [next(w for w in rows if w["kind"] == kind) for kind in ("copy", "free")]
