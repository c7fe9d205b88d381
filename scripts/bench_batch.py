"""Batched speculative decoding without a server: tokens/s of a BatchDecoder
over the bench workloads, prefill excluded, for several row counts, against
mlx-lm's batched plain decoding (``BatchGenerator``) of the same rows.

    python scripts/bench_batch.py [--model DIR] [--rows 1 2 4] [--draft ngram mtp+ngram none]
        [--repeats 3]
    python scripts/bench_batch.py --prefill 1024 [--rows 1 2 4]
    python scripts/bench_batch.py --attention

For each row count the settings (mlx-lm's rows first) run in turn,
``--repeats`` rounds, each round in the reverse order of the last, so a
busy spell of a shared machine falls on every setting alike; each line is
the round with the median tokens/s, against mlx-lm's median of the same rows.

``none``: this batch decoder with no drafter (every pass one token a row).
``--padded``: every drafter setting also runs (as ``DRAFT/padded``) with
every row's padding computed, as before passes skipped it (the Gated-DeltaNet
recurrence: ``set_row_lengths`` in ``mlx_spec/core/state.py``; the MLPs and the
LM head: ``mlx_spec/models/packed.py``): an A/B in one run.
``--shapes 9,1,1,1 4,4,4,4``: instead, one verify pass over rows holding
those many tokens (padded to the longest): with the padding computed, with
the recurrence skipping it, and with the MLPs and head skipping it too
(interleaved, medians of ``--repeats`` x 10).
``--attention``: instead, one attention layer's call over 4 rows of unequal
lengths, padded to the longest and masked against a call per row over its
own keys (which a pass makes where the padding wastes much:
``RaggedKVCache.row_key_counts``).
``--prefill N``: instead, what prefilling several prompts together would gain:
the model's plain forward over ``rows`` prompts of ``N`` tokens, one prompt
at a time against all of them as one ``[rows, N]`` batch (chunks of 256).

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from typing import List, Optional

import mlx.core as mx

import mlx_spec
from bench_helpers import interleaved, median_run
from mlx_spec.timed_runs import load_workloads, machine_info
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.core.ragged_cache import RaggedKVCache
from mlx_spec.mlx_lm_compat import (
    BatchGenerator,
    make_prompt_cache,
    scaled_dot_product_attention,
)
from mlx_spec.models.fast_layers import attend_rows_alone


def run(model, prompts, setting, rows, max_tokens, num_draft_tokens):
    draft, _, padded = setting.partition("/")
    batch = BatchDecoder(model, rows, max_draft=8)
    if padded:
        compute_padding(batch, "padded")
    for i in range(rows):
        drafter = None if draft == "none" else make_drafter(draft, model)
        d = SpeculativeDecoder(model, drafter, max_draft=8)
        d.feed(prompts[i % len(prompts)])
        batch.add(d, RowOptions(max_tokens, num_draft_tokens=num_draft_tokens))
    tokens, passes = 0, 0
    tic = time.perf_counter()
    while batch.active:
        out = batch.step()
        passes += 1
        tokens += sum(len(t) for t, _ in out.values())
        for id in set(out) - set(batch.active):
            batch.take(id)  # a finished row leaves, as the server takes it
    seconds = time.perf_counter() - tic
    return {
        "draft": setting,
        "rows": rows,
        "tokens": tokens,
        "passes": passes,
        "tok_per_s": round(tokens / seconds, 1),
        "ms_per_pass": round(seconds / passes * 1e3, 2),
    }


def run_mlx_lm(model, prompts, rows, max_tokens):
    """mlx-lm's batched plain decoding of the same rows (no stop token, as
    above), timed from the first step in which every row decodes."""
    gen = BatchGenerator(model, max_tokens=max_tokens)
    gen.insert([prompts[i % len(prompts)] for i in range(rows)], [max_tokens] * rows)
    tokens = steps = finished = 0
    tic = None
    for _ in range(100 * max_tokens):  # bounded; ends when every row finished
        _, responses = gen.next()
        if tic is None and len(responses) == rows:
            tic = time.perf_counter()  # this step's tokens are not counted
        elif tic is not None:
            tokens, steps = tokens + len(responses), steps + 1
        finished += sum(r.finish_reason is not None for r in responses)
        if finished == rows:
            break
    seconds = time.perf_counter() - tic
    gen.close()
    return {
        "draft": "mlx_lm",
        "rows": rows,
        "tokens": tokens,
        "passes": steps,
        "tok_per_s": round(tokens / seconds, 1),
        "ms_per_pass": round(seconds / steps * 1e3, 2),
    }


def prefill_seconds(model, tokens, rows, chunk=256):
    """Seconds of the plain forward over ``rows`` copies of ``tokens`` as one
    batch, chunk by chunk, each chunk evaluated with the caches."""
    cache, x = make_prompt_cache(model), mx.array([tokens] * rows)
    tic = time.perf_counter()
    for start in range(0, len(tokens), chunk):
        mx.eval(model(x[:, start : start + chunk], cache=cache)[:, -1])
        mx.eval([c.state for c in cache])
    return time.perf_counter() - tic


class _Whole:
    """Positions as a pass without padding sees them: all computed."""

    @contextmanager
    def ragged(self, lengths, T):
        yield

    def apply(self, f, x):
        return f(x)


def compute_padding(batch: BatchDecoder, mode: str):
    """``padded``: the batch's passes compute every row's padding, as they
    did before skipping it; ``recurrence``: all but the recurrence's;
    ``packed``: none (what the batch does)."""
    if mode in ("padded", "recurrence"):
        batch.positions = _Whole()  # the MLPs and head compute the padding
    if mode == "padded":  # the recurrence is not told the rows' lengths
        for c in batch.gdn:
            c.set_row_lengths = lambda n, c=c: setattr(
                c, "lengths", None if n is None else mx.array(n)
            )


SHAPE_MODES = ("padded", "recurrence", "packed")


def pass_ms(model, prompt, shape: List[int], mode: str, repeats: int) -> float:
    """Median ms of a verify pass whose rows hold ``shape[b]`` tokens."""
    batch = BatchDecoder(model, len(shape), max_draft=max(shape) - 1)
    compute_padding(batch, mode)
    for _ in shape:
        d = SpeculativeDecoder(model, None, max_draft=max(shape) - 1)
        d.feed(prompt)
        batch.add(d, RowOptions(1 << 20))
    T, times = max(shape), []
    ragged = None if min(shape) == T else shape
    inputs = mx.zeros((len(shape), T), mx.uint32)
    for _ in range(repeats):
        tic = time.perf_counter()
        for c in batch.gdn:
            c.capturing = True
            c.set_row_lengths(ragged)
        with batch.positions.ragged(ragged, T):
            logits, _ = batch.target.forward_rows(inputs, batch.positions)
        mx.eval(logits)
        times.append(time.perf_counter() - tic)
        batch.row_caches.commit([0] * len(shape), T)  # every row as before
    return statistics.median(times) * 1e3


def parse_shapes(texts: List[str]) -> Optional[List[List[int]]]:
    """``["9,1,1,1", ...]`` -> the rows' token counts; None if one is not
    counts of at least 0 with one of at least 1."""
    try:
        shapes = [[int(n) for n in text.split(",")] for text in texts]
    except ValueError:
        return None
    if any(min(shape) < 0 or max(shape) < 1 for shape in shapes):
        return None
    return shapes


def bench_shapes(model, prompt, shapes: List[List[int]], repeats: int):
    print("| rows' tokens | padding computed, ms | recurrence skips it | all skip it |")
    print("|---|---|---|---|")
    for shape in shapes:
        ms = {mode: [] for mode in SHAPE_MODES}
        for _, mode in interleaved(list(SHAPE_MODES), repeats):
            ms[mode].append(pass_ms(model, prompt, shape, mode, 10))
        padded, rec, packed = (statistics.median(ms[m]) for m in SHAPE_MODES)
        print(
            f"| {shape} | {padded:.2f} | {rec:.2f} ({padded / rec:.2f}x) | "
            f"{packed:.2f} ({padded / packed:.2f}x) |",
            flush=True,
        )


def bench_attention(model, repeats: int):
    """One attention layer's call over 4 rows of the lengths below, as a
    pass computes it: padded to the longest row and masked, against a call
    per row over its own keys (what ``RaggedKVCache.row_key_counts`` picks
    where the padding wastes much). Medians of ``repeats`` x 20 calls."""
    layer = next(l.self_attn for l in model.layers if hasattr(l, "self_attn"))
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    dim = layer.head_dim
    print("| rows' tokens | T | padded, us | a call per row, us | split? |")
    print("|---|---|---|---|---|")
    for lengths in ([380, 370, 150, 170], [300, 250, 40, 2119], [1000] * 3 + [2119]):
        for T in (1, 3):
            cache = RaggedKVCache()
            cache.offsets = list(lengths)  # keys before the pass: zeros
            mask = cache.make_mask(T, return_array=True)
            new = [mx.random.normal((4, kv_heads, T, dim)) for _ in "kv"]
            keys, values = cache.update_and_fetch(*new)
            q = mx.random.normal((4, heads, T, dim))
            mx.eval(q, keys, values, mask)
            calls = {
                "padded": lambda: scaled_dot_product_attention(
                    q, keys, values, None, layer.scale, mask
                ),
                "rows": lambda: attend_rows_alone(
                    q, keys, values, cache.offsets, layer.scale
                ),
            }
            us = {name: [] for name in calls}
            for _, name in interleaved(list(calls), repeats):
                tic = time.perf_counter()
                for _ in range(20):
                    mx.eval(calls[name]())
                us[name].append((time.perf_counter() - tic) / 20 * 1e6)
            padded, rows = (statistics.median(us[n]) for n in calls)
            split = "yes" if cache.row_key_counts() is not None else "no"
            print(f"| {lengths} | {T} | {padded:.0f} | {rows:.0f} | {split} |")


def bench_prefill(model, prompts, n, row_counts):
    longest = max(prompts, key=len)
    tokens = (longest * (n // len(longest) + 1))[:n]  # repeated up to n tokens
    prefill_seconds(model, tokens, 1)  # warm-up: the first forward is slower
    print("| rows | prompt tokens | one at a time, tok/s | together, tok/s | ratio |")
    print("|---|---|---|---|---|")
    for rows in row_counts:
        alone = sum(prefill_seconds(model, tokens, 1) for _ in range(rows))
        together = prefill_seconds(model, tokens, rows)
        print(
            f"| {rows} | {n} | {rows * n / alone:.0f} | {rows * n / together:.0f} | "
            f"{alone / together:.2f}x |",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--draft", nargs="+", default=["ngram", "mtp+ngram"])
    p.add_argument(
        "--no-mlx-lm", action="store_true", help="skip mlx-lm's batched baseline"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=1, help="rounds of every setting, interleaved"
    )
    p.add_argument("--num-draft-tokens", default="3")
    p.add_argument(
        "--padded",
        action="store_true",
        help="also run each drafter computing the rows' padding",
    )
    p.add_argument("--prefill", type=int, help="measure prefill of N-token prompts")
    p.add_argument("--shapes", nargs="+", help="time verify passes of these rows")
    p.add_argument(
        "--attention",
        action="store_true",
        help="time one attention call over rows of unequal lengths, padded or a call per row",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        help="the rows' prompts, by workload name (default: the copy and free-text "
        "ones; bench_server.py also sends long-context, whose attention makes "
        "every row's pass dearer)",
    )
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    shapes = parse_shapes(args.shapes or [])
    if shapes is None:
        p.error(f"--shapes wants token counts like 9,1,1,1, got {args.shapes}")
    k = args.num_draft_tokens
    k = k if k == "auto" else int(k)
    model, tok = mlx_spec.load(args.model)
    workloads = load_workloads(None, None, tok)
    names = args.workloads or [w["name"] for w in workloads if w["kind"] != "long"]
    prompts = [tok.encode(w["prompt"]) for w in workloads if w["name"] in names]
    print(json.dumps(machine_info()))
    if args.attention:
        return bench_attention(model, max(args.repeats, 5))
    if shapes:
        return bench_shapes(model, prompts[0], shapes, args.repeats)
    if args.prefill:
        return bench_prefill(model, prompts, args.prefill, args.rows)
    padded = [f"{d}/padded" for d in args.draft if d != "none"] if args.padded else []
    settings = ([] if args.no_mlx_lm else ["mlx_lm"]) + args.draft + padded
    print("| draft | rows | tokens/s (x mlx_lm) | ms per pass | tokens per pass |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        runs = {draft: [] for draft in settings}
        for _, draft in interleaved(settings, args.repeats):
            if draft == "mlx_lm":
                result = run_mlx_lm(model, prompts, rows, args.max_tokens)
            else:
                result = run(model, prompts, draft, rows, args.max_tokens, k)
            runs[draft].append(result)
        base = runs.get("mlx_lm")
        base = statistics.median(r["tok_per_s"] for r in base) if base else None
        for draft in settings:
            r = median_run(runs[draft], "tok_per_s")
            ratio = (
                f" ({r['tok_per_s'] / base:.2f}x)" if base and draft != "mlx_lm" else ""
            )
            print(
                f"| {draft} | {rows} | {r['tok_per_s']}{ratio} | {r['ms_per_pass']} | "
                f"{r['tokens'] / r['passes']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
