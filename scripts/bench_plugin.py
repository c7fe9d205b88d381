"""mlx-lm's own ``mlx_lm.generate`` on the demo model, with and without
``mlx_spec.plugin``, in one run: every output equal, and the ratio.

    python scripts/bench_plugin.py [--model DIR] [--kinds copy free] [--max-tokens N]
        [--repeats 3] [--json FILE]

Both settings call ``mlx_lm.generate`` on the same model object (loaded by
``mlx_spec.load``: the MTP head attached, and on the CPU the bf16 experts cast
to float32, without which mlx-lm cannot run them there). The settings
alternate, ``--repeats`` rounds, each round in the reverse order of the last,
so a busy spell of a shared machine falls on both alike; a workload's time is
the median of its rounds. Before the rounds each setting runs the first
workload once (the plugin's "auto" measures its verify-cost profile then).
An output that differs between the settings stops the run with an error.

On Linux preload OpenBLAS for GPU-like matmul scaling (say so in results):
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
"""

import argparse
import json
import statistics
import sys
import time

import mlx_lm

import mlx_spec
from mlx_spec import plugin
from mlx_spec.demo import default_model_path
from mlx_spec.timed_runs import interleaved, load_workloads, machine_info

SETTINGS = ("mlx-lm", "plugin")


def run_once(setting, model, tokenizer, prompt, max_tokens):
    """(text, seconds) of one ``mlx_lm.generate`` call under ``setting``."""
    state = plugin.enable() if setting == "plugin" else None
    try:
        tic = time.perf_counter()
        text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)
        seconds = time.perf_counter() - tic
    finally:
        plugin.disable()
    if state is not None and state.decisions.get("covered") != 1:
        raise SystemExit(f"the plugin did not speculate: {dict(state.decisions)}")
    return text, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--kinds", nargs="*", default=["copy", "free"])
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    model, tokenizer = mlx_spec.load(args.model or default_model_path())
    rows = load_workloads(kinds=set(args.kinds), tokenizer=tokenizer)
    if not rows:
        raise SystemExit(f"no workload of kinds {args.kinds}")

    def max_tokens(row):
        return args.max_tokens or row.get("max_tokens", 128)

    for setting in SETTINGS:  # warm-up, not timed
        run_once(setting, model, tokenizer, rows[0]["prompt"], max_tokens(rows[0]))

    times = {(r["name"], s): [] for r in rows for s in SETTINGS}
    texts = {}
    for _, setting in interleaved(list(SETTINGS), args.repeats):
        for row in rows:
            text, seconds = run_once(
                setting, model, tokenizer, row["prompt"], max_tokens(row)
            )
            want = texts.setdefault(row["name"], text)
            if text != want:
                raise SystemExit(
                    f"{row['name']}: the {setting} output differs from the first "
                    f"run's:\n{text!r:.300}\n{want!r:.300}"
                )
            times[(row["name"], setting)].append(seconds)

    results = []
    print(f"{'workload':<24} {'mlx-lm s':>9} {'plugin s':>9} {'ratio':>6}")
    for row in rows:
        plain, spec = (statistics.median(times[(row["name"], s)]) for s in SETTINGS)
        results.append(dict(name=row["name"], mlx_lm_s=plain, plugin_s=spec))
        print(f"{row['name']:<24} {plain:9.3f} {spec:9.3f} {plain / spec:6.2f}")
    total_plain = sum(r["mlx_lm_s"] for r in results)
    total_spec = sum(r["plugin_s"] for r in results)
    print(
        f"{'all':<24} {total_plain:9.3f} {total_spec:9.3f} "
        f"{total_plain / total_spec:6.2f}  (ratio: mlx-lm's time / the plugin's; "
        "every output equal)"
    )
    info = machine_info()
    print(f"blas: {info['blas']}; device: {info['device']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, workloads=results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
