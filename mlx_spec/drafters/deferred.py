"""The accepted rows an MTP head has not run yet, pass by pass.

A head defers its accepted rows while nothing drafts with it (in a batch, up
to hundreds of passes' worth), and a batch asks every member how many rows it
holds several times a pass; so the count is kept as rows come and go rather
than summed over every pass held (25 us at 512 passes on a CPU, per ask).
"""

from typing import List, Sequence, Tuple

import mlx.core as mx

Rows = Tuple[mx.array, mx.array]  # tokens [n], hidden [n, H] of one pass


class DeferredRows:
    """Passes' accepted rows in order; ``rows`` counts them all."""

    def __init__(self):
        self.passes: List[Rows] = []
        self.rows = 0

    def __bool__(self) -> bool:
        return bool(self.passes)

    def add(self, tokens: mx.array, hidden: mx.array):
        """One pass's rows: tokens [n], hidden [n, H]."""
        self.passes.append((tokens, hidden))
        self.rows += tokens.size

    def extend(self, passes: Sequence[Rows]):
        for tokens, hidden in passes:
            self.add(tokens, hidden)

    def keep_last(self, rows: int) -> int:
        """Drop the oldest rows until at most ``rows`` (>= 1) are held (a
        pass cut in two keeps its last rows); how many were dropped."""
        dropped = 0
        while self.rows > rows:
            tokens, hidden = self.passes.pop(0)
            self.rows -= tokens.size
            cut = min(tokens.size, self.rows + tokens.size - rows)
            dropped += cut
            if cut < tokens.size:
                self.passes.insert(0, (tokens[cut:], hidden[cut:]))
                self.rows += tokens.size - cut
        return dropped

    def starts(self) -> List[bool]:
        """Per row, whether its token began its pass."""
        return [i == 0 for tokens, _ in self.passes for i in range(tokens.size)]

    def take(self) -> List[Rows]:
        """Every pass held, in order; none held afterwards."""
        passes, self.passes, self.rows = self.passes, [], 0
        return passes
