"""Prompt-lookup drafting: copy what followed the last occurrence of the suffix.

The index maps every n-gram (2 <= n <= max_ngram) of the token history to the
position right after its most recent occurrence. It is updated incrementally as
tokens are appended (O(max_ngram) per token), so a lookup never scans the
history. The history is the prompt and every token generated so far.

Once asked for ``hindsight()`` (``auto`` asks), the first token of every
pass is also judged: would the copy's first token have been it? A dictionary
lookup per pass, so ``auto`` learns the copies' first-position acceptance
without verifying drafts (nor probing). The judged tokens are walked as
passes drafting one token would have started (``OneDraftWalk``): tokens
inside a copy that was accepted are easy ones, no sample of a pass's start.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from .base import HostDrafter, OneDraftWalk

MIN_NGRAM = 2


class NgramDrafter(HostDrafter):
    """Drafts up to ``k`` tokens by matching the longest recent suffix.

    Contracts (:mod:`.contract`): the core :class:`~.contract.Drafter`,
    :class:`~.contract.KnowsEmpty` and :class:`~.contract.SelfJudging` (one
    unnamed source). It keeps no arrays: a saved state rebuilds its index
    from the token history."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3):
        if not isinstance(max_ngram, int) or max_ngram < MIN_NGRAM:
            raise ValueError(f"max_ngram must be an integer >= 2, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.tokens: List[int] = []
        self._next: Dict[Tuple[int, ...], int] = {}
        self._judging = False  # judge accepted tokens in hindsight (once asked)
        self._walk = OneDraftWalk()  # judged since the last hindsight()

    def reset(self, prompt: Sequence[int], hidden=None):
        """Start a new history from the prompt tokens."""
        self.tokens = []
        self._next = {}
        self._walk = OneDraftWalk()
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]):
        """Append tokens to the history and index the n-grams they complete."""
        for t in tokens:
            # Every n-gram ending at the current last token is now followed by t.
            end = len(self.tokens)
            for n in range(MIN_NGRAM, min(self.max_ngram, end) + 1):
                self._next[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def accept(self, tokens: Sequence[int], hidden=None):
        """Record the tokens a verify step emitted."""
        for i, t in enumerate(tokens):
            if self._judging:  # a copied first token was verified too: no matter
                start = self.match()[1] if i == 0 else None
                hit = start is not None and self.tokens[start] == t
                self._walk.see(hit, start is not None)
            self.extend((t,))

    def hindsight(self) -> Dict[Optional[str], Tuple[int, int]]:
        """``{None: (hits, trials)}``: of the passes since the last call
        that began with a match (walked by ``OneDraftWalk``), how many
        began with the copy's first token (None: this drafter's one source)."""
        self._judging = True
        hits, trials = self._walk.take()
        return {None: (hits, trials)} if trials else {}

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """None: its drafts have one unnamed source."""
        return None

    def set_source_paying(self, source: str, paying: bool):
        """One source: nothing to choose between."""

    def match(self) -> Tuple[int, Optional[int]]:
        """(n, start): the longest suffix n-gram seen before and where its
        continuation starts; (0, None) when nothing matches."""
        L = len(self.tokens)
        for n in range(min(self.max_ngram, L), MIN_NGRAM - 1, -1):
            start = self._next.get(tuple(self.tokens[L - n :]))
            if start is not None:
                return n, start
        return 0, None

    def can_draft(self) -> bool:
        """Whether the history's suffix was seen before (a copy to draft)."""
        return self.match()[1] is not None

    def match_length(self) -> int:
        """Length of the longest suffix n-gram seen before (0: none)."""
        return self.match()[0]

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens that followed the suffix's last occurrence.

        A continuation that runs into the end of the history keeps copying
        with the same period, so repeating text drafts all ``k`` tokens.
        """
        start = self.match()[1] if k > 0 else None
        if start is None:
            return []
        seq = self.tokens
        L = len(seq)
        out = []
        for i in range(k):
            j = start + i
            out.append(seq[j] if j < L else out[j - L])
        return out
