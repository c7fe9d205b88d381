"""``mtp+ngram``: prompt-lookup drafts where the text repeats, MTP drafts elsewhere.

Both drafters see every ``reset`` / ``accept``, so each stays consistent
whichever one drafted: the MTP cache gets its rows from the target's verified
hidden states in ``accept`` either way, and an n-gram step adds no draft-time
MTP rows (nothing to trim).

Each step has at most one candidate copy (the n-gram draft) and the MTP head's
next token d_1 (free: computed by the last ``accept``); the head's further
steps cost a head forward each, so they run only when the head's draft is
the one verified. Without a copy, the head drafts. With one, the copy is
taken when d_1 agrees with its first token or the match is a full
``max_ngram`` gram. When they disagree, the target's next token settles who
was right (``emitted[0]`` is the target's token there whichever draft was
used), and a decayed score of those wins picks the source at the next
disagreement (ties: the head). So it learns within a generation whether the
head or the copy is more reliable where they differ, without running the
head for a draft it does not use.

Asking the head costs its deferred rows (a head forward) and a host
synchronisation, so while ``auto`` finds that the head's drafts do not pay
(``set_source_paying``) a copy is taken without asking.

While sampling, the choice must not depend on the sampled draft:
:meth:`MTPNgramDrafter.prefer_copy` (the agreement rule alone) decides before
the head drafts. ``scripts/bench_mtp_ngram.py`` compares this with other rules.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from .contract import HEAD_SOURCE, Proposal, host_proposal
from .mtp import MTPDrafter
from .ngram import NgramDrafter

DECAY = 0.8  # weight of older disagreements in the adaptive score


COPY_SOURCE = "ngram"  # the source name of its copies


class MTPNgramDrafter:
    """Chooses per step between an n-gram draft and an MTP draft.

    Contracts (:mod:`.contract`): those of :class:`~.mtp.MTPDrafter`, its
    head's drafts named ``HEAD_SOURCE`` and its copies ``COPY_SOURCE``."""

    name = "mtp+ngram"
    needs_hidden = True
    head_pays = True  # False: a copy is taken without asking the head

    def __init__(self, head, max_ngram: int = 3):
        self.mtp = MTPDrafter(head)
        self.ngram = NgramDrafter(max_ngram=max_ngram)
        self.last_draft_source: Optional[str] = None
        self.steps = {HEAD_SOURCE: 0, COPY_SOURCE: 0}
        self.score = {HEAD_SOURCE: 0.0, COPY_SOURCE: 0.0}
        self._divergence = None  # (copy[0], head's d_1) where they differ

    def set_sampling(self, choose):
        """Sample MTP drafts with ``choose`` (None: the head's argmax); copies
        stay deterministic."""
        self.mtp.set_sampling(choose)

    @property
    def head_drafter(self) -> MTPDrafter:
        """The head's drafting part (``contract.HeadBased``)."""
        return self.mtp

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
        self.score = {HEAD_SOURCE: 0.0, COPY_SOURCE: 0.0}
        self._divergence = None

    def catch_up(self):
        self.mtp.catch_up()

    def rows_read(self, n: int) -> int:
        return self.mtp.rows_read(n)

    def hindsight(self):
        judged = self.mtp.hindsight()
        copies = self.ngram.hindsight().get(None)
        return {**judged, COPY_SOURCE: copies} if copies else judged

    def set_source_paying(self, source: str, paying: bool):
        if source == HEAD_SOURCE:
            self.head_pays = paying

    def suspend(self, source: str):
        """The head's upkeep stops while its drafts do not pay; the n-gram
        index goes on (a few dictionary writes a token: nothing to save)."""
        self.mtp.suspend(source)

    def resume(self, source: str):
        self.mtp.resume(source)

    def saved_arrays(self) -> List[mx.array]:
        return self.mtp.saved_arrays()  # the n-gram index follows the history

    def take_deferred(self) -> list:
        return self.mtp.take_deferred()

    def check_state(self, arrays, deferred):
        self.mtp.check_state(arrays, deferred)

    def put_deferred(self, rows: list):
        self.mtp.put_deferred(rows)

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        self.mtp.restore(history, arrays)
        self.ngram.reset(history)
        self.score = {HEAD_SOURCE: 0.0, COPY_SOURCE: 0.0}
        self._divergence, self.last_draft_source = None, None

    def prefer_copy(self, copy: List[int]) -> bool:
        """Copy or MTP, decided before the head drafts: the copy when there
        is no head row yet (one-token prompt), when the match is a full
        ``max_ngram``-gram, or when the head's next token agrees with it.
        A full match needs no head state (its deferred rows stay deferred)."""
        if self.ngram.match_length() >= self.ngram.max_ngram:
            return True
        logits = self.mtp.rows.next_logits()
        return logits is None or int(mx.argmax(logits).item()) == copy[0]

    def needs_head_state(self, k: int) -> bool:
        """Whether ``propose(k)`` looks at the head's state (runs its deferred
        rows): not for a copy of a full ``max_ngram`` match, taken as is."""
        copy = self.ngram.draft(k)
        if copy and not self.head_pays:
            return False
        return not copy or self.ngram.match_length() < self.ngram.max_ngram

    def can_draft(self) -> bool:
        return self.mtp.can_draft() or self.ngram.can_draft()

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """The source of the next draft: "ngram" (a copy), "mtp" (the head)
        or None (nothing to draft). Without a copy the head is not run to
        answer (its rows may stay deferred if the policy then drafts
        nothing); nor, unless ``look``, for a partial match while rows are
        deferred (a batch catches its rows' heads up together): the source
        with the better record is named then."""
        copy = self.ngram.draft(k)
        if not copy:
            return HEAD_SOURCE if self.mtp.can_draft() else None
        if not self.head_pays:
            return COPY_SOURCE
        partial = self.ngram.match_length() < self.ngram.max_ngram
        if not look and partial and self.mtp.rows.pending_rows:
            better = self.score[COPY_SOURCE] > self.score[HEAD_SOURCE]
            return COPY_SOURCE if better else HEAD_SOURCE
        return HEAD_SOURCE if self._needs_head(copy) else COPY_SOURCE

    def drafts_with_head(self, k: int) -> bool:
        """Whether ``propose(k)`` runs the head."""
        return self._needs_head(self.ngram.draft(k))

    def _needs_head(self, copy: List[int]) -> bool:
        """Without a copy: when the head has a row. With one: when the head
        pays, the copy is not preferred and (when the score decides) the head
        has the better record."""
        if not copy:
            return self.mtp.rows.next_logits() is not None
        if not self.head_pays or self.prefer_copy(copy):
            return False
        head, copies = self.score[HEAD_SOURCE], self.score[COPY_SOURCE]
        return not self.score_decides() or head >= copies

    def score_decides(self) -> bool:
        """Whether the decayed score settles a disagreement between the copy
        and the head: while greedy, where the score compares copies with the
        head's argmax (the raw one under logits processors, an estimate of
        the processed one). While sampling the head drafts then, so that the
        choice never depends on the sampled draft."""
        return not self.mtp.samples

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens after the pending token, on the host."""
        proposal = self.propose(k)
        mx.eval(proposal.tokens, proposal.probs)
        return proposal.tokens.tolist()

    def propose(self, k: int) -> Proposal:
        """A copy, or the head's draft (lazy: see :meth:`MTPDrafter.propose`)."""
        self.mtp.check_draft_length(k)
        self._divergence = None
        copy = self.ngram.draft(k)
        if (
            copy
            and self.head_pays
            and self.score_decides()
            and not self.prefer_copy(copy)
        ):
            head = int(mx.argmax(self.mtp.rows.next_logits()).item())
            self._divergence = (copy[0], head)  # scored once the target decides
        head = self._needs_head(copy)
        proposal = self.mtp.propose(k) if head else host_proposal(copy)
        source = HEAD_SOURCE if head else COPY_SOURCE
        self.last_draft_source = source if len(proposal) else None
        if len(proposal):
            self.steps[source] += 1
        return proposal

    def accept(self, emitted: Sequence[int], hidden=None):
        if self._divergence is not None and emitted:
            # emitted[0] is the target's own next token, whichever draft ran
            for source, guess in zip((COPY_SOURCE, HEAD_SOURCE), self._divergence):
                hit = 1.0 if guess == emitted[0] else 0.0
                self.score[source] = DECAY * self.score[source] + hit
        self._divergence = None
        self.mtp.accept(emitted, hidden)
        self.ngram.accept(emitted)
