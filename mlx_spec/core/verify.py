"""Verification of a draft against the target's choices."""

from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .sampling import Verification, rejection_sample


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
    verification: Verification = Verification.MATCH,
) -> Tuple[int, int]:
    """Accepted draft count and the next token, with one host synchronisation.

    logprobs: [T, V] target log-probabilities (T = 1 + len(draft)); ``draft``
    may be a lazy array, evaluated in the same synchronisation.
    ``Verification.MATCH``: each position is sampled and drafts are kept
    while they equal the samples (exact for deterministic drafts).
    ``Verification.REJECTION``: rejection sampling against the sampler's
    distribution (its ``logits``) and ``draft_probs`` [k, V] (None:
    deterministic drafts).
    """
    if len(draft) and verification is Verification.REJECTION:
        n, token = rejection_sample(
            mx.array(draft), sampler.logits(logprobs), draft_probs
        ).tolist()
        return n, token
    choice = sampler(logprobs).tolist()  # a lazy draft is evaluated here too
    draft = draft.tolist() if isinstance(draft, mx.array) else draft
    n = accept_greedy(draft, choice)
    return n, choice[n]
