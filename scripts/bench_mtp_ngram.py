"""Compare ``mtp``, ``ngram`` and the ``mtp+ngram`` rules on tiny checkpoints.

Metric: tokens per verify pass (generated / passes) and the acceptance rate,
summed over families, checkpoints and prompts. Every run is checked lossless
against plain greedy decoding. Checkpoints per family:

- ``random``: ``write_tiny_checkpoint`` (the head almost never agrees);
- ``good``: ``write_predictive_checkpoint`` (partial MTP acceptance);
  prompts: plain code, and copy-heavy text (the same lines repeated);
- ``cycleN``: ``write_cycle_checkpoint`` with ``mtp_noise=N`` (the larger,
  the worse the head); its greedy text walks a fixed token cycle, so
  prompts: ``copy`` (a stretch of the cycle, then its start again: the target
  copies the prompt for a while, then writes novel text), ``novel``
  (random tokens: novel text, few copies) and ``decoy`` (3-grams of the text
  to come, each followed by wrong tokens: full n-gram matches that are wrong).

    python scripts/bench_mtp_ngram.py [--k 3 5] [--max-tokens 64]
"""

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import mlx_spec
from mlx_spec.core.stats import SpecStats
from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.testing.checkpoints import FAMILIES, write_tiny_checkpoint
from mlx_spec.testing.mtp_heads import (
    cycle_order,
    write_cycle_checkpoint,
    write_predictive_checkpoint,
)

TEXT_PROMPTS = {
    "code": [
        "def push(self, value: int) -> None:\n",
        "import os\nimport sys\n\n\ndef main(argv",
    ],
    "copy": [
        "for i in range(10):\n    print(i)\n" * 3 + "for i in",
        "a, b = b, a + b\n" * 4 + "a, b =",
    ],
}
NOISES = (1.0, 2.0, 3.0)


def cycle_prompts():
    order = cycle_order(0)
    rng = np.random.default_rng(5)
    novel = [int(t) for t in rng.integers(0, 399, 40)]
    decoy = []
    for i in range(106, 160, 6):
        decoy += order[i : i + 3] + [int(t) for t in rng.integers(0, 399, 2)]
    return {
        "copy": [order[100:140] + order[100:105], order[200:230] + order[200:203]],
        "novel": [novel],
        "decoy": [decoy + order[100:103]],
    }


# Fixed rules tried against the package's scored choice ("adaptive"):
# - agree: copy only when the head's next token agrees with it;
# - agree_or_long: that, or a full max_ngram match (the package's rule while
#   sampling);
# - long: copy for a full max_ngram match only;
# - ngram_first: copy whenever there is one.
FIXED_RULES = ("agree", "agree_or_long", "long", "ngram_first")


class FixedRuleDrafter(MTPNgramDrafter):
    """``mtp+ngram`` deciding copy-or-MTP by one fixed rule before drafting."""

    def __init__(self, head, max_ngram: int, rule: str):
        super().__init__(head, max_ngram)
        self.rule = rule

    def score_decides(self):
        return False  # the rule alone decides: no score of disagreements

    def prefer_copy(self, copy):
        if self.rule == "agree_or_long":
            return super().prefer_copy(copy)
        if self.rule == "ngram_first" or self.mtp.rows.next_logits() is None:
            return True
        if self.rule == "long":
            return self.ngram.match_length() >= self.ngram.max_ngram
        return int(mx.argmax(self.mtp.rows.next_logits()).item()) == copy[0]


def drafters(head, max_ngram=3):
    yield "mtp", lambda: MTPDrafter(head)
    yield "ngram", lambda: NgramDrafter(max_ngram)
    yield "mtp+ngram:adaptive", lambda: MTPNgramDrafter(head, max_ngram)
    for rule in FIXED_RULES:
        yield f"mtp+ngram:{rule}", lambda rule=rule: FixedRuleDrafter(
            head, max_ngram, rule
        )


def checkpoints(root: Path, family: str):
    """(name, path, prompts: kind -> list of token-id lists or strings)."""
    r = write_tiny_checkpoint(root / f"{family}_random", family, seed=1)
    yield "random", r, TEXT_PROMPTS
    yield "good", write_predictive_checkpoint(
        root / f"{family}_g", family
    ), TEXT_PROMPTS
    for noise in NOISES:
        path = write_cycle_checkpoint(root / f"{family}_c", family, mtp_noise=noise)
        yield f"cycle{noise:g}", path, cycle_prompts()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[3, 5])
    p.add_argument("--max-tokens", type=int, default=64)
    a = p.parse_args()
    # totals[(k, kind, prompt_kind, drafter)] = [generated, passes, accepted, drafted]
    totals = defaultdict(lambda: [0, 0, 0, 0])
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            for kind, path, prompt_sets in checkpoints(Path(tmp), family):
                model, tok = mlx_spec.load(path)
                for pkind, prompts in prompt_sets.items():
                    for prompt in prompts:
                        if isinstance(prompt, str):
                            prompt = tok.encode(prompt)
                        ids = mx.array(prompt)
                        ref = [
                            t
                            for t, _ in generate_step(
                                ids, model, max_tokens=a.max_tokens
                            )
                        ]
                        for k in a.k:
                            for name, make in drafters(model.mtp_head):
                                stats = SpecStats()
                                options = mlx_spec.DecodeOptions(make(), k)
                                session = mlx_spec.Session(model, options, stats=stats)
                                gen = session.generate(ids, max_tokens=a.max_tokens)
                                out = [int(t) for t, _, _ in gen][: a.max_tokens]
                                assert out == ref, (family, kind, name, k)
                                t = totals[(k, kind, pkind, name)]
                                t[0] += stats.generated
                                t[1] += stats.verify_passes
                                t[2] += stats.accepted
                                t[3] += stats.drafted
    print("BLAS: the mlx[cpu] wheel's default; the metric does not depend on it.")
    print(
        f"{'k':>2} {'ckpt':8} {'prompts':7} {'drafter':26} {'tok/pass':>8} {'accept':>7}"
    )
    overall = defaultdict(lambda: [0, 0])
    for (k, kind, pkind, name), (gen, passes, acc, dr) in sorted(totals.items()):
        rate = acc / dr if dr else 0.0
        print(f"{k:>2} {kind:8} {pkind:7} {name:26} {gen / passes:8.3f} {rate:7.1%}")
        overall[(k, name)][0] += gen
        overall[(k, name)][1] += passes
    print("\noverall (all checkpoints and prompts):")
    for (k, name), (gen, passes) in sorted(overall.items()):
        print(f"{k:>2} {name:26} {gen / passes:8.3f} tokens per verify pass")


if __name__ == "__main__":
    main()
