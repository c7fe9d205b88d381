"""MLX active memory over a long generation, less what grows by design, and
its growth per token."""

import itertools
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..core.batch_mtp import head_drafter
from ..drafters import make_drafter
from ..generate import stream_generate
from ..mlx_lm_compat import ArraysCache, make_prompt_cache
from .reference import cache_nbytes

# Bytes per token a run may grow by beyond plain decoding's own slope: half
# the smallest leak worth catching (256 B/token, one float32 row of a
# 64-wide hidden state). Measured beyond plain decoding's slope: -30 to +10
# B/token on the tiny models. The defect the memory tests were written for
# grew by about 50 KB/token.
PER_TOKEN_LIMIT = 128


def _drafter_caches(drafter) -> list:
    """The KV caches of the MTP head a drafter drafts with (none without)."""
    head = head_drafter(drafter)
    return [] if head is None else list(head.rows.cache or [])


def memory_readings(
    model, tokenizer, prompt, draft: str, marks: Sequence[int], **kwargs
) -> Tuple[List[int], object]:
    """Generate past ``marks[-1]`` tokens with EOS disabled and read MLX's
    active memory when the count reaches each of ``marks``, less the bytes of
    the KV caches (the target's and the MTP head's, which grow by design).
    ``draft="none"`` is plain mlx-lm decoding.

    The KV caches are evaluated before each reading: a head that defers its
    rows holds their cache buffers as unevaluated graphs, which ``nbytes``
    counts before they take any memory (about -290 B/token of drift on the
    tiny models otherwise, enough to hide a leak). The generation runs one
    token past the last mark, so that no reading sees its end (the decoder
    frees its pass's buffers there).

    Returns the readings (bytes) and the run's ``SpecStats``.
    """
    cache = make_prompt_cache(model)
    drafter = make_drafter(draft, model)
    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, set()
    readings = []
    try:
        for r in stream_generate(
            model,
            tokenizer,
            prompt,
            marks[-1] + 1,
            draft="none" if drafter is None else drafter,
            prompt_cache=cache,
            **kwargs,
        ):
            if r.generation_tokens in marks:
                kv = list(cache) + _drafter_caches(drafter)
                kv = [c for c in kv if not isinstance(c, ArraysCache)]
                mx.eval([c.state for c in kv])
                readings.append(mx.get_active_memory() - cache_nbytes(kv))
    finally:
        tokenizer.eos_token_ids = eos
    return readings, r.stats


def growth_per_token(marks: Sequence[int], readings: Sequence[int]) -> float:
    """Bytes per token that ``readings`` (taken at ``marks`` tokens) grow by,
    as two robust estimates agree: the lower of the median slope between
    every two readings (Theil-Sen: steady under a sawtooth) and the median
    slope between neighbours (steady under a one-off step, such as the
    allocator taking a new block mid-run). A steady leak raises both by its
    rate; a step or a sawtooth raises at most one of them."""
    if len(marks) != len(readings) or len(marks) < 3:
        raise ValueError("need a reading at each of at least three marks")

    def slope(i, j):
        return (readings[j] - readings[i]) / (marks[j] - marks[i])

    pairs = itertools.combinations(range(len(marks)), 2)
    every_two = np.median([slope(i, j) for i, j in pairs])
    neighbours = np.median([slope(i, i + 1) for i in range(len(marks) - 1)])
    return float(min(every_two, neighbours))
