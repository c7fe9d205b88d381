"""Verification of a draft against the target's choices."""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

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
    draft: List[int],
    logprobs: mx.array,
    sampler,
    draft_probs: Optional[mx.array] = None,
) -> Tuple[int, int]:
    """Accepted draft count and the next token, with one host synchronisation.

    logprobs: [T, V] target log-probabilities (T = 1 + len(draft)).
    Greedy or opaque samplers (no ``logits``): each position is sampled and
    drafts are kept while they equal the samples (exact for deterministic
    drafts). A sampler with a known distribution: rejection sampling against
    ``draft_probs`` [k, V] (None: deterministic drafts).
    """
    if draft and not getattr(sampler, "greedy", True) and hasattr(sampler, "logits"):
        n, token = rejection_sample(
            mx.array(draft), sampler.logits(logprobs), draft_probs
        ).tolist()
        return n, token
    choice = sampler(logprobs).tolist()
    n = accept_greedy(draft, choice)
    return n, choice[n]


@dataclass
class SpecStats:
    """Counters of one speculative generation."""

    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)

    def record(self, n_drafted: int, n_accepted: int, n_emitted: int):
        self.verify_passes += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.generated += n_emitted
        grow = n_drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.verify_passes if self.verify_passes else 0.0

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_position)
        return (
            f"Speculation: {self.verify_passes} verify passes, "
            f"{self.accepted}/{self.drafted} drafted tokens accepted "
            f"({self.acceptance_rate:.1%}), "
            f"{self.tokens_per_pass:.2f} tokens per pass\n"
            f"Acceptance per draft position: {per_pos or '-'}"
        )
