"""MTP drafting: the target's own multi-token-prediction head proposes tokens.

Shift-by-one (docs/mtp_head.md): the MTP row at position p combines
``(token_{p+1}, h_p)``, h_p being the target's post-final-norm hidden state of
the token at p. The head's verified rows (:class:`~.mtp_rows.HeadRows`: its
KV cache, last row and deferred rows, which a batch takes over) hold exactly
one row per position the target has verified:

- ``reset``: the target prefilled x_0..x_{N-2} (h_0..h_{N-2}); rows
  ``(x_1, h_0) .. (x_{N-1}, h_{N-2})`` at positions 0..N-2. The last row's
  logits give d_1 (the token after the pending x_{N-1}).
- ``propose(k)``: d_1 comes from the stored logits; step j > 1 runs one row
  ``(d_{j-1}, hm_{j-1})`` (hm: the head's own post-``mtp.norm`` state), so a
  draft of k tokens adds k - 1 draft-time rows.
- ``accept(emitted, hidden)``: trim the draft-time rows, then append the rows
  ``(emitted[i], hidden[i])`` for i = 0..n (deferred, run in one batched
  forward), from the target's fresh hidden states; the last row gives the
  next d_1.

The rows run are judged in hindsight (:class:`~.mtp_judge.HeadJudge`), so
``auto`` learns the head's first-draft acceptance where it does not draft.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .base import MAX_MTP_DRAFT_TOKENS
from .contract import HEAD_SOURCE, NO_PROPOSAL, DraftSite, Proposal
from .mtp_judge import HeadJudge
from .mtp_rows import PENDING_ROWS, HeadRows

__all__ = ["MTPDrafter", "PENDING_ROWS"]


class MTPDrafter:
    """Greedy or sampled drafting with an :class:`~mlx_spec.models.mtp.MTPHead`.

    ``rows``: the head's verified rows (a batch takes them over and reads
    them directly); ``judge``: its first drafts judged in hindsight.
    ``last_draft_logits`` [m, V]: the head's logits that produced each of the
    m tokens of the last draft (row i -> d_{i+1}).

    Contracts (:mod:`.contract`): the core :class:`~.contract.Drafter`, and
    :class:`~.contract.SamplesDrafts`, :class:`~.contract.KnowsEmpty`,
    :class:`~.contract.ReadsPromptRows`, :class:`~.contract.SelfJudging`
    (one source, ``HEAD_SOURCE``), :class:`~.contract.Suspends`,
    :class:`~.contract.DefersWork`,
    :class:`~.contract.KeepsArrays` and :class:`~.contract.HeadBased`.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, head, max_draft: int = MAX_MTP_DRAFT_TOKENS):
        if not 1 <= max_draft <= MAX_MTP_DRAFT_TOKENS:
            raise ValueError(
                f"max_draft must be in 1..{MAX_MTP_DRAFT_TOKENS}, got {max_draft}"
            )
        self.head = head
        self.max_draft = max_draft
        self.judge = HeadJudge(head)
        self.rows = HeadRows(head, self.judge)
        self.last_draft_logits: Optional[mx.array] = None
        self._draft_rows = 0  # draft-time rows in the cache, trimmed on accept
        self.choose = None  # logits, drafted -> (token, q); None: the argmax
        self._offered: Optional[Tuple[int, Proposal]] = None  # a batch's draft

    def check_draft_length(self, k):
        """ValueError unless 1 <= k <= max_draft (one MTP layer, reused per step)."""
        if not isinstance(k, int) or not 1 <= k <= self.max_draft:
            raise ValueError(
                f"MTP drafts 1..{self.max_draft} tokens per step, got k={k!r}"
            )

    def set_sampling(self, choose):
        """Choose drafts with ``choose`` (see ``sampling.make_draft_sampler``:
        a sample, or the argmax after logits processors); None: the argmax."""
        self.choose = choose
        self.judge.samples = self.samples

    @property
    def samples(self) -> bool:
        """Whether ``choose`` samples its drafts (greedy ones are judged in
        hindsight)."""
        return self.choose is not None and self.choose.samples

    def catch_up(self):
        """Run and evaluate the deferred rows (a draft timed next times drafting)."""
        self.rows.catch_up()

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """``HEAD_SOURCE``; None before the head has a row."""
        return HEAD_SOURCE if self.can_draft() else None

    def set_source_paying(self, source: str, paying: bool):
        """One source: nothing to choose between."""

    def suspend(self, source: str):
        """The head's drafts do not pay: its rows are kept (the last few),
        not run nor judged (``contract.Suspends``)."""
        if source == HEAD_SOURCE:
            self.rows.suspend()

    def resume(self, source: str):
        """The head may draft next: its kept rows run when it does."""
        if source == HEAD_SOURCE:
            self.rows.resume()

    def can_draft(self) -> bool:
        """Whether the head has a verified row, run or deferred (it can draft)."""
        return self.rows.can_draft()

    def hindsight(self) -> Dict[str, Tuple[int, int]]:
        """``{HEAD_SOURCE: (hits, trials)}`` (see :meth:`HeadJudge.hindsight`)."""
        return self.judge.hindsight()

    def reset(self, prompt_tokens: Sequence[int], hidden: Optional[mx.array]):
        """prompt_tokens: [N]; hidden: [N-1, H] for x_0..x_{N-2} (None if N == 1)."""
        self.rows.reset()
        self.judge.reset()
        self.last_draft_logits = None
        self._draft_rows = 0
        n = len(prompt_tokens) - 1
        if n == 0:
            return  # no row yet: the first step drafts nothing
        if hidden is None:
            raise ValueError(
                "MTP drafting needs the target's hidden states; this target "
                "does not expose them"
            )
        if hidden.shape[0] != n:
            raise ValueError(
                f"reset: {hidden.shape[0]} hidden states for a prompt of "
                f"{len(prompt_tokens)} tokens (expected {n})"
            )
        self.rows.prefill(mx.array(list(prompt_tokens[1:]), dtype=mx.uint32), hidden)

    def rows_read(self, n: int) -> int:
        """Of ``n`` rows given at once (a prompt), how many (the last ones)
        the head reads the hidden states of."""
        return n - self.rows.seen_chunks(n)[0]

    def saved_arrays(self) -> List[mx.array]:
        """Arrays to save with a session: the verified cache rows of each
        layer (keys, values; float16) and the last row's post-norm hidden."""
        return self.rows.state

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        """Rebuild the state saved by :meth:`saved_arrays` (``history`` is
        not needed)."""
        self.reset([0], None)  # an empty cache, no rows
        self.rows.restore(arrays)

    def take_deferred(self) -> List[Tuple[mx.array, mx.array]]:
        return self.rows.take_deferred()

    def put_deferred(self, rows: List[Tuple[mx.array, mx.array]]):
        self.rows.put_deferred(rows)

    def check_state(self, arrays, deferred):
        self.rows.check(arrays, deferred)

    # -- drafting ---------------------------------------------------------------
    def draft(self, k: int) -> List[int]:
        """Up to ``k`` (1..8) tokens after the pending token, on the host."""
        proposal = self.propose(k)
        mx.eval(proposal.tokens, self.last_draft_logits, proposal.probs)
        return proposal.tokens.tolist()

    def propose(self, k: int) -> Proposal:
        """Up to ``k`` tokens after the pending token, lazy (the verify pass
        evaluates them with its own outputs; or a draft a batch computed);
        none before the head has a row."""
        self.check_draft_length(k)
        if self._draft_rows:
            raise RuntimeError("propose() called twice without accept()")
        if self._offered is not None:
            return self._take_offer(k)
        hm, logits = self.rows.head_state
        if logits is None:
            self.last_draft_logits = None
            return NO_PROPOSAL
        steps, tokens, probs = [], [], []
        for step in range(k):
            if step:
                # Lazy chain: the token feeds the next embedding without a sync.
                hm = self.head.head_hidden(
                    tokens[-1].reshape(1, 1), hm, self.rows.cache
                )
                logits = self.head.logits(hm)[0, 0]
            steps.append(logits)
            if self.choose is None:
                tokens.append(mx.argmax(logits))
            else:
                token, q = self.choose(logits, tokens)
                tokens.append(token)
                if q is not None:  # a sample: rejection sampling needs q
                    probs.append(q)
        self._draft_rows = k - 1
        self.last_draft_logits = mx.stack(steps)
        q = mx.stack(probs) if probs else None
        return Proposal(mx.stack(tokens).astype(mx.uint32), q, DraftSite.DEVICE)

    def discard_draft(self):
        """Drop the draft-time rows (the caller verifies some other draft)."""
        if self._draft_rows:
            for c in self.rows.cache:
                c.trim(self._draft_rows)
            self._draft_rows = 0

    def accept(self, emitted: Sequence[int], hidden: Optional[mx.array]):
        """emitted: d_1..d_n + [c]; hidden: [n+1, H] for pending, d_1..d_n."""
        self.discard_draft()
        if hidden is None:
            raise ValueError("MTP drafting needs the target's hidden states")
        if hidden.shape[0] != len(emitted):
            raise ValueError(
                f"accept: {hidden.shape[0]} hidden states for {len(emitted)} tokens"
            )
        self.rows.add(mx.array(list(emitted), dtype=mx.uint32), hidden)

    # -- drafting in a batch (mlx_spec.core.batch_mtp runs several heads' rows
    # as one forward: it holds ``rows``' cache and offers each row its draft) --
    @property
    def head_drafter(self) -> "MTPDrafter":
        """The head's drafting part: this drafter (``contract.HeadBased``)."""
        return self

    def needs_head_state(self, k: int) -> bool:
        """Whether proposing ``k`` tokens looks at the head's state: always."""
        return True

    def drafts_with_head(self, k: int) -> bool:
        """Whether proposing ``k`` tokens runs the head (no verified row: it
        drafts nothing)."""
        return self.rows.next_logits() is not None

    def offer(self, k: int, proposal: Proposal, logits: mx.array):
        """The draft ``propose(k)`` would make, computed elsewhere with its
        draft-time rows already dropped: the next ``propose(k)`` returns it.
        logits: [k, V], the head's logits of each drafted token."""
        self._offered = (k, proposal)
        self.last_draft_logits = logits

    def _take_offer(self, k: int) -> Proposal:
        (offered, proposal), self._offered = self._offered, None
        if offered != k:
            raise RuntimeError(f"a draft of {offered} tokens was offered, {k} asked")
        return proposal
