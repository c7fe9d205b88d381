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

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
from mlx_spec.demo import default_model_path
from mlx_spec.drafters import make_drafter
from mlx_spec.mtp.testing import cycle_order, write_cycle_checkpoint
from mlx_spec.tiny_checkpoint import FAMILIES


def kv_cache_bytes(caches) -> int:
    arrays = []
    for c in caches:
        for part in (getattr(c, "keys", None), getattr(c, "values", None)):
            arrays += part if isinstance(part, (list, tuple)) else [part]
    return sum(a.nbytes for a in arrays if isinstance(a, mx.array))


def soak(model, tok, prompt, draft, rollback, tokens, every):
    cache = make_prompt_cache(model)
    drafter = make_drafter(draft, model)
    head = getattr(drafter, "mtp", drafter)
    tok.eos_token_ids = set()
    row = []
    for r in mlx_spec.stream_generate(
        model,
        tok,
        prompt,
        tokens,
        draft=drafter,
        num_draft_tokens=8,
        rollback=rollback,
        prompt_cache=cache,
    ):
        if r.generation_tokens % every == 0:
            kv = kv_cache_bytes(list(cache) + list(getattr(head, "cache", None) or []))
            row.append((mx.get_active_memory() - kv) / 2**20)
    return row, r.stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10000)
    parser.add_argument("--every", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    models = {
        f: (write_cycle_checkpoint(root / f, f), cycle_order()[:40]) for f in FAMILIES
    }
    models["demo"] = (
        default_model_path(),
        "import os\nimport sys\n\n\ndef main(argv):\n    ",
    )
    marks = " ".join(f"{t:>7}" for t in range(args.every, args.tokens + 1, args.every))
    print(f"{'model':<12} {'draft':<10} {'rollback':<8} acc   MiB at tokens {marks}")
    for name, (path, prompt) in models.items():
        model, tok = mlx_spec.load(path)
        prompt = tok.encode(prompt) if isinstance(prompt, str) else prompt
        for draft in ("ngram", "mtp", "mtp+ngram"):
            for rollback in ("store", "replay"):
                row, stats = soak(
                    model, tok, prompt, draft, rollback, args.tokens, args.every
                )
                cells = " ".join(f"{m:7.1f}" for m in row)
                print(
                    f"{name:<12} {draft:<10} {rollback:<8} {stats.acceptance_rate:4.2f}"
                    f"                {cells}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
