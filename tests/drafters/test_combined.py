"""mtp+ngram: which source drafts, and that the head runs only for its own drafts."""

import mlx.core as mx

from mlx_spec.drafters.combined import MTPNgramDrafter
from mlx_spec.drafters.contract import DraftSite, Proposal


class FakeRows:
    """The head's rows: d_1 is free (``next_logits``)."""

    def __init__(self, head):
        self.head, self.pending_rows = head, 0

    def next_logits(self):
        self.head.looked += 1
        return mx.eye(self.head.vocab)[self.head.d1]


class FakeHead:
    """The MTP drafter's interface: each ``propose`` is what costs head
    forwards."""

    choose, samples = None, False

    def __init__(self, vocab=16):
        self.vocab, self.d1, self.drafts, self.looked = vocab, 0, 0, 0
        self.rows = FakeRows(self)

    def can_draft(self):
        return True

    def propose(self, k):
        self.drafts += 1
        tokens = mx.array([self.d1] * k, mx.uint32)
        return Proposal(tokens, None, DraftSite.DEVICE)  # lazy, on the device

    def check_draft_length(self, k):
        pass

    def accept(self, emitted, hidden=None):
        pass


class FakeCopy:
    max_ngram = 3

    def __init__(self):
        self.copy, self.match = [], 1

    def draft(self, k):
        return self.copy[:k]

    def match_length(self):
        return self.match

    def can_draft(self):
        return bool(self.copy)

    def accept(self, emitted):
        pass


def _drafter():
    d = MTPNgramDrafter.__new__(MTPNgramDrafter)
    d.mtp, d.ngram = FakeHead(), FakeCopy()
    d.last_draft_source, d._divergence = None, None
    d.steps, d.score = {"mtp": 0, "ngram": 0}, {"mtp": 0.0, "ngram": 0.0}
    return d


def test_agreeing_copy_is_taken_without_running_the_head():
    d = _drafter()
    d.ngram.copy, d.mtp.d1 = [5, 6, 7], 5
    assert d.draft(3) == [5, 6, 7] and d.mtp.drafts == 0
    d.ngram.match, d.mtp.d1 = 3, 9  # a full n-gram match wins a disagreement
    assert d.draft(3) == [5, 6, 7] and d.mtp.drafts == 0
    d.ngram.copy = []  # no copy: the head drafts
    assert d.draft(2) == [9, 9] and d.mtp.drafts == 1


def test_disagreements_are_scored_by_the_targets_next_token():
    d = _drafter()
    d.ngram.copy, d.mtp.d1 = [5, 6], 7
    assert d.draft(2) == [7, 7]  # tie: the head
    d.accept([5])  # the target chose the copy's token
    assert d.score["ngram"] > d.score["mtp"]
    heads = d.mtp.drafts
    assert d.draft(2) == [5, 6] and d.mtp.drafts == heads  # head not run
    d.accept([7])
    d.accept([7])  # an agreement-free pass: nothing scored
    assert d.score["mtp"] == 1.0 and d.score["ngram"] == 0.8
    assert d.draft(2) == [7, 7]
    assert d.steps == {"mtp": 2, "ngram": 1}


def test_draft_source_names_who_drafts_next_without_running_the_head():
    d = _drafter()
    d.ngram.copy, d.mtp.d1 = [], 5
    assert d.draft_source(3) == "mtp" and d.mtp.looked == 0  # no copy: the head
    d.mtp.can_draft = lambda: False
    assert d.draft_source(3) is None and not d.can_draft()  # nothing to draft from
    d.ngram.copy, d.ngram.match = [5, 6], 3
    assert d.can_draft()  # the copy, with no head row
    assert d.draft_source(3) == "ngram" and d.mtp.looked == 0  # a full match
    d.ngram.match, d.mtp.d1 = 1, 9  # a partial match the head disagrees with
    assert d.draft_source(3) == "mtp" and d.mtp.looked == 1
    assert d.draft(3) == [9, 9, 9] and d.last_draft_source == "mtp"
    # In a batch (look=False) a row's deferred head rows are not run to
    # answer: the better-scored source is named, the head left alone.
    # Here the head would agree with the copy, but its record is better.
    d.mtp.rows.pending_rows, d.mtp.looked, d.mtp.d1 = 4, 0, 5
    d.score["mtp"] = 1.0
    assert d.draft_source(3, look=False) == "mtp" and d.mtp.looked == 0
    assert d.draft_source(3) == "ngram" and d.mtp.looked == 1  # it agrees


def test_a_head_that_does_not_pay_is_not_asked_about_copies():
    """While auto finds the head's drafts do not pay, a copy is taken
    without running the head (its deferred rows, a host synchronisation);
    without a copy the head still drafts when asked to."""
    d = _drafter()
    d.ngram.copy, d.mtp.d1 = [5, 6], 9  # a partial match the head disagrees with
    d.set_source_paying("mtp", False)
    assert d.draft_source(3) == "ngram" and d.draft(2) == [5, 6]
    assert d.mtp.looked == 0 and d.mtp.drafts == 0
    d.ngram.copy = []
    assert d.draft_source(3) == "mtp" and d.draft(2) == [9, 9]
    d.ngram.copy = [5, 6]
    d.set_source_paying("mtp", True)  # control: the head is asked again
    assert d.draft_source(3) == "mtp" and d.mtp.looked > 0


def test_hindsight_names_each_source():
    """The head's judgements stay under "mtp", the copies' (the n-gram
    index's one source) come under "ngram"; a source with nothing judged is
    left out."""
    from mlx_spec.drafters.ngram import NgramDrafter

    d = _drafter()
    d.ngram = NgramDrafter(3)
    d.ngram.reset([1, 2, 3, 1, 2])
    d.mtp.hindsight = lambda: {"mtp": (3, 4)}
    assert d.hindsight() == {"mtp": (3, 4)}  # asking turns the index's judging on
    d.ngram.accept([3])  # after 1 2: the copy's
    d.ngram.accept([1])  # the bonus after it: not judged
    d.ngram.accept([9])  # after 3 1: not the copy's (it copies 2)
    assert d.hindsight() == {"mtp": (3, 4), "ngram": (1, 2)}
