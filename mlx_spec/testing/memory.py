"""MLX active memory over a long generation, less what grows by design."""

from typing import List, Sequence, Tuple

import mlx.core as mx

from ..drafters import make_drafter
from ..generate import stream_generate
from ..mlx_lm_compat import make_prompt_cache
from .reference import cache_nbytes


def _drafter_caches(drafter) -> list:
    head = getattr(drafter, "mtp", drafter)  # mtp+ngram holds an MTP drafter
    return list(getattr(head, "cache", None) or [])


def memory_readings(
    model, tokenizer, prompt, draft: str, marks: Sequence[int], **kwargs
) -> Tuple[List[int], object]:
    """Generate ``marks[-1]`` tokens with EOS disabled and read MLX's active
    memory when the count reaches each of ``marks``, less the bytes of the KV
    caches (the target's and the MTP head's, which grow by design).

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
            marks[-1],
            draft=drafter,
            prompt_cache=cache,
            **kwargs,
        ):
            if r.generation_tokens in marks:
                kv = cache_nbytes(list(cache) + _drafter_caches(drafter))
                readings.append(mx.get_active_memory() - kv)
    finally:
        tokenizer.eos_token_ids = eos
    return readings, r.stats
