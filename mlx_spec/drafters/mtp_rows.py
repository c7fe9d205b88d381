"""The MTP head's verified rows: its KV cache, its last row and deferred rows.

Shift-by-one (docs/mtp_head.md): the row at position p combines
``(token_{p+1}, h_p)``, h_p being the target's post-final-norm hidden state of
the token at p. The cache holds exactly one row per position the target has
verified (draft-time rows are the drafter's, trimmed before rows are added).
The last row's post-``mtp.norm`` state ``hm`` and logits are where the next
draft starts.

Accepted rows are deferred and run in batches, so that passes without a
draft (``auto`` choosing k = 0) cost no head forward at all. While suspended
(``auto`` has not drafted with the head for a while) they are not run at
all: only the last ``RESUME_ROWS`` are kept, and the head restarts its
window over them when it next drafts (docs/auto_policy.md). In a batch,
``core.batch_mtp`` takes this state over: it holds the cache, runs the
deferred rows of several heads as one forward (``take_pending``) and hands
back each one's last row (``set_last_row``).
"""

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .deferred import DeferredRows
from .mtp_judge import HeadJudge

PREFILL_CHUNK = 2048  # prompt rows per head forward (full attention)
# With an attention window, chunks of the window's size (not below this):
# each chunk then attends to under twice its rows (docs/mtp_head.md).
MIN_WINDOW_CHUNK = 256
PENDING_ROWS = 64  # accepted rows deferred at most before a head forward
JUDGED_PROMPT_ROWS = 64  # a prompt's last rows judged in hindsight
# Accepted rows kept while suspended: the window the head restarts over when
# it resumes (their first drafts judged then), bounded whatever the pause.
RESUME_ROWS = PENDING_ROWS

Rows = Tuple[mx.array, mx.array]  # tokens [L], hidden [L, H]


class HeadRows:
    """The head's cache, last verified row and deferred accepted rows; the
    rows it runs are judged by ``judge``."""

    def __init__(self, head, judge: HeadJudge):
        self.head, self.judge = head, judge
        self.cache = None  # a list of per-layer KV caches (None: not reset yet)
        self.hm: Optional[mx.array] = None  # [1, 1, H] of the last row
        self.logits: Optional[mx.array] = None  # [V]: d_1 of the next draft
        self.verified = 0  # rows of verified positions in the cache
        self.pending = DeferredRows()  # accepted rows not yet run
        self.pending_limit = PENDING_ROWS  # a batch that runs the rows lifts it
        self.suspended = False  # rows are kept (the last few), never run
        # Rows were dropped while suspended: the cache's rows end before a
        # gap, so the next run starts an empty window (whoever holds the cache).
        self.gap = False
        self.dropped = 0  # accepted rows dropped while suspended, in all

    def reset(self):
        """An empty cache, no rows (its window: ``head.attention_window``)."""
        self.cache = self.head.make_cache()
        self.pending = DeferredRows()
        self.hm = self.logits = None
        self.verified = 0
        self.gap = False

    def suspend(self):
        """Stop the upkeep: accepted rows are kept (the last
        ``RESUME_ROWS``), not run, and nothing is judged."""
        self.suspended = True

    def resume(self):
        """Upkeep again: the kept rows run at the next draft (after an
        empty window if rows were dropped)."""
        self.suspended = False

    def restart(self):
        """An empty window for the rows after a gap (this head's own cache;
        a batch empties its row of the cache it holds)."""
        self.cache = self.head.make_cache()
        self.verified, self.gap = 0, False

    def prefill(self, tokens: mx.array, hidden: mx.array):
        """A prompt's rows: tokens [n] (x_1..x_{N-1}) with hidden [n, H]
        (h_0..h_{N-2}), evaluated now (the head's prefill is prompt
        processing, not the first verify pass's work). The last rows are
        judged against the target's own greedy choice there (lm_head of its
        hidden state), so ``auto`` knows how the head fares from the first
        pass on."""
        n = tokens.size
        bounds = self._chunks(n, hidden.dtype)
        for start, stop in zip(bounds, bounds[1:]):
            read = JUDGED_PROMPT_ROWS if stop == n else 1  # rows whose hm is read
            hm = self.run(tokens[start:stop], hidden[start:stop], None, read)
            mx.eval([c.state for c in self.cache], self.logits)
        last = min(JUDGED_PROMPT_ROWS, stop - start)
        if last > 1:  # one row is followed by no row to judge it against
            greedy = self.head.logits(hidden[stop - last + 1 : stop][None])
            self.judge.judge(hm[:, -last:], mx.argmax(greedy, axis=-1)[0])

    def run(
        self,
        tokens: mx.array,
        hidden: mx.array,
        starts: Optional[Sequence[bool]] = None,
        outputs: int = 1,
    ) -> mx.array:
        """Append verified rows (tokens: [L]; hidden: [L, H]); keeps the last.
        ``starts`` [L] (accepted rows): whether each token began a pass, the
        rows' first drafts judged against those. Returns hm [1, m, H] of the
        last ``outputs`` rows (all if judged; the rest only write keys and
        values)."""
        wanted = None if self.judge.reads_every_row(starts) else outputs
        hm = self.head.head_hidden(tokens[None], hidden[None], self.cache, wanted)
        self.hm = hm[:, -1:]
        self.logits = self.head.logits(self.hm)[0, 0]
        self.verified += tokens.size
        if starts is not None:
            self.judge.judge(hm, tokens[1:], starts[1:])
        return hm

    def add(self, tokens: mx.array, hidden: mx.array):
        """One pass's accepted rows (tokens [n], hidden [n, H]), deferred."""
        self.pending.add(tokens, hidden)
        if self.suspended:
            dropped = self.pending.keep_last(RESUME_ROWS)
            self.dropped += dropped
            self.gap = self.gap or dropped > 0
        elif self.pending.rows >= self.pending_limit:
            self.run_pending()  # bounds the hidden states held

    def run_pending(self):
        """Run the head over the deferred rows in one batched forward."""
        # Each pending entry is one pass's tokens: its first began the pass.
        starts = self.pending.starts()
        rows = self.take_pending()
        if rows is None:
            return
        if self.gap:
            self.restart()
        tokens, hidden = rows
        bounds = self._chunks(tokens.size, hidden.dtype)
        for start, stop in zip(bounds, bounds[1:]):
            self.run(tokens[start:stop], hidden[start:stop], starts[start:stop])
            if len(bounds) > 2:  # a prompt's rows (a chat turn): evaluate as we go
                mx.eval([c.state for c in self.cache], self.logits)

    def catch_up(self):
        """Run and evaluate the deferred rows."""
        self.run_pending()
        mx.eval(self.logits, [c.state for c in self.cache])

    @property
    def offset(self) -> int:
        """Rows in the cache (after catching up on deferred rows)."""
        self.run_pending()
        return self.cache[0].offset

    def next_logits(self) -> Optional[mx.array]:
        """The logits [V] for d_1 of the next draft (None: no row yet)."""
        self.run_pending()
        return self.logits

    def can_draft(self) -> bool:
        """Whether there is a verified row, run or deferred."""
        return self.logits is not None or bool(self.pending)

    @property
    def head_state(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """(hm [1, 1, H], logits [V]) of the last verified row, where the next
        draft starts; (None, None) before any row."""
        self.run_pending()
        return self.hm, self.logits

    # -- chunks of a long run of rows -----------------------------------------
    def _chunks(self, n: int, dtype) -> List[int]:
        """The bounds of the chunks ``n`` new rows run in (see
        :meth:`seen_chunks`); the rows before the first are written as
        zeros (no later row attends to them)."""
        bounds = self.seen_chunks(n)
        if bounds[0]:
            self.head.blank_rows(self.cache, bounds[0], dtype)
            self.verified += bounds[0]
        return bounds

    def seen_chunks(self, n: int) -> List[int]:
        """The bounds of the chunks that ``n`` new rows run in (one chunk
        when they fit), the shorter first so that the last one holds the rows
        judged in hindsight; with an attention window, only the rows that a
        row whose output is read attends to.

        Only the last row's output and the judged rows' are read (the rest
        write their keys and values only, see ``MTPHead.head_hidden``). A row
        attends to its last ``window`` positions, and through each layer below
        one window further back, so the last ``JUDGED_PROMPT_ROWS + layers *
        window`` rows run: the cache rows any later row reads, the logits and
        a prompt's judgments are those of running every row (a longer run of
        judged accepted rows judges its first ones on part of their window).
        The rows before them are never attended to again."""
        window = self.head.attention_window
        chunk = PREFILL_CHUNK if window is None else max(window, MIN_WINDOW_CHUNK)
        chunk, first = min(chunk, PREFILL_CHUNK), 0
        if window is not None:
            first = max(n - JUDGED_PROMPT_ROWS - len(self.head.layers) * window, 0)
        return [first] + list(
            range(first + ((n - first) % chunk or chunk), n + 1, chunk)
        )

    # -- deferred rows handed over (a batch, a saved state) ---------------------
    @property
    def pending_rows(self) -> int:
        """Accepted rows not yet run through the head."""
        return self.pending.rows

    def take_pending(self) -> Optional[Rows]:
        """The deferred accepted rows, (tokens [L], hidden [L, H]), for a
        caller that runs the head over them itself and then calls
        :meth:`set_last_row`; None when there are none."""
        if not self.pending:
            return None
        tokens, hidden = zip(*self.pending.take())
        return mx.concatenate(tokens), mx.concatenate(hidden)

    def take_deferred(self) -> List[Rows]:
        """The deferred rows handed over unrun: (tokens [L], hidden [L, H])
        per pass, copied out of the pass outputs they are slices of."""
        rows = self.pending.take()
        at = list(accumulate(t.size for t, _ in rows))[:-1]
        return list(zip(*(mx.split(mx.concatenate(x), at) for x in zip(*rows))))

    def put_deferred(self, rows: List[Rows]):
        self.pending.extend(rows)  # after any deferred now

    def set_last_row(self, hm: mx.array, logits: mx.array, rows: int):
        """``rows`` verified rows were run elsewhere; hm [1, 1, H] and logits
        [V] are the last one's (what :meth:`run` keeps)."""
        self.hm, self.logits = hm, logits
        self.verified += rows

    # -- a saved session --------------------------------------------------------
    @property
    def state(self) -> List[mx.array]:
        """The verified cache rows of each layer (keys, values; float16) and
        the last row's hm; deferred rows run first."""
        self.run_pending()
        if self.gap:  # rows were dropped: the rows kept start a new window
            self.restart()
        if self.hm is None or self.cache[0].offset == 0:
            return []
        rows = []
        for c in self.cache:
            rows += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return rows + [self.hm]

    def check(self, arrays: Sequence[mx.array], deferred: List[Rows]):
        """``ValueError`` unless ``arrays`` (:attr:`state`'s) and ``deferred``
        (:meth:`take_deferred`'s) are rows this head could have saved."""
        H, vocab = self.head.hidden_size, self.head.vocab_size
        for tokens, hidden in deferred:
            if (
                tokens.ndim != 1
                or not mx.issubdtype(tokens.dtype, mx.integer)
                or tuple(hidden.shape) != (tokens.size, H)
            ):
                raise ValueError("the MTP head's deferred rows do not fit it")
            if (
                tokens.size
                and not 0 <= mx.min(tokens).item() <= mx.max(tokens).item() < vocab
            ):
                raise ValueError("the MTP head's deferred rows hold unknown tokens")
        if not arrays:
            return
        *rows, hm = arrays
        if len(rows) != 2 * len(self.head.layers) or tuple(hm.shape) != (1, 1, H):
            raise ValueError("the MTP head's rows do not fit it")
        positions = set()
        for layer, keys, values in zip(self.head.layers, rows[0::2], rows[1::2]):
            attn = layer.self_attn
            heads, dim = attn.num_key_value_heads, attn.head_dim
            if (
                keys.shape != values.shape
                or keys.ndim != 4
                or (keys.shape[0], keys.shape[1], keys.shape[3]) != (1, heads, dim)
                or not mx.issubdtype(keys.dtype, mx.floating)
            ):
                raise ValueError("the MTP head's cache rows do not fit it")
            positions.add(keys.shape[2])
        if len(positions) > 1:
            raise ValueError("the MTP head's layers hold different numbers of rows")

    def restore(self, arrays: Sequence[mx.array]):
        """Rebuild the rows saved by :attr:`state` (after :meth:`reset`)."""
        if not arrays:
            return
        *rows, self.hm = arrays
        for c, keys, values in zip(self.cache, rows[0::2], rows[1::2]):
            c.update_and_fetch(keys, values)
        self.logits = self.head.logits(self.hm)[0, 0]
        self.verified = self.offset
