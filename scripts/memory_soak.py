"""Long generations with mostly-accepted drafts: MLX active memory over time.

For each model (tiny "cycle" checkpoints of every family, whose greedy text
both drafters predict well, and the demo model), drafter and GDN rollback
strategy, generate ``--tokens`` tokens with EOS disabled and print the active
memory every ``--every`` tokens, less the bytes of the KV caches (target and
MTP head), which grow by design. A flat row is what bounded speculative
state looks like.

    python scripts/memory_soak.py --tokens 10000
"""

import argparse
import tempfile
from pathlib import Path

import mlx_spec
from mlx_spec.demo import default_model_path
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.memory import memory_readings
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10000)
    parser.add_argument("--every", type=int, default=2000)
    parser.add_argument(
        "--models", nargs="+", help="which of them (default: all); e.g. demo"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    models = {
        f: (write_cycle_checkpoint(root / f, f), cycle_order()[:40]) for f in FAMILIES
    }
    models["demo"] = (
        default_model_path(),
        "import os\nimport sys\n\n\ndef main(argv):\n    ",
    )
    unknown = set(args.models or ()) - set(models)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {list(models)}")
    marks = " ".join(f"{t:>7}" for t in range(args.every, args.tokens + 1, args.every))
    print(f"{'model':<12} {'draft':<10} {'rollback':<8} acc   MiB at tokens {marks}")
    for name, (path, prompt) in models.items():
        if args.models and name not in args.models:
            continue
        model, tok = mlx_spec.load(path)
        prompt = tok.encode(prompt) if isinstance(prompt, str) else prompt
        for draft in ("ngram", "mtp", "mtp+ngram"):
            for rollback in ("store", "replay"):
                readings, stats = memory_readings(
                    model,
                    tok,
                    prompt,
                    draft,
                    range(args.every, args.tokens + 1, args.every),
                    num_draft_tokens=8,
                    rollback=rollback,
                )
                cells = " ".join(f"{m / 2**20:7.1f}" for m in readings)
                print(
                    f"{name:<12} {draft:<10} {rollback:<8} {stats.acceptance_rate:4.2f}"
                    f"                {cells}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
