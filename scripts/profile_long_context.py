"""What a speculative pass at ``k = 0`` does beyond plain mlx-lm decoding, on
a long prompt (the ``long-context`` workload: about 2,000 tokens), counted,
not timed.

Variants, each decoding the same prompt greedily, every output checked equal
to plain decoding's:

- ``plain``: mlx-lm's ``stream_generate``;
- ``<drafter> k=0``: ``auto`` held at ``k = 0`` (no acceptance prior, no
  probes, every first draft judged in hindsight counted as a miss: the
  judging runs, it never pays), so every pass is a plain one queued ahead
  and what differs from ``plain`` is the engine's own per-pass work;
- ``<drafter> auto``: the default ``auto``.

For each: the passes by length, drafts made and accepted, and how often the
run corrected (and wrote back) the cost profile; then, per generated token,
the Python calls made (in mlx_spec, in mlx_lm, elsewhere) and the mlx_spec
functions called most, from a ``sys.setprofile`` hook over the generation
after its first token (the prompt's prefill excluded). The hook slows the
host, which changes what ``auto`` chooses (it times its passes): the pass
counts of ``auto`` are those of a run without it (``--no-count``). Nothing
here is a timing but ``--no-count``'s tokens/s after the first token (as
``mlx_spec bench`` counts them), meaningful on a quiet machine only. For
where the time goes, run one variant without counting under a sampling
profiler (``--no-count --only NAME``).

    python scripts/profile_long_context.py [--tokens 128] [--draft ngram mtp]
        [--workload long-context] [--top 12]
    py-spy record -o /tmp/k0.json --format speedscope -- \\
        python scripts/profile_long_context.py --no-count --only "ngram k=0"
"""

import argparse
import collections
import sys
import time

import mlx_spec
from mlx_spec import DecodeOptions, Session
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.core.verify_profile import cost_profile
from mlx_spec.demo import default_model_path
from mlx_spec.mlx_lm_compat import plain_stream_generate
from mlx_spec.timed_runs import load_workloads

from bench_helpers import HELD_AT_ZERO, held_at_zero


class Counter:
    """Counts, under ``sys.setprofile``, the Python functions called (MLX's
    own functions are not Python's builtins: the hook does not see them)."""

    def __init__(self):
        self.on = False
        self.py_calls = collections.Counter()

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            code = frame.f_code
            self.py_calls[(code.co_filename, code.co_name)] += 1

    def summary(self, tokens: int, top: int) -> dict:
        per = 1.0 / max(tokens, 1)
        by_package = collections.Counter()
        spec = collections.Counter()
        for (path, name), n in self.py_calls.items():
            package = (
                "mlx_spec"
                if "/mlx_spec/" in path
                else "mlx_lm" if "/mlx_lm/" in path else "other"
            )
            by_package[package] += n
            if package == "mlx_spec":
                short = path.split("/mlx_spec/")[-1]
                spec[f"{short}:{name}"] += n
        return {
            "py_calls": {k: v * per for k, v in by_package.items()},
            "top_mlx_spec": [(f, n * per) for f, n in spec.most_common(top)],
        }


def run_plain(model, tok, prompt, tokens, counter):
    out, tic = [], None
    for r in plain_stream_generate(model, tok, prompt, max_tokens=tokens):
        out.append(r.token)
        tic = tic or time.perf_counter()
        if counter is not None and len(out) == 1:
            counter.on = True
    if counter is not None:
        counter.on = False
    return out, None, (len(out) - 1) / (time.perf_counter() - tic)


def run_spec(model, tok, prompt, tokens, draft, held, counter):
    drafter = held_at_zero(draft, model) if held else draft
    tuning = HELD_AT_ZERO if held else DEFAULT_TUNING
    session = Session(model, DecodeOptions(drafter, "auto", tuning=tuning))
    out, tic = [], None
    for token, _, _ in session.generate(prompt, max_tokens=tokens):
        out.append(token)
        tic = tic or time.perf_counter()
        if counter is not None and len(out) == 1:
            counter.on = True
    if counter is not None:
        counter.on = False
    return out, session.stats, (len(out) - 1) / (time.perf_counter() - tic)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--workload", default="long-context")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--draft", nargs="+", default=["ngram", "mtp", "mtp+ngram"])
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--only", help="run only this variant (e.g. 'ngram k=0')")
    p.add_argument("--no-count", action="store_true", help="no counting hook")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    model, tok = mlx_spec.load(args.model or default_model_path())
    profile = cost_profile(model)
    (work,) = [w for w in load_workloads(tokenizer=tok) if w["name"] == args.workload]
    prompt = tok.encode(work["prompt"])
    print(f"{args.workload}: {len(prompt)} prompt tokens, {args.tokens} generated")
    variants = {"plain": lambda c: run_plain(model, tok, prompt, args.tokens, c)}
    for d in args.draft:
        for held, label in ((True, "k=0"), (False, "auto")):
            variants[f"{d} {label}"] = lambda c, d=d, held=held: run_spec(
                model, tok, prompt, args.tokens, d, held, c
            )
    if args.only:
        variants = {args.only: variants[args.only]}
    reference, _, _ = run_plain(model, tok, prompt, args.tokens, None)
    for name, run in variants.items():
        run(None)  # warm-up: shapes compiled, the cost profile read
        for _ in range(args.repeats):
            counter = None if args.no_count else Counter()
            version = profile.version
            if counter is not None:
                sys.setprofile(counter)
            try:
                out, stats, tps = run(counter)
            finally:
                sys.setprofile(None)
            equal = "= plain" if out == reference else "DIFFERENT"
            speed = "" if counter else f", {tps:.1f} tok/s after the first token"
            print(f"\n== {name}: {equal}{speed}")
            if stats is not None:
                shapes = dict(sorted(stats.passes_by_tokens.items()))
                print(
                    f"  {stats.tokens_per_pass:.2f} tokens a pass, passes by T "
                    f"{shapes}, {stats.drafted} drafted / {stats.accepted} "
                    f"accepted; profile corrected (and written) "
                    f"{profile.version - version} times; "
                    f"{stats.profile_seconds:.2f} s profiling before the prompt"
                )
            if counter is None:
                continue
            s = counter.summary(len(out) - 1, args.top)
            print(
                "  Python calls a token: "
                + ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["py_calls"].items()))
            )
            print("  most called in mlx_spec:")
            for f, n in s["top_mlx_spec"]:
                print(f"    {n:7.2f}  {f}")


if __name__ == "__main__":
    main()
