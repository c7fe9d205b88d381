"""The doctor's losslessness part: greedy speculative output against plain
greedy decoding on this machine, for every drafter the model has.

The check ``mlx_spec bench`` makes on each run (:func:`first_difference`),
here with fixed draft lengths, so that drafts are really verified (``auto``
may draft nothing where a verify pass does not pay). A difference is not a
slow setting but a wrong one: the machine's matmuls round a verify pass over
several tokens differently from one-token steps (README, Losslessness).
"""

from typing import Callable, List, Optional

from ..drafters.dflash import attached_draft_model
from ..timed_runs import run_plain, run_spec, first_difference
from .result import FAIL, PASS, Part

QUICK_DRAFT_LENGTHS = (4,)
FULL_DRAFT_LENGTHS = (2, 5)

MEANING = (
    "this machine's matmuls round a verify pass over several tokens differently "
    "from one-token steps (e.g. a BLAS whose result for a row depends on the "
    "number of rows; see README, Losslessness): speculative output is not "
    "guaranteed to be plain decoding's here"
)


def available_drafters(model) -> List[str]:
    """``ngram`` always; ``mtp`` and ``mtp+ngram`` with an MTP head;
    ``dflash`` with a DFlash drafter model attached (``--draft-model``)."""
    drafters = ["ngram"]
    if getattr(model, "__dict__", {}).get("mtp_head") is not None:
        drafters += ["mtp", "mtp+ngram"]
    if attached_draft_model(model) is not None:
        drafters.append("dflash")
    return drafters


def draft_lengths(model, draft: str, quick: bool) -> List[int]:
    """The fixed draft lengths ``draft`` is checked at: a block drafter's
    cut to its block (it drafts at most ``block_size - 1`` tokens)."""
    lengths = QUICK_DRAFT_LENGTHS if quick else FULL_DRAFT_LENGTHS
    if draft == "dflash":
        most = attached_draft_model(model).config.block_size - 1
        return sorted({min(k, most) for k in lengths})
    return list(lengths)


def check_lossless(
    part: Part,
    model,
    tokenizer,
    prompts: List[dict],
    quick: bool,
    progress: Optional[Callable[[], None]] = None,
) -> Part:
    drafters = available_drafters(model)
    plain_runs = 1 if quick else 2  # two also show whether plain decoding repeats
    rows = []
    for w in prompts:
        plain = [
            run_plain(model, tokenizer, w["prompt"], w["max_tokens"])
            for _ in range(plain_runs)
        ]
        for draft in drafters:
            for k in draft_lengths(model, draft, quick):
                spec = run_spec(
                    model, tokenizer, w["prompt"], w["max_tokens"], draft, k
                )
                at = first_difference(plain, [spec])
                rows.append(
                    {
                        "prompt": w["name"],
                        "draft": draft,
                        "num_draft_tokens": k,
                        "tokens": len(spec["tokens"]),
                        "first_differing_token": at,
                    }
                )
                name = f"{w['name']} / {draft} / k={k}"
                if at is None:
                    part.check(name, PASS, f"{len(spec['tokens'])} tokens = plain")
                elif at < 0:
                    part.check(
                        name,
                        FAIL,
                        "plain greedy decoding itself gave different tokens in "
                        "different runs; losslessness cannot be judged here",
                    )
                else:
                    part.check(
                        name, FAIL, f"differs from plain from token {at}: {MEANING}"
                    )
                progress and progress()
    lengths = sorted({k for d in drafters for k in draft_lengths(model, d, quick)})
    part.facts.update(drafters=drafters, draft_lengths=lengths, runs=rows)
    return part.settle(
        f"{len(rows)} greedy runs ({', '.join(drafters)}; k = "
        f"{', '.join(map(str, lengths))}) gave plain decoding's tokens"
    )


def lossless_steps(model, prompts: List[dict], quick: bool) -> int:
    """How many runs :func:`check_lossless` reports progress for."""
    per_prompt = sum(
        len(draft_lengths(model, d, quick)) for d in available_drafters(model)
    )
    return len(prompts) * per_prompt
