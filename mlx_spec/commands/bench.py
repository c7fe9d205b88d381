"""``mlx_spec bench``: plain mlx-lm decoding against speculative settings, side by side.

For every workload prompt, plain ``mlx_lm.stream_generate`` and each speculative
setting run in alternation (A B C A B C ...), ``--repeats`` times, in one
process; medians are reported. One more run per setting with phase timing on
gives the time split, and the measured verify-cost profile turns the measured
acceptance into an ideal speedup, so achieved/ideal shows what the machinery
itself costs.

``prompt``: the setting's prompt tokens/s over plain decoding's (its
drafter's own prefill included: the MTP head's rows and the target's hidden
states they read).

Host cost per pass (ms), three ways. ``phases``: the wall time of the timed
run's phases besides drafting and the forward (the loop's bookkeeping,
sampling and rollback, each evaluated before the clock is read, so it holds
their device work too); ``work``: the host thread's CPU time in those phases
(the host's own work there: a host waiting for MLX uses no CPU); ``cpu``: the
host thread's CPU time per pass in the untimed runs, everything included
(graph building, MLX's setting up of each operation on the calling thread),
beside plain decoding's per step (``plain cpu``).

Greedy speculation is lossless, and every run checks it on the machine in
use: each speculative run's tokens are compared with the plain runs' (the
``tokens`` column: ``= plain``, or ``DIFF@i`` at the first position where
they differ, which also makes the command exit with status 1).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import List

from ..core.verify_profile import verify_cost_profile
from ..core.stats import SpecStats
from ..drafters import NO_DRAFTER, draft_names, make_drafter
from ..model_files import load_model
from ..timed_runs import (
    KINDS,
    first_difference,
    load_workloads,
    machine_info,
    run_plain,
    run_spec,
)
from .bench_report import format_table, lossless_report, plot
from .common import (
    MODEL_HELP,
    CommandError,
    add_draft_model_flags,
    add_revision_flag,
    attach_draft_model,
    bad_input,
    check_output_file,
    command,
    draft_length,
)


def ideal_speedup(stats: SpecStats, costs: List[float]) -> float:
    """Speedup if a pass cost only its target forward (measured profile)."""
    work = sum(
        n * costs[min(T, len(costs)) - 1] / costs[0]
        for T, n in stats.passes_by_tokens.items()
    )
    return stats.generated / work if work else 0.0


def summarise(name, kind, plain_runs, spec_runs, timed, costs) -> dict:
    plain_tps = statistics.median(r["tps"] for r in plain_runs)
    tps = statistics.median(r["tps"] for r in spec_runs)
    plain_prompt_tps = statistics.median(r["prompt_tps"] for r in plain_runs)
    prompt_tps = statistics.median(r["prompt_tps"] for r in spec_runs)
    host = statistics.median(1e3 * r["host_s_per_step"] for r in spec_runs)
    plain_host = statistics.median(1e3 * r["host_s_per_step"] for r in plain_runs)
    stats = timed["stats"]
    passes = max(stats.verify_passes, 1)
    ph = {p: 1e3 * s / passes for p, s in stats.phases.items()}
    # the phases besides drafting and the forward: wall time, each synced (host
    # work plus the device's sampling and rollback), and host CPU (host work)
    own = ("host", "sampling", "commit")
    phases = sum(ph.get(p, 0.0) for p in own)
    work = sum(1e3 * stats.phase_cpu.get(p, 0.0) / passes for p in own)
    ideal = ideal_speedup(stats, costs)
    speedup = tps / plain_tps if plain_tps else 0.0
    return {
        "workload": name,
        "kind": kind,
        "plain_tps": plain_tps,
        "tps": tps,
        "speedup": speedup,
        "plain_prompt_tps": plain_prompt_tps,
        "prompt_tps": prompt_tps,
        "acceptance_per_position": stats.acceptance_per_position,
        "tokens_per_pass": stats.tokens_per_pass,
        "phase_ms_per_pass": ph,
        "host_overhead_ms_per_pass": phases,
        "host_overhead_fraction_of_1_token_forward": phases / (1e3 * costs[0]),
        "host_work_ms_per_pass": work,
        "host_work_fraction_of_1_token_forward": work / (1e3 * costs[0]),
        "host_cpu_ms_per_pass": host,
        "plain_host_cpu_ms_per_step": plain_host,
        "host_cpu_overhead_fraction_of_1_token_forward": (host - plain_host)
        / (1e3 * costs[0]),
        "ideal_speedup": ideal,
        "achieved_over_ideal": speedup / ideal if ideal else 0.0,
        "peak_memory_gb": max(r["peak_memory_gb"] for r in spec_runs),
        # greedy speculation is lossless: every run's tokens are plain decoding's
        "first_token_differing_from_plain": first_difference(
            plain_runs, spec_runs + [timed]
        ),
    }


def run_bench(model, tok, workloads, settings, repeats, progress=None) -> List[dict]:
    costs = verify_cost_profile(model)
    results = []
    for w in workloads:
        prompt, max_tokens = w["prompt"], w["max_tokens"]
        # Warm-up: compile and allocate once per setting before timing.
        run_plain(model, tok, prompt, 8)
        for draft, k in settings:
            run_spec(model, tok, prompt, 8, draft, k)
        plain, spec = [], {s: [] for s in settings}
        for _ in range(repeats):
            plain.append(run_plain(model, tok, prompt, max_tokens))
            for s in settings:
                spec[s].append(run_spec(model, tok, prompt, max_tokens, *s))
                progress and progress()
        for s in settings:
            timed = run_spec(model, tok, prompt, max_tokens, *s, timing=True)
            row = summarise(w["name"], w["kind"], plain, spec[s], timed, costs)
            row.update(draft=s[0], num_draft_tokens=s[1])
            results.append(row)
    return results


def setup_parser():
    p = argparse.ArgumentParser(
        prog="mlx_spec bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", help=MODEL_HELP)
    add_revision_flag(p)
    p.add_argument(
        "--draft",
        nargs="+",
        default=["ngram", "mtp"],
        choices=[d for d in draft_names() if d != NO_DRAFTER],
    )
    p.add_argument(
        "--num-draft-tokens",
        nargs="+",
        type=draft_length,
        default=["auto"],
        help="Draft lengths to compare (integers and/or 'auto').",
    )
    p.add_argument(
        "--workload", nargs="+", choices=KINDS, help="Workload kinds (default: all)."
    )
    p.add_argument(
        "--workloads-file", help="A JSONL file of workloads instead of the bundled one."
    )
    add_draft_model_flags(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--max-tokens", type=int, help="Override every workload's max_tokens."
    )
    p.add_argument("--json", help="Write the results and machine facts to this file.")
    p.add_argument(
        "--plot", help="Write a PNG of speedup versus draft length (needs matplotlib)."
    )
    return p


def replace_draft(args, draft: str):
    """``args`` with ``draft`` as its one drafter (what the common flags read)."""
    return argparse.Namespace(**{**vars(args), "draft": draft})


@command("mlx_spec bench")
def main(argv=None):
    args = setup_parser().parse_args(argv)
    if args.repeats < 1:
        raise CommandError(f"--repeats must be >= 1, got {args.repeats}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:  # before the run, not after it
            check_output_file(path, flag)
    model_path, model, tok = load_model(args.model, revision=args.revision)
    if args.draft_model is not None or "dflash" in args.draft:
        if "dflash" not in args.draft:
            raise CommandError("--draft-model is read by --draft dflash")
        attach_draft_model(replace_draft(args, "dflash"), model)
    with bad_input():
        for draft in args.draft:  # one the model cannot serve: before any run
            make_drafter(draft, model)
        workloads = load_workloads(args.workloads_file, args.workload, tok)
    if args.max_tokens:
        for w in workloads:
            w["max_tokens"] = args.max_tokens
    settings = [(d, k) for d in args.draft for k in args.num_draft_tokens]
    from tqdm import tqdm

    bar = tqdm(
        total=len(workloads) * len(settings) * args.repeats,
        desc="bench",
        file=sys.stderr,
    )
    tic = time.perf_counter()
    try:
        with bad_input():
            results = run_bench(
                model, tok, workloads, settings, args.repeats, bar.update
            )
    finally:
        bar.close()
    print(format_table(results))
    info = machine_info()
    print(
        f"\n{info['device']}, MLX {info['mlx']}, BLAS: {info['blas']}, "
        f"{time.perf_counter() - tic:.0f} s"
    )
    if args.json:
        out = {
            "machine": info,
            "model": str(model_path),
            "repeats": args.repeats,
            "verify_cost_profile_s": verify_cost_profile(model),
            "results": results,
        }
        with bad_input(OSError):
            Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(results, args.plot)
    report = lossless_report(results)
    for line in report:
        print(line, file=sys.stderr)
    return 1 if any(line.startswith("error") for line in report) else 0
