"""Hindsight judging of the MTP head's first drafts.

Once asked (``hindsight``), the head judges the d_1 each verified row would
have drafted against the token the target chose next (a prompt's last rows:
the target's greedy choice there), so ``auto`` learns the head's first-draft
acceptance where it does not draft; only at tokens that began a pass
(``OneDraftWalk``: those inside a drafting pass were reached through
accepted drafts, mostly easy ones). Greedy drafts only: a sampled draft is
judged when it is verified.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .base import OneDraftWalk

KEPT_JUDGEMENTS = 16  # judged blocks held as arrays before they are counted


class HeadJudge:
    """The head's first drafts judged in hindsight, counted pass by pass.

    ``samples``: whether the drafter samples its drafts now (then nothing is
    judged); the drafter sets it (a plain flag, not a call back into the
    drafter: a reference cycle would keep a departed row's arrays alive
    until the garbage collector runs)."""

    def __init__(self, head):
        self.head = head
        self.samples = False
        self.judging = False  # judge first drafts (once asked)
        self._judged: List[Tuple[mx.array, Optional[Sequence[bool]]]] = []
        self._walk = OneDraftWalk()  # what was counted, not yet taken

    def reset(self):
        """A new history: nothing judged (judging stays on once asked)."""
        self._judged, self._walk = [], OneDraftWalk()

    def reads_every_row(self, starts: Optional[Sequence[bool]]) -> bool:
        """Whether rows run with ``starts`` [L] (accepted rows: whether each
        token began a pass; None: a prompt's) are judged, so the head must
        compute every row's output, not only the last one's."""
        judged = starts is not None and self.judging and any(starts[1:])
        return judged and not self.samples

    def judge(
        self, hm: mx.array, chosen: mx.array, starts: Optional[Sequence[bool]] = None
    ):
        """Judge the d_1 of rows 0..L-2 against ``chosen`` [L-1], the token
        the target chose after each (row i's d_1 meets row i + 1's token),
        where ``starts`` [L-1] (None: everywhere) says it began a pass.
        hm: [1, L, H] of consecutive rows. Under logits processors the raw
        argmax stands for the processed one, an estimate for ``auto``."""
        if not self.judging or self.samples or chosen.size == 0:
            return
        if starts is not None and not any(starts):
            return  # a drafting pass's own tokens: nothing began a pass
        guesses = mx.argmax(self.head.logits(hm[:, :-1]), axis=-1)[0]  # [L-1]
        hits = guesses == chosen
        mx.async_eval(hits)  # the rows run now, not at the next draft
        self._judged.append((hits, starts))
        if len(self._judged) > KEPT_JUDGEMENTS:  # nobody asks: keep counts
            self._count()

    def _count(self):
        """Walk the rows judged so far (a block's last row, unjudged, parts them)."""
        for hits, starts in self._judged:
            for i, hit in enumerate(hits.tolist()):
                self._walk.see(hit, starts is None or starts[i])
            self._walk.see(False, start=False)
        self._judged = []

    def hindsight(self) -> Dict[str, Tuple[int, int]]:
        """``{"mtp": (hits, trials)}``: of the rows run since the last call,
        how many would have drafted a first token the target then chose.
        The first call turns judging on."""
        self.judging = True
        self._count()
        hits, trials = self._walk.take()
        return {"mtp": (hits, trials)} if trials else {}
