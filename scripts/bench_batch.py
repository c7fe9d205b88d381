"""Batched speculative decoding without a server: tokens/s of a BatchDecoder
over the bench workloads, prefill excluded, for several row counts.

    python scripts/bench_batch.py [--model DIR] [--rows 1 2 4] [--draft ngram mtp+ngram]

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import json
import time

import mlx_spec
from mlx_spec.commands.bench import load_workloads, machine_info
from mlx_spec.core.batch import BatchDecoder
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import make_drafter


def run(model, prompts, draft, rows, max_tokens, num_draft_tokens):
    batch = BatchDecoder(model, rows, max_draft=8)
    for i in range(rows):
        d = SpeculativeDecoder(model, make_drafter(draft, model), max_draft=8)
        d.feed(prompts[i % len(prompts)])
        batch.add(d, max_tokens, num_draft_tokens=num_draft_tokens)
    tokens, passes = 0, 0
    tic = time.perf_counter()
    while batch.active:
        out = batch.step()
        passes += 1
        tokens += sum(len(t) for t, _ in out.values())
    seconds = time.perf_counter() - tic
    return {
        "draft": draft,
        "rows": rows,
        "tokens": tokens,
        "passes": passes,
        "tok_per_s": round(tokens / seconds, 1),
        "ms_per_pass": round(seconds / passes * 1e3, 2),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--draft", nargs="+", default=["ngram", "mtp+ngram"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", default="3")
    args = p.parse_args()
    k = args.num_draft_tokens
    k = k if k == "auto" else int(k)
    model, tok = mlx_spec.load(args.model)
    kinds = ("copy", "free")  # the long-context workload only slows prefill
    prompts = [tok.encode(w["prompt"]) for w in load_workloads(None, kinds, tok)]
    print(json.dumps(machine_info()))
    print("| draft | rows | tokens/s | ms per pass | tokens per pass |")
    print("|---|---|---|---|---|")
    for draft in args.draft:
        for rows in args.rows:
            r = run(model, prompts, draft, rows, args.max_tokens, k)
            print(
                f"| {draft} | {rows} | {r['tok_per_s']} | {r['ms_per_pass']} | "
                f"{r['tokens'] / r['passes']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
