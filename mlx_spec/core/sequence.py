"""A sequence being decoded: its history, its target caches and its drafter.

A :class:`SpeculativeDecoder` is what a sequence brings to the engine
(:class:`~mlx_spec.core.batch.BatchDecoder`) and takes away again: the tokens
so far, the caches that processed them (prefilled here, in chunks), the
drafter fed the same tokens, and the counters. The engine runs its passes.
"""

from typing import Any, List, Optional

import mlx.core as mx

from ..drafters import calls
from ..drafters.base import as_drafter
from ..drafters.contract import MAX_AUTO_DRAFT_TOKENS
from ..drafters.contract import NO_PROPOSAL, Drafter, Proposal
from ..mlx_lm_compat import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache
from .state import SpeculativeCache
from .stats import SpecStats
from .target import Target, rows_for


class SpeculativeDecoder:
    """Target caches, drafter and token history, advanced one verify pass at a time.

    It outlives a generation: ``feed`` appends new tokens (a first prompt, or a
    later chat turn) with one prefill, so the target's KV/GDN state, the
    drafter's state (n-gram index, MTP cache) and the history carry over.
    Usually the last token of the history is *pending*: known but not yet
    processed by the target (the first input of the next verify pass or
    prefill). ``flush`` processes it, which leaves the caches exactly as plain
    decoding of the same history does.
    """

    def __init__(
        self,
        model,
        drafter=None,
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        rollback: str = "store",
        prompt_cache: Optional[List[Any]] = None,
        prefill_step_size: int = 2048,
        kv_bits: Optional[int] = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
        stats: Optional[SpecStats] = None,
    ):
        self.model, self.max_draft = model, max_draft
        self.drafter: Optional[Drafter] = as_drafter(drafter)
        self.cache = SpeculativeCache(model, max_draft, rollback, caches=prompt_cache)
        self.target = Target(model, self.cache)
        self.prefill_step_size = prefill_step_size
        self.kv = (kv_bits, kv_group_size, quantized_kv_start)
        self.stats = SpecStats() if stats is None else stats
        self.history: List[int] = []
        self.processed = 0  # history[:processed] is in the target's caches
        self.last_hidden = None  # [1, H]: hidden of history[-1] once processed
        self._held = []  # (tokens, hidden parts) fed, not yet given the drafter

    def _quantize(self):
        kv_bits, group_size, start = self.kv
        maybe_quantize_kv_cache(self.cache.caches, start, group_size, kv_bits)

    @property
    def pending(self) -> List[int]:
        return self.history[self.processed :]

    def feed(self, tokens: List[int], progress=None, more: bool = False):
        """Append ``tokens`` (non-empty): the target prefills the pending token
        and all new tokens but the last, which becomes pending.

        ``more``: the rest of the prompt follows (a prompt prefilled in
        chunks): the drafter gets the chunks in one piece, as from one
        ``feed`` of the whole (a windowed MTP head then skips the rows no
        later row attends to), at the last chunk or when next needed; a
        drafter that takes a prompt in pieces (``TakesPromptInPieces``)
        gets each chunk at once instead."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("cannot feed an empty list of tokens")
        inputs = self.pending + tokens[:-1]
        keep = self.drafter is not None and self.drafter.needs_hidden
        hidden = self.target.prefill(
            mx.array(inputs, mx.uint32),
            self.prefill_step_size,
            progress or (lambda n: None),
            self._quantize,
            keep_hidden=keep,
        )
        if self.drafter is not None:
            # row i: the hidden state of the token before tokens[i]
            if self.history and not self.pending and keep:
                hidden = [self.last_hidden] + (hidden or [])
            self._held.append((tokens, hidden or []))
        self.history += tokens
        self.processed = len(self.history) - 1
        if not more:
            self.update_drafter()
        elif calls.takes_prompt_in_pieces(self.drafter):
            # Held to the last chunk, a long prompt's rows would all be in
            # memory at once (the dflash drafter's features: n x H floats a
            # position); taken in now and evaluated, only this chunk's are.
            self.update_drafter()
            mx.eval(calls.saved_arrays(self.drafter))

    def update_drafter(self):
        """Hand the drafter the tokens fed with ``more`` that it has not seen,
        in one piece (a ``reset`` when they are the whole history)."""
        if not self._held:
            return
        tokens = [t for part, _ in self._held for t in part]
        hidden = [self._rows(h) for _, parts in self._held for h in parts] or None
        if hidden and any(h is None for h in hidden):
            hidden = None
        if hidden:
            rows = sum(h.shape[0] for h in hidden)
            read = calls.rows_read(self.drafter, rows)
            hidden = _blank_first(hidden, rows - read)
        self._held = []
        if len(tokens) == len(self.history):
            self.drafter.reset(tokens, hidden)
        else:
            self.drafter.accept(tokens, hidden)

    def _rows(self, hidden: mx.array) -> Optional[mx.array]:
        """The part of the target's hidden rows the drafter reads."""
        return rows_for(self.model, hidden, calls.reads_features(self.drafter))

    def flush(self):
        """Process the pending token: the caches then equal plain decoding's."""
        if self.pending:
            self.last_hidden = self.target.hidden(mx.array(self.pending, mx.uint32))
            mx.eval([c.state for c in self.cache.caches])
            self.processed = len(self.history)

    def draft_room(self) -> float:
        """Most drafts the next pass may verify (the KV quantization point)."""
        kv_bits, _, start = self.kv
        if kv_bits is None:
            return self.max_draft
        return min(self.max_draft, self.cache.tokens_before(start) - 1)

    def draft_source(self, k: int, look: bool = True):
        """Which of the drafter's sources would draft ``k`` tokens next
        (None: a one-source drafter); see ``contract.SelfJudging``."""
        return calls.draft_source(self.drafter, k, look)

    def next_draft(self, k: int) -> Proposal:
        """Up to ``k`` drafts for the next pass (lazy where the drafter
        drafts on the device: no host synchronisation)."""
        if self.drafter is None or k == 0:
            return NO_PROPOSAL
        return self.drafter.propose(k)

    def advance(self, drafted: int, n: int, tokens: List[int], kept: int, hidden):
        """The bookkeeping of a pass whose caches kept ``kept`` inputs and
        which emitted ``tokens`` (``n`` of ``drafted`` drafts accepted):
        statistics, the drafter, the history. hidden: [T, H] of the pass or None."""
        j = len(tokens)
        self.stats.record(drafted, min(n, j), j)
        if self.drafter is not None:
            self.drafter.accept(
                tokens, None if hidden is None else self._rows(hidden[:j])
            )
        self.history += tokens
        # its last token stays pending unless the pass processed it too
        self.processed = len(self.history) - (1 if kept == j else 0)
        if kept > j and hidden is not None:
            self.last_hidden = hidden[kept - 1 : kept]


def _blank_first(parts: List[mx.array], n: int) -> mx.array:
    """``parts`` ([L_i, H], lazy) concatenated, the first ``n`` rows zeros:
    a part wholly among them is never evaluated (in a prompt's prefill, the
    last layer's MLP and the final norm of rows no drafter reads)."""
    rows = []
    for part in parts:
        blank = min(n, part.shape[0])
        n -= blank
        if blank:
            rows.append(mx.zeros((blank,) + part.shape[1:], part.dtype))
        if blank < part.shape[0]:
            rows.append(part[blank:])
    return mx.concatenate(rows)
