"""Speculative against plain decoding on a target split over processes.

Run under ``mlx.launch`` (rank 0 prints); on one machine, two processes:

    mlx.launch --backend ring -n 2 python scripts/bench_pipeline.py [--model DIR]

Every traversal of the pipeline passes through every rank in turn, so its
cost is latency-bound; verifying 1 + k tokens per traversal is what
speculation buys. Reports tokens/s, tokens per traversal (verify pass) and
the speedup against plain decoding (no drafts, same loop) in the same run.
On Linux preload OpenBLAS and say so (LD_PRELOAD=...openblas.../libblas.so.3).
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

import mlx_spec
from mlx_spec.timed_runs import load_workloads, machine_info
from mlx_spec.core.stats import SpecStats
from mlx_spec.demo import default_model_path


def decode(model, tok, prompt, draft, k, max_tokens):
    """Tokens/s and tokens per pass of one greedy generation."""
    stats = SpecStats()
    session = None
    if draft == "none":  # mlx-lm's loop runs a step ahead: use ours, no drafts
        options = mlx_spec.DecodeOptions("none", num_draft_tokens=0)
        session = mlx_spec.Session(model, options, stats=stats)
        k = 0
    tic, n = time.perf_counter(), 0
    for r in mlx_spec.stream_generate(
        model,
        tok,
        prompt,
        max_tokens,
        draft=None if draft == "none" else draft,
        num_draft_tokens=k,
        session=session,
        stats=stats,
    ):
        if n == 0:
            tic = time.perf_counter()  # decode only
        n += 1
    seconds = time.perf_counter() - tic
    return (n - 1) / seconds, stats.tokens_per_pass


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft", nargs="+", default=["ngram", "mtp", "mtp+ngram"])
    p.add_argument("--num-draft-tokens", default="3")
    args = p.parse_args()
    k = (
        args.num_draft_tokens
        if args.num_draft_tokens == "auto"
        else int(args.num_draft_tokens)
    )
    group = mx.distributed.init()
    model, tok = mlx_spec.load(args.model, pipeline_group=group)
    rank0 = group.rank() == 0
    prompts = [w["prompt"] for w in load_workloads(None, ("copy", "free"), tok)]
    if rank0:
        print(json.dumps({**machine_info(), "ranks": group.size()}))
        print("| draft | tokens/s | tokens per traversal | speedup vs plain |")
        print("|---|---|---|---|")
    plain = None
    for draft in ["none"] + args.draft:
        runs = [
            decode(model, tok, prompt, draft, k, args.max_tokens)
            for _ in range(args.repeats)
            for prompt in prompts
        ]
        tps = statistics.median(r[0] for r in runs)
        per_pass = statistics.median(r[1] for r in runs)
        plain = tps if draft == "none" else plain
        if rank0:
            print(
                f"| {draft} | {tps:.1f} | {per_pass:.2f} | {tps / plain:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
