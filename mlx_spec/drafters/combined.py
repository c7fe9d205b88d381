"""``mtp+ngram``: prompt-lookup drafts where the text repeats, MTP drafts elsewhere.

Both drafters see every ``reset`` / ``accept``, so each stays consistent
whichever one drafted: the MTP cache gets its rows from the target's verified
hidden states in ``accept`` either way, and an n-gram step adds no draft-time
MTP rows (nothing to trim).

Each step has at most one candidate copy (the n-gram draft) and the MTP head's
next token d_1 (free: computed by the last ``accept``). With a copy, the head
drafts too. Equal drafts: the head's. Otherwise, at their first difference j
the verify settles who was right whenever the target gets that far:
``emitted[j]`` is the target's token there, whichever draft was used (an
accepted token or the correction). A decayed score of those wins picks the
source at the next difference (ties: the copy for a full ``max_ngram``
match). So it learns within a generation whether the head or the copy is
more reliable, at every depth; the price is k - 1 head steps on copy steps.

While sampling, the choice must not depend on the sampled draft, so
:meth:`MTPNgramDrafter.prefer_copy` decides before the head drafts: the copy
when the head's argmax agrees with it or the match is a full ``max_ngram``
gram. ``scripts/bench_mtp_ngram.py`` compares this with other rules.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from .base import Drafter
from .mtp import MTPDrafter
from .ngram import NgramDrafter

DECAY = 0.8  # weight of older disagreements in the adaptive score


class MTPNgramDrafter(Drafter):
    """Chooses per step between an n-gram draft and an MTP draft."""

    name = "mtp+ngram"
    needs_hidden = True
    learns_choice = True  # the scored choice above; False: ``prefer_copy`` only

    def __init__(self, head, max_ngram: int = 3):
        self.mtp = MTPDrafter(head)
        self.ngram = NgramDrafter(max_ngram=max_ngram)
        self.last_draft_source: Optional[str] = None
        self.steps = {"mtp": 0, "ngram": 0}
        self.score = {"mtp": 0.0, "ngram": 0.0}
        self._divergence = None  # (j, copy[j], mtp[j]): first difference

    def set_sampling(self, choose):
        """Sample MTP drafts with ``choose`` (None: the head's argmax); copies
        stay deterministic."""
        self.mtp.set_sampling(choose)

    @property
    def draft_probs(self) -> Optional[mx.array]:
        """q [m, V] of the last draft when the head sampled it; None for a
        deterministic draft (a copy, or the head's argmax)."""
        return self.mtp.draft_probs if self.last_draft_source == "mtp" else None

    @property
    def last_draft_logits(self) -> Optional[mx.array]:
        """MTP logits [m, V] of the last draft; None for an n-gram draft."""
        if self.last_draft_source != "mtp":
            return None
        return self.mtp.last_draft_logits

    def reset(self, prompt_tokens: Sequence[int], hidden=None):
        self.mtp.reset(prompt_tokens, hidden)
        self.ngram.reset(prompt_tokens)
        self.last_draft_source = None
        self.score = {"mtp": 0.0, "ngram": 0.0}
        self._divergence = None

    def catch_up(self):
        self.mtp.catch_up()

    @property
    def state(self) -> List[mx.array]:
        return self.mtp.state  # the n-gram index follows the history

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        self.mtp.restore(history, arrays)
        self.ngram.restore(history)
        self.score = {"mtp": 0.0, "ngram": 0.0}
        self._divergence, self.last_draft_source = None, None

    def prefer_copy(self, copy: List[int]) -> bool:
        """Copy or MTP, decided before the head drafts: the copy when there
        is no head row yet (one-token prompt), when the match is a full
        ``max_ngram``-gram, or when the head's next token agrees with it."""
        logits = self.mtp.next_logits()
        if logits is None or self.ngram.match_length() >= self.ngram.max_ngram:
            return True
        return int(mx.argmax(logits).item()) == copy[0]

    def drafts_with_head(self, k: int) -> bool:
        """Whether ``draft(k)`` runs the head."""
        return self._needs_head(self.ngram.draft(k))

    def _needs_head(self, copy: List[int]) -> bool:
        """Without a copy: when the head has a row. With one: when learning
        the choice (both are drafted), or when the copy is not preferred."""
        has_row = self.mtp.next_logits() is not None
        if not copy or (has_row and self._learns()):
            return has_row
        return not self.prefer_copy(copy)

    def _learns(self) -> bool:
        return self.learns_choice and self.mtp.choose is None  # not sampling

    def _pick(self, copy: List[int], ours: List[int]) -> List[int]:
        """Both drafts; at their first difference, the source with the better record."""
        j = next((i for i, (a, b) in enumerate(zip(copy, ours)) if a != b), None)
        if j is None:
            return ours
        self._divergence = (j, copy[j], ours[j])
        if self.score["ngram"] != self.score["mtp"]:
            take_copy = self.score["ngram"] > self.score["mtp"]
        else:
            take_copy = self.ngram.match_length() >= self.ngram.max_ngram
        return copy if take_copy else ours

    def draft(self, k: int) -> List[int]:
        self.mtp.check_draft_length(k)
        self._divergence = None
        copy = self.ngram.draft(k)
        if not self._needs_head(copy):
            out = copy
        else:
            ours = self.mtp.draft(k)
            out = self._pick(copy, ours) if copy and self._learns() else ours
        source = "ngram" if out is copy else "mtp"
        self.last_draft_source = source if out else None
        self.steps[source] += bool(out)
        return out

    def accept(self, emitted: Sequence[int], hidden=None):
        if self._divergence is not None:
            j, guesses = self._divergence[0], self._divergence[1:]
            # Both drafts share tokens < j, so the target reached position j
            # iff it accepted j tokens; emitted[j] is then its token there.
            if len(emitted) > j:
                for source, guess in zip(("ngram", "mtp"), guesses):
                    hit = guess == emitted[j]
                    self.score[source] = DECAY * self.score[source] + hit
            self._divergence = None
        self.mtp.accept(emitted, hidden)
        self.ngram.accept(emitted)
