"""The server's engine in-process at N clients: tokens/s per drafter, where
the worker's time went, and what each length of batch pass yields.

``bench_server.py`` measures the servers as clients see them (HTTP, separate
processes, one after the other). This drives :class:`mlx_spec.server.engine.Engine`
directly, with N client threads sending the bench workloads in turn (offset by
the client's index), greedy, every drafter in turn within one process and in
the reverse order each round: a drafter's rounds sit next to the others', so
the ratio between drafters within a round is steadier than any one's tokens/s
on a shared machine. Then, per drafter, its batch passes by rows and length
``T`` (1 + the longest draft): how many, the tokens they emitted, and the
worker's milliseconds in them (a plain pass queued behind the last one counts
the host's bookkeeping and the wait for it, so these are where the worker
spent its time, not a device's time per shape).

    python scripts/bench_engine.py [--model DIR] [--clients 4] [--rounds 3]
        [--drafts mtp+ngram ngram none] [--max-tokens 128]

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict

import mlx_spec
from bench_helpers import concurrent_clients, interleaved
from mlx_spec.timed_runs import load_workloads, machine_info
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import draft_names
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Finished, GenerationParams, Job

WORKLOADS = ["copy-function", "edit-class", "free-main", "free-class", "long-context"]


class _TimedEngine(Engine):
    """An engine whose batch notes each pass: (rows, T, tokens, seconds)."""

    def __init__(self, *args, **kwargs):
        self.pass_log = []
        super().__init__(*args, **kwargs)

    def _new_batch(self):
        batch = super()._new_batch()
        step, forward, length = batch.step, batch.forward, [1]

        def noting_length(plan):
            length[0] = plan.T  # a queued plain pass runs no forward here: T = 1
            return forward(plan)

        def timed_step(queue_ahead: bool = True):
            length[0], tic = 1, time.perf_counter()
            out = step(queue_ahead)
            tokens = sum(len(emitted) for emitted, _ in out.values())
            seconds = time.perf_counter() - tic
            self.pass_log.append((len(batch.rows), length[0], tokens, seconds))
            return out

        batch.step, batch.forward = timed_step, noting_length
        return batch


def _generate(engine, prompt, max_tokens: int, timeout: float = 600) -> int:
    """Tokens of one greedy request (raises what the engine reports)."""
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
    job = engine.submit(Job(prompt, params))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in job.get(timeout=timeout):
            if isinstance(event, Exception):
                raise event
            if isinstance(event, Finished):
                return event.completion_tokens
    raise TimeoutError(f"no answer within {timeout} s")


def run_round(model, tok, draft, prompts, args, passes) -> dict:
    """Every client sends every prompt once; tokens/s and the worker's split.
    Adds the round's passes to ``passes``: (rows, T) -> [passes, tokens, s]."""
    engine = _TimedEngine(model, tok, draft, batch_size=args.batch_size)
    try:
        _generate(engine, prompts[0], 8)  # warm: the policies' profiles
        before, logged = dict(engine.work), len(engine.pass_log)
        counts, wall = concurrent_clients(
            lambda prompt: _generate(engine, prompt, args.max_tokens),
            prompts,
            args.clients,
        )
    finally:
        engine.close()
    for rows, T, tokens, seconds in engine.pass_log[logged:]:
        seen = passes[(rows, T)]
        seen[0], seen[1], seen[2] = seen[0] + 1, seen[1] + tokens, seen[2] + seconds
    work = {k: engine.work[k] - before[k] for k in before}
    return {"draft": draft, "tps": sum(counts) / wall, **work}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--drafts", nargs="+", default=["mtp+ngram", "ngram", "none"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workloads", nargs="+", default=WORKLOADS)
    args = p.parse_args()
    for name, value in (("clients", args.clients), ("rounds", args.rounds)):
        if value < 1:
            p.error(f"--{name} must be at least 1, got {value}")
    for draft in args.drafts:
        if draft not in draft_names():
            p.error(f"unknown draft {draft!r}: one of {', '.join(draft_names())}")
    model, tok = mlx_spec.load(args.model)
    workloads = {w["name"]: w["prompt"] for w in load_workloads(tokenizer=tok)}
    unknown = [name for name in args.workloads if name not in workloads]
    if unknown:
        p.error(f"unknown workloads {unknown}: of {', '.join(workloads)}")
    prompts = [tok.encode(workloads[name]) for name in args.workloads]
    print(json.dumps(machine_info()), flush=True)
    runs = defaultdict(list)  # draft -> rounds
    passes = {d: defaultdict(lambda: [0, 0, 0.0]) for d in args.drafts}
    for r, draft in interleaved(args.drafts, args.rounds):
        runs[draft].append(run_round(model, tok, draft, prompts, args, passes[draft]))
        print(json.dumps({"round": r, **runs[draft][-1]}), flush=True)
    first = args.drafts[0]
    print(
        f"\n| drafter | tok/s, median | rounds | to `{first}`, per round | "
        "prefill s | passes s | passes |"
    )
    print("|---|---|---|---|---|---|---|")
    for draft, rounds in runs.items():
        ratio = [x["tps"] / y["tps"] for x, y in zip(rounds, runs[first])]
        mean = {
            k: statistics.mean(x[k] for x in rounds)
            for k in ("prefill_s", "passes_s", "passes")
        }
        tps = [x["tps"] for x in rounds]
        print(
            f"| {draft} | {statistics.median(tps):.1f} | "
            + " / ".join(f"{x:.1f}" for x in tps)
            + " | "
            + " / ".join(f"{x:.2f}" for x in ratio)
            + f" | {mean['prefill_s']:.2f} | {mean['passes_s']:.2f} | "
            f"{mean['passes']:.0f} |"
        )
    print("\n| drafter | rows | T | passes | tokens a pass | ms a pass | tokens a ms |")
    print("|---|---|---|---|---|---|---|")
    for draft, shapes in passes.items():
        for (rows, T), (n, tokens, seconds) in sorted(shapes.items()):
            print(
                f"| {draft} | {rows} | {T} | {n} | {tokens / n:.2f} | "
                f"{1e3 * seconds / n:.1f} | {tokens / seconds / 1e3:.3f} |"
            )


if __name__ == "__main__":
    try:
        main()
        status = 0
    except SystemExit as e:  # argparse's errors
        status = e.code
    except Exception:
        traceback.print_exc()
        status = 1
    # The engines ran MLX on worker threads; freeing their compile caches
    # while the interpreter finalizes aborts the process (as the server's
    # exit explains): nothing is left to tear down, so skip finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
