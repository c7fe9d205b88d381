"""What the benchmark scripts share besides ``mlx_spec bench``'s workloads:
the median whole run and concurrent clients (rounds in alternating order come
from :func:`mlx_spec.timed_runs.interleaved`, which the doctor uses too).

They serve measurement only, so they live beside the scripts rather than in
the runtime package. A script run as ``python scripts/NAME.py`` imports them
as ``bench_helpers`` (its own folder is on ``sys.path``).
"""

import threading
import time
from typing import List

from mlx_spec.timed_runs import interleaved

__all__ = ["interleaved", "median_run", "concurrent_clients"]


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
