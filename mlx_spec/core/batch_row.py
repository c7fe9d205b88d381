"""One row of the engine: a sequence's own part of every pass.

Each row of a :class:`~mlx_spec.core.batch.BatchDecoder` brings its own
sampler, logits processors, stop tokens, token budget and draft-length
policy. What the engine does once per row in a pass is here: its draft, the
verdict on it from its own slice of the pass's logits, and where its emitted
tokens stop.
"""

import time
from dataclasses import dataclass, field
from typing import Collection, List, Optional


from ..drafters import calls
from ..drafters.calls import implements
from ..drafters.contract import HeadBased
from .batch_mtp import MTPBatch, head_drafter
from .pass_plan import NO_DRAFT, Draft
from .policy import RowAcceptance
from .row_guard import RowFailed, RowGuard
from .sampling import Verification, scored_logprobs
from .sequence import SpeculativeDecoder
from .verify import verify_draft


@dataclass
class BatchRow:
    id: int
    decoder: SpeculativeDecoder  # its drafter, history and stats
    sampler: object
    acceptance: Optional[RowAcceptance]  # auto: its drafts' acceptance per source
    max_draft: int
    remaining: int  # tokens it may still emit
    stop_tokens: Collection[int] = field(default_factory=set)
    processors: list = field(default_factory=list)  # mlx-lm logits processors
    seen: List[int] = field(default_factory=list)  # the tokens processors see
    done: bool = False
    guard: RowGuard = field(default_factory=RowGuard)  # its callables' failure
    verification: Verification = Verification.MATCH  # how its drafts are verified

    def draft(self, k: int, heads: Optional[MTPBatch]) -> Draft:
        """Up to ``k`` drafts (lazy where drafted on the device) and the
        seconds drafting took on the host (deferred drafter work excluded).
        ``heads``: the engine's MTP heads, which caught this row's up
        already if it is theirs."""
        d = self.decoder
        if k <= 0:
            return NO_DRAFT
        if head_drafter(d.drafter) not in (heads or ()) and self._reads_head(k):
            calls.catch_up(d.drafter)
        tic = time.perf_counter()
        proposal = d.next_draft(k)
        return Draft(proposal, time.perf_counter() - tic)

    def _reads_head(self, k: int) -> bool:
        """Whether the next draft of ``k`` reads the head's state, which is
        then caught up before the draft is timed (a full copy of
        ``mtp+ngram`` does not: the head's rows stay deferred)."""
        drafter = self.decoder.drafter
        return not implements(drafter, HeadBased) or drafter.needs_head_state(k)

    def verify(self, draft: Draft, logits, logprobs, plain: bool):
        """``(accepted, next token, scores)`` of the row's part of the pass
        (its ``logits`` and ``logprobs`` [1 + len(draft), V]; ``scores``:
        the log-probabilities it samples from); ``plain``: a plain pass
        queued ahead chose the row's token already (None here). Raises
        :class:`RowFailed` when the row's own sampler or logits processors
        raise, now or while it drafted."""
        if self.guard.error is not None:
            raise RowFailed(self.guard.error)
        scores = logprobs
        if self.processors:
            drafted = draft.tokens.tolist()  # processors see host token lists
            scores = scored_logprobs(logits, self.seen, drafted, self.processors)
        if plain:
            return 0, None, scores
        q = draft.proposal.probs
        n, token = verify_draft(
            draft.tokens, scores, self.sampler, q, self.verification
        )
        return n, token, scores

    def truncate(self, emitted: List[int]) -> List[int]:
        """``emitted`` up to a stop token or the row's token budget (the row
        is done when either ends it)."""
        stop = next((i for i, t in enumerate(emitted) if t in self.stop_tokens), None)
        if stop is not None:
            emitted, self.done = emitted[: stop + 1], True
        if len(emitted) >= self.remaining:
            emitted, self.done = emitted[: self.remaining], True
        self.remaining -= len(emitted)
        return emitted
