"""mlx-spec's ``dflash`` beside z-lab's own DFlash decode loop, greedy, same
target and drafter: the tokens (each run must give mlx-lm's plain greedy
tokens), tokens/s over the whole call (prefill included), tokens per verify
pass and the share of drafts accepted.

Runs, per prompt: mlx-lm's plain greedy (the reference), z-lab's loop
(``dflash.model_mlx.stream_generate``, its own block size), mlx-spec's
``dflash`` at a fixed ``num_draft_tokens = block_size - 1`` and at ``auto``.
Each run is done once short (warm-up) before the measured one.

z-lab's loop rolls back a recurrent target only through ``qwen3_5``'s
GatedDeltaNet: on another (the bundled demo model is ``qwen3_next``) only
mlx-spec runs, and the script says why. It needs z-lab's package
(``pip install --no-deps dflash==0.1.0``); without it only mlx-spec runs.

    python scripts/bench_dflash_reference.py --tiny
    python scripts/bench_dflash_reference.py --model PATH --draft-model PATH
    python scripts/bench_dflash_reference.py --model demo --draft-model PATH

``--tiny``: a tiny ``qwen3_5`` target whose greedy text mostly walks a token
cycle and a drafter built to propose the cycle's next token
(``mlx_spec/testing``), written to a temporary folder: offline, in seconds.
Timings are not claims (they go to docs/measurements.md when measured).
"""

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence

import mlx.core as mx

import mlx_spec
from mlx_spec.core.stats import SpecStats
from mlx_spec.demo import default_model_path
from mlx_spec.hub.resolve import resolve_drafter
from mlx_spec.mlx_lm_compat import load as mlx_lm_load
from mlx_spec.testing import dflash_reference
from mlx_spec.testing.dflash_drafters import write_successor_drafter
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint
from mlx_spec.testing.reference import prompts as token_prompts
from mlx_spec.testing.reference import reference_tokens

TEXT_PROMPTS = (
    "def fibonacci(n):\n    ",
    "Write a short story about a lighthouse keeper who",
)
WARM_UP_TOKENS = 8


def _tiny(root: Path, block_size: int):
    """(target, drafter) directories of the tiny cycle target and its
    successor drafter; token-id prompts."""
    target = write_cycle_checkpoint(root / "target", "qwen3_5", target_scale=0.1)
    plain, _ = mlx_lm_load(str(target))
    drafter = write_successor_drafter(root / "drafter", plain, block_size=block_size)
    return target, drafter, [token_prompts("mixed"), cycle_order()[:6]]


def _without_eos(tokens: Sequence[int], eos) -> List[int]:
    """``tokens`` less a final end-of-sequence token (loops differ in
    whether they yield it)."""
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def _zlab_runs(model_path, drafter_dir, prompts, max_tokens):
    """z-lab's loop on each prompt, with mlx-lm's plain reference: a dict,
    or the reason it cannot run."""
    try:
        dflash_reference.reference_module()
    except ImportError as e:
        return str(e), {}
    plain, tok = mlx_lm_load(str(model_path))
    gap = dflash_reference.reference_loop_gap(plain)
    if gap:  # the references then come from mlx_spec.load's model (see main)
        return f"z-lab's loop cannot run on this target: {gap}", {}
    references = [reference_tokens(plain, tok, p, max_tokens) for p in prompts]
    draft, _ = dflash_reference.reference_draft_model(drafter_dir, plain)
    runs = []
    for p in prompts:
        dflash_reference.run_reference_loop(plain, draft, tok, p, WARM_UP_TOKENS)
        runs.append(
            dflash_reference.run_reference_loop(plain, draft, tok, p, max_tokens)
        )
    eos = set(tok.eos_token_ids)
    return "", {"runs": runs, "eos": eos, "references": references}


def _our_run(model, tok, prompt, drafter, k, max_tokens):
    """(tokens, seconds, stats) of mlx-spec's dflash at ``k``."""
    kwargs = dict(draft_model=drafter, num_draft_tokens=k)
    list(mlx_spec.stream_generate(model, tok, prompt, WARM_UP_TOKENS, **kwargs))
    stats = SpecStats()
    tic = time.perf_counter()
    tokens = [
        r.token
        for r in mlx_spec.stream_generate(
            model, tok, prompt, max_tokens, stats=stats, **kwargs
        )
    ]
    return tokens, time.perf_counter() - tic, stats


def _row(name, tokens, seconds, per_pass, acceptance, same):
    print(
        f"{name:<22} {tokens:>7} {tokens / seconds:>10.1f} {per_pass:>10.2f} "
        f"{acceptance:>10.1%} {'yes' if same else 'NO':>6}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target: a path, a repo id or 'demo'")
    p.add_argument("--draft-model", help="DFlash drafter: a path or a repo id")
    p.add_argument("--tiny", action="store_true", help="a tiny target built in code")
    p.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=4, help="--tiny's drafter")
    args = p.parse_args()
    if args.tiny == bool(args.model or args.draft_model):
        p.error("give --tiny, or --model and --draft-model")
    if not args.tiny and not (args.model and args.draft_model):
        p.error("--model and --draft-model go together")

    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_path, drafter_dir, prompts = _tiny(Path(tmp), args.block_size)
        else:
            model_path = (
                default_model_path() if args.model == "demo" else Path(args.model)
            )
            drafter_dir = resolve_drafter(args.draft_model)
            _, tok = mlx_lm_load(str(model_path))
            texts = args.prompt or list(TEXT_PROMPTS)
            prompts = [tok.encode(t) for t in texts]
        why_not, zlab = _zlab_runs(model_path, drafter_dir, prompts, args.max_tokens)
        gc.collect()
        mx.clear_cache()

        model, tok = mlx_spec.load(model_path)
        eos = set(tok.eos_token_ids)
        references = zlab.get("references") or [
            reference_tokens(model, tok, p, args.max_tokens) for p in prompts
        ]
        drafter = mlx_spec.load_drafter(drafter_dir, model)
        block = drafter.config.block_size
        print(f"target {model_path}\ndrafter {drafter_dir} (block {block})")
        print(
            f"{'loop':<22} {'tokens':>7} {'tokens/s':>10} {'per pass':>10} "
            f"{'accepted':>10} {'same':>6}"
        )
        all_same = True
        if zlab.get("runs"):
            runs = zlab["runs"]
            same = all(
                _without_eos(r.tokens, eos) == _without_eos(ref, eos)
                for r, ref in zip(runs, references)
            )
            passes = sum(len(r.drafted) for r in runs)
            # a pass emits its accepted drafts and one token of the target's
            emitted = sum(sum(r.accepted) + len(r.accepted) for r in runs)
            _row(
                "z-lab reference",
                sum(len(r.tokens) for r in runs),
                sum(r.seconds for r in runs),
                emitted / max(passes, 1),
                sum(map(sum, (r.accepted for r in runs)))
                / max(sum(map(sum, (r.drafted for r in runs))), 1),
                same,
            )
            all_same &= same
        for label, k in (
            (f"mlx-spec dflash k={block - 1}", block - 1),
            ("mlx-spec dflash auto", "auto"),
        ):
            total, seconds, same, stats = 0, 0.0, True, SpecStats()
            for prompt, ref in zip(prompts, references):
                tokens, s, st = _our_run(
                    model, tok, prompt, drafter, k, args.max_tokens
                )
                total, seconds = total + len(tokens), seconds + s
                same &= _without_eos(tokens, eos) == _without_eos(ref, eos)
                for name in ("verify_passes", "drafted", "accepted", "generated"):
                    setattr(stats, name, getattr(stats, name) + getattr(st, name))
            _row(
                label,
                total,
                seconds,
                stats.tokens_per_pass,
                stats.acceptance_rate,
                same,
            )
            all_same &= same
        if why_not:
            print(f"z-lab's loop not run: {why_not}")
        if not all_same:
            sys.exit("a loop's tokens differ from mlx-lm's plain greedy tokens")


if __name__ == "__main__":
    main()
