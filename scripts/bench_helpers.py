"""What the benchmark scripts share besides ``mlx_spec bench``'s workloads:
the median whole run, concurrent clients (rounds in alternating order come
from :func:`mlx_spec.timed_runs.interleaved`, which the doctor uses too), and
``auto`` held at ``k = 0`` with a drafter's upkeep paid.

They serve measurement only, so they live beside the scripts rather than in
the runtime package. A script run as ``python scripts/NAME.py`` imports them
as ``bench_helpers`` (its own folder is on ``sys.path``).
"""

import threading
import time
from dataclasses import replace
from typing import List

from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.models.mtp import mtp_head_of
from mlx_spec.timed_runs import interleaved

__all__ = [
    "interleaved",
    "median_run",
    "concurrent_clients",
    "HELD_AT_ZERO",
    "held_at_zero",
]


def median_run(runs: List[dict], key: str) -> dict:
    """The run whose ``key`` is the median (the upper one of an even count)."""
    return sorted(runs, key=lambda run: run[key])[len(runs) // 2]


def concurrent_clients(request, prompts: list, clients: int):
    """``clients`` threads, each sending every prompt once in turn (client
    ``i`` from ``prompts[i % n]`` on) through ``request(prompt)``: the
    results and the wall seconds. A failed request is raised, named, once
    every client is done (the benchmark scripts' concurrent load)."""
    results, errors = [], []

    def client(i):
        for j in range(len(prompts)):
            try:
                results.append(request(prompts[(i + j) % len(prompts)]))
            except Exception as e:  # reported, not hidden
                errors.append(repr(e))

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return results, wall


# ``auto`` that never drafts: no acceptance before evidence, no probes.
HELD_AT_ZERO = replace(
    DEFAULT_TUNING, prior_acceptance=0.0, probe_every=10**9, max_probe_every=10**9
)


class _JudgedAsMisses:
    """A drafter whose first drafts judged in hindsight all count as misses
    (the judging itself runs): under :data:`HELD_AT_ZERO`, ``auto`` never
    finds a reason to draft, and the drafter's upkeep is paid as it is."""

    def hindsight(self):
        return {s: (0, n) for s, (_, n) in super().hindsight().items()}


class _NgramMisses(_JudgedAsMisses, NgramDrafter):
    pass


class _HeadMisses(_JudgedAsMisses, MTPDrafter):
    pass


class _HeadAndCopyMisses(_JudgedAsMisses, MTPNgramDrafter):
    pass


def held_at_zero(draft: str, model):
    """The drafter named ``draft`` for ``model``, judging only misses (a
    class of its own for each drafter: the engine asks a class once which
    contracts it implements)."""
    if draft == "ngram":
        return _NgramMisses()
    made = {"mtp": _HeadMisses, "mtp+ngram": _HeadAndCopyMisses}
    if draft not in made:
        raise SystemExit(f"no drafter held at k = 0 for {draft!r}")
    return made[draft](mtp_head_of(model))
