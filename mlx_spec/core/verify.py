"""Verification of a draft against the target's choices."""

from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .sampling import rejection_sample


def accept_greedy(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest draft prefix equal to the target's tokens.

    ``target[i]`` is the target's token after the verified prefix of length
    ``i``; ``target[n]`` (n = the result) is then the correction or bonus token.
    """
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def verify_draft(
    draft: Union[List[int], mx.array],
    logprobs: mx.array,
    sampler,
    draft_probs: Optional[mx.array] = None,
) -> Tuple[int, int]:
    """Accepted draft count and the next token, with one host synchronisation.

    logprobs: [T, V] target log-probabilities (T = 1 + len(draft)); ``draft``
    may be a lazy array, evaluated in the same synchronisation.
    Greedy or opaque samplers (no ``logits``): each position is sampled and
    drafts are kept while they equal the samples (exact for deterministic
    drafts). A sampler with a known distribution: rejection sampling against
    ``draft_probs`` [k, V] (None: deterministic drafts).
    """
    if (
        len(draft)
        and not getattr(sampler, "greedy", True)
        and hasattr(sampler, "logits")
    ):
        n, token = rejection_sample(
            mx.array(draft), sampler.logits(logprobs), draft_probs
        ).tolist()
        return n, token
    choice = sampler(logprobs).tolist()  # a lazy draft is evaluated here too
    draft = draft.tolist() if isinstance(draft, mx.array) else draft
    n = accept_greedy(draft, choice)
    return n, choice[n]
