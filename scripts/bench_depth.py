"""How the MTP head's upkeep and the drafters' gains scale with the target's depth.

The demo model (``qwen3_next``, 8 layers, hidden 256) carries a one-layer MTP
head against 8 target layers; a released Qwen3.5/3.6 carries one against 48
to 64. This script builds deeper targets from the demo model and measures,
per depth, what a Mac user's choice depends on.

**The deeper targets.** The demo's 8 decoder layers repeated to the depth
asked (16, 32, 48: copy ``r`` of layer ``i`` becomes layer ``8 r + i``), so
the hybrid pattern (full attention every 4th layer) stays; the embedding,
final norm, ``lm_head`` and MTP head are the demo's. Every layer's writes
into the residual stream (attention ``o_proj``, GDN ``out_proj``, every
expert's and the shared expert's ``down_proj``) are scaled by ``8 / depth``:
this changes no shape and no operation, so the costs are a real model's of
that depth, and it keeps the residual stream near the scale the demo was
trained at, so the text is not a degenerate repetition (which would make
copies look better than on any real model). The output is not meaningful
text; what the drafters accept on it says little about a real model, the
costs are the point. Each is written as a raw checkpoint (the demo's layout:
``config.json``, ``model.safetensors``, the tokenizer) in a temporary
directory and loaded with ``mlx_spec.load``.

**Per depth** (one workload prompt, greedy), alternating A B C ... then the
reverse, ``--repeats`` rounds, medians:

- ``plain``: mlx-lm's ``stream_generate``, tokens/s;
- ``mtp k=0 carried``: ``auto`` held at ``k = 0`` (no acceptance prior, no
  probes, every first draft judged in hindsight counted as a miss) with the
  head never suspended: the head's upkeep paid, its drafts never used;
- ``mtp k=0 resting``: the same with suspension on (the default): after 32
  plain choices the head rests;
- ``mtp auto``, ``ngram auto``: the defaults;

each as a ratio to ``plain`` in the same round, each output checked equal
to plain greedy decoding's (``DIFF`` marks one that is not, and the script
exits 1). Then the head's share of a pass: one head step (a row through its
layer, its logits, their argmax; ``mx.eval``-timed) over one target
decoding step (one token through the target, its argmax), alternated,
medians of ``--steps``, after the prompt's context.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python scripts/bench_depth.py [--depths 8 16 32 48] [--tokens 128]
        [--repeats 2] [--workload free-main] [--json out.json]

The verify profiles ``auto`` measures for each depth are kept in the cache
directory as for any model (``MLX_SPEC_CACHE_DIR`` moves it); the first run
of a depth measures its profile (not counted in tokens/s).
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

import mlx_spec
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.demo import default_model_path
from mlx_spec.mlx_lm_compat import make_prompt_cache, plain_stream_generate
from mlx_spec.timed_runs import interleaved, load_workloads, machine_info

from bench_helpers import HELD_AT_ZERO, held_at_zero

DEMO_LAYERS = 8
# Tensors that write into the residual stream, scaled by 8 / depth.
RESIDUAL_WRITES = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
NEVER_RESTING = replace(HELD_AT_ZERO, suspend_after=10**9)


def build_deep(src: Path, depth: int, dst: Path) -> Path:
    """The demo model at ``src`` with its decoder layers repeated to ``depth``
    layers (a multiple of 8), residual writes scaled by 8 / depth, written
    as a raw checkpoint at ``dst``."""
    config = json.loads((src / "config.json").read_text())
    base = config["num_hidden_layers"]
    if depth % base:
        raise SystemExit(f"--depths must be multiples of {base}, got {depth}")
    tensors = mx.load(str(src / "model.safetensors"))
    scale = base / depth
    out = {}
    for name, w in tensors.items():
        if not name.startswith("model.layers."):
            out[name] = w
            continue
        _, _, i, rest = name.split(".", 3)
        if rest.endswith(RESIDUAL_WRITES) and depth != base:
            w = (w.astype(mx.float32) * scale).astype(w.dtype)
        for r in range(depth // base):
            out[f"model.layers.{int(i) + r * base}.{rest}"] = w
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, {"format": "pt"})
    config["num_hidden_layers"] = depth
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, dst / f)
    return dst


def settings(model):
    """name -> a function running one generation: (tokens/s, tokens)."""

    def spec(draft, tuning, held):
        def run(tok, prompt, n):
            drafter = held_at_zero(draft, model) if held else draft
            last, out = None, []
            for last in mlx_spec.stream_generate(
                model, tok, prompt, max_tokens=n, draft=drafter, tuning=tuning
            ):
                out.append(last.token)
            return last.generation_tps, out

        return run

    def plain(tok, prompt, n):
        last, out = None, []
        for last in plain_stream_generate(model, tok, prompt, max_tokens=n):
            out.append(last.token)
        return last.generation_tps, out

    return {
        "plain": plain,
        "mtp k=0 carried": spec("mtp", NEVER_RESTING, True),
        "mtp k=0 resting": spec("mtp", HELD_AT_ZERO, True),
        "mtp auto": spec("mtp", DEFAULT_TUNING, False),
        "ngram auto": spec("ngram", DEFAULT_TUNING, False),
    }


def head_share(model, tok, prompt, steps: int) -> dict:
    """One MTP head step and one target decoding step, alternated, each
    ``mx.eval``-timed after the prompt's context: medians in ms and their
    ratio."""
    head = model.mtp_head
    ids = mx.array(tok.encode(prompt), mx.uint32)[None]
    cache = make_prompt_cache(model)
    mx.eval(model(ids[:, :-1], cache=cache), [c.state for c in cache])
    H, dtype = head.hidden_size, head.pre_fc_norm_hidden.weight.dtype
    head_cache = head.make_cache()
    n = ids.shape[1] - 1
    rows = mx.random.normal((1, n, H)).astype(dtype)
    mx.eval(
        head.head_hidden(ids[:, 1:], rows, head_cache), [c.state for c in head_cache]
    )
    token = ids[:, -1:]

    def target_step():
        nonlocal token
        tic = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token, [c.state for c in cache])
        return time.perf_counter() - tic

    def head_step():
        x = mx.random.normal((1, 1, H)).astype(dtype)
        mx.eval(x)
        tic = time.perf_counter()
        hm = head.head_hidden(token, x, head_cache)[:, -1:]
        mx.eval(mx.argmax(head.logits(hm)), [c.state for c in head_cache])
        seconds = time.perf_counter() - tic
        for c in head_cache:
            c.trim(1)
        return seconds

    target_step(), head_step()  # warm-up
    times = {"target": [], "head": []}
    for _, which in interleaved(["target", "head"], steps):
        times[which].append(target_step() if which == "target" else head_step())
    t = statistics.median(times["target"])
    h = statistics.median(times["head"])
    return {"target_step_ms": 1e3 * t, "head_step_ms": 1e3 * h, "head_share": h / t}


def measure(path: Path, depth: int, work: str, args) -> dict:
    model, tok = mlx_spec.load(str(path))
    (work,) = [w for w in load_workloads(tokenizer=tok) if w["name"] == work]
    prompt, n = work["prompt"], args.tokens
    runs = settings(model)
    for run in runs.values():  # warm-up: shapes compiled, the profile measured
        run(tok, prompt, 8)
    tps = {name: [] for name in runs}
    ratios = {name: [] for name in runs if name != "plain"}
    outputs = {name: [] for name in runs}
    order = list(runs)
    for r, name in interleaved(order, args.repeats):
        speed, out = runs[name](tok, prompt, n)
        tps[name].append(speed)
        outputs[name].append(out)
    reference = outputs["plain"][0]
    for name in ratios:  # each round's run against that round's plain run
        ratios[name] = [s / p for s, p in zip(tps[name], tps["plain"])]
    row = {
        "depth": depth,
        "plain_tps": statistics.median(tps["plain"]),
        "ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "ratios": ratios,
        "equal": {k: all(o == reference for o in v) for k, v in outputs.items()},
    }
    row.update(head_share(model, tok, prompt, args.steps))
    del model
    mx.clear_cache()
    return row


def table(rows) -> str:
    names = list(rows[0]["ratio"])
    head = (
        ["depth", "plain tok/s"]
        + names
        + ["head step ms", "target step ms", "head share"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["depth"]), f"{r['plain_tps']:.1f}"]
        for k in names:
            mark = "" if r["equal"][k] else " DIFF"
            cells.append(f"{r['ratio'][k]:.2f}x{mark}")
        cells += [
            f"{r['head_step_ms']:.2f}",
            f"{r['target_step_ms']:.2f}",
            f"{r['head_share']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", nargs="+", type=int, default=[8, 16, 32, 48])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps for the share")
    p.add_argument("--workload", default="free-main")
    p.add_argument("--json", help="also write the rows and machine facts here")
    args = p.parse_args()
    if args.repeats < 1 or args.tokens < 2 or args.steps < 1:
        raise SystemExit("--repeats and --steps must be >= 1, --tokens >= 2")
    src = Path(default_model_path())
    names = [w["name"] for w in load_workloads(kinds=("copy", "free"))]
    if args.workload not in names:
        raise SystemExit(f"unknown --workload {args.workload!r}; one of {names}")
    tic = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlx_spec_depth_") as tmp:
        for depth in args.depths:
            path = (
                src
                if depth == DEMO_LAYERS
                else build_deep(src, depth, Path(tmp) / f"depth{depth}")
            )
            rows.append(measure(path, depth, args.workload, args))
            print(f"depth {depth} done", file=sys.stderr)
            if path != src:
                shutil.rmtree(path)
    print(table(rows))
    info = machine_info()
    print(
        f"\n{args.workload}, {args.tokens} tokens, {args.repeats} rounds; "
        f"{info['device']}, MLX {info['mlx']}, BLAS: {info['blas']}, "
        f"{time.perf_counter() - tic:.0f} s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1)
        )
    if not all(all(r["equal"].values()) for r in rows):
        print("error: an output differed from plain decoding's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
