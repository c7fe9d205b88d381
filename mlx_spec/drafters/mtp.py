"""MTP drafting: the target's own multi-token-prediction head proposes tokens.

Shift-by-one (docs/mtp_head.md): the MTP row at position p combines
``(token_{p+1}, h_p)``, h_p being the target's post-final-norm hidden state of
the token at p. The head's KV cache holds exactly one row per position the
target has verified:

- ``reset``: the target prefilled x_0..x_{N-2} (h_0..h_{N-2}); rows
  ``(x_1, h_0) .. (x_{N-1}, h_{N-2})`` at positions 0..N-2. The last row's
  logits give d_1 (the token after the pending x_{N-1}).
- ``draft(k)``: d_1 comes from the stored logits; step j > 1 runs one row
  ``(d_{j-1}, hm_{j-1})`` (hm: the head's own post-``mtp.norm`` state), so a
  draft of k tokens adds k - 1 draft-time rows.
- ``accept(emitted, hidden)``: trim the draft-time rows, then append the rows
  ``(emitted[i], hidden[i])`` for i = 0..n in one batched forward, from the
  target's fresh hidden states; the last row gives the next d_1.

Rows run in batches (deferred while nothing is drafted). Once asked
(``hindsight``), the drafter judges the d_1 each row would have drafted
against the token the target chose next (a prompt's last rows: its greedy
choice), so ``auto`` learns the head's first-draft acceptance where it does
not draft; only at tokens that began a pass (``OneDraftWalk``: those inside
a drafting pass were reached through accepted drafts, mostly easy ones).
"""

from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .base import MAX_MTP_DRAFT_TOKENS, Drafter, OneDraftWalk, as_list, host_draft
from .deferred import DeferredRows

PREFILL_CHUNK = 2048  # prompt rows per head forward (full attention)
# With an attention window, chunks of the window's size (not below this):
# each chunk then attends to under twice its rows (docs/mtp_head.md).
MIN_WINDOW_CHUNK = 256
PENDING_ROWS = 64  # accepted rows deferred at most before a head forward
JUDGED_PROMPT_ROWS = 64  # a prompt's last rows judged in hindsight


class MTPDrafter(Drafter):
    """Greedy drafting with an :class:`~mlx_spec.models.mtp.MTPHead`.

    ``last_draft_logits`` [m, V]: the head's logits that produced each of the
    m tokens of the last draft (row i -> d_{i+1}), kept for rejection sampling.
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
        self.cache = None
        self.last_draft_logits: Optional[mx.array] = None
        self._logits = None  # [V]: the head's logits for d_1 of the next draft
        self._hm = None  # [1, 1, H]: its post-norm hidden (input of step 2)
        self._draft_rows = 0  # draft-time rows in the cache, trimmed on accept
        self.verified = 0  # rows of verified positions in the cache
        self._pending = DeferredRows()  # accepted rows not yet run
        self.choose = None  # logits, drafted -> (token, q); None: the argmax
        self.draft_probs: Optional[mx.array] = None  # [m, V] q of a sampled draft
        self.pending_limit = PENDING_ROWS  # a batch that runs the rows lifts it
        self._offered = None  # a draft computed by a batch (see offer)
        self._judging = False  # judge first drafts in hindsight (once asked)
        self._judged = []  # [(hits [L] (async), starts [L])] not yet counted
        self._walk = OneDraftWalk()  # what was counted, not yet taken

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

    @property
    def samples(self) -> bool:
        """Whether ``choose`` samples its drafts (greedy ones are judged in
        hindsight)."""
        return self.choose is not None and self.choose.samples

    @property
    def offset(self) -> int:
        """Rows in the head's cache (after catching up on accepted rows)."""
        self._run_pending()
        return self.cache[0].offset

    def _run_pending(self):
        """Run the head over the accepted rows that are still pending, in one
        batched forward. Rows are deferred so that passes without a draft
        (``auto`` choosing k = 0) cost no head forward at all."""
        # Each pending entry is one pass's tokens: its first began the pass.
        starts = self._pending.starts()
        rows = self.take_pending()
        if rows is None:
            return
        tokens, hidden = rows
        bounds = self._chunks(tokens.size, hidden.dtype)
        for start, stop in zip(bounds, bounds[1:]):
            self._rows(tokens[start:stop], hidden[start:stop], starts[start:stop])
            if len(bounds) > 2:  # a prompt's rows (a chat turn): evaluate as we go
                mx.eval([c.state for c in self.cache], self._logits)

    def catch_up(self):
        """Run and evaluate the deferred rows (a ``draft`` timed next times drafting)."""
        self._run_pending()
        mx.eval(self._logits, [c.state for c in self.cache])

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """The source name ``"mtp"``; None before the head has a row."""
        return "mtp" if self.can_draft() else None

    def can_draft(self) -> bool:
        """Whether the head has a verified row, run or deferred (it can draft)."""
        return self._logits is not None or bool(self._pending)

    def next_logits(self) -> Optional[mx.array]:
        """The head's logits [V] for d_1 of the next draft (None: no row yet)."""
        self._run_pending()
        return self._logits

    def _rows(self, tokens: mx.array, hidden: mx.array, starts=None, outputs=1):
        """Append verified rows (tokens: [L]; hidden: [L, H]); keeps the last.
        ``starts`` [L] (accepted rows): whether each token began a pass, the
        rows' first drafts judged against those. hm [1, m, H] of the last
        ``outputs`` rows (all if judged; the rest only write keys and values)."""
        judged = starts is not None and self._judging and any(starts[1:])
        wanted = None if judged and not self.samples else outputs
        hm = self.head.head_hidden(tokens[None], hidden[None], self.cache, wanted)
        self._hm = hm[:, -1:]
        self._logits = self.head.logits(self._hm)[0, 0]
        self.verified += tokens.size
        if starts is not None:
            self._judge(hm, tokens[1:], starts[1:])
        return hm

    def _judge(self, hm: mx.array, chosen: mx.array, starts=None):
        """Judge the d_1 of rows 0..L-2 against ``chosen`` [L-1], the token
        the target chose after each (row i's d_1 meets row i + 1's token),
        where ``starts`` [L-1] (None: everywhere) says it began a pass.
        hm: [1, L, H] of consecutive rows. Greedy drafts only (a sampled
        draft is judged when it is verified); under logits processors the
        raw argmax stands for the processed one, an estimate for ``auto``."""
        if not self._judging or self.samples or chosen.size == 0:
            return
        if starts is not None and not any(starts):
            return  # a drafting pass's own tokens: nothing began a pass
        guesses = mx.argmax(self.head.logits(hm[:, :-1]), axis=-1)[0]  # [L-1]
        hits = guesses == chosen
        mx.async_eval(hits)  # the rows run now, not at the next draft
        self._judged.append((hits, starts))
        if len(self._judged) > 16:  # nobody asks: keep counts, not arrays
            self._count_judged()

    def _count_judged(self):
        """Walk the rows judged so far (a batch's last row, unjudged, parts them)."""
        for hits, starts in self._judged:
            for i, hit in enumerate(hits.tolist()):
                self._walk.see(hit, starts is None or starts[i])
            self._walk.see(False, start=False)
        self._judged = []

    def hindsight(self) -> Dict[str, Tuple[int, int]]:
        """``{"mtp": (hits, trials)}``: of the rows run since the last call,
        how many would have drafted a first token the target then chose
        (greedy drafts only: a sampled draft is judged when verified). The
        first call turns judging on."""
        self._judging = True
        self._count_judged()
        hits, trials = self._walk.take()
        return {"mtp": (hits, trials)} if trials else {}

    def reset(self, prompt_tokens: Sequence[int], hidden: Optional[mx.array]):
        """prompt_tokens: [N]; hidden: [N-1, H] for x_0..x_{N-2} (None if N == 1)."""
        self.cache = self.head.make_cache()  # its window: head.attention_window
        self._pending, self._judged = DeferredRows(), []
        self._walk = OneDraftWalk()
        self.last_draft_logits = None
        self._logits = self._hm = None
        self._draft_rows = self.verified = 0
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
        tokens = mx.array(list(prompt_tokens[1:]), dtype=mx.uint32)
        bounds = self._chunks(n, hidden.dtype)
        for start, stop in zip(bounds, bounds[1:]):
            read = JUDGED_PROMPT_ROWS if stop == n else 1  # rows whose hm is read
            hm = self._rows(tokens[start:stop], hidden[start:stop], None, read)
            # Every chunk now, the last too: the head's prefill is prompt
            # processing, not the first verify pass's work.
            mx.eval([c.state for c in self.cache], self._logits)
        # The prompt's last rows judged against the target's own greedy
        # choice there (lm_head of its hidden state), so ``auto`` knows how
        # the head fares from the first pass on.
        last = min(JUDGED_PROMPT_ROWS, stop - start)
        if last > 1:  # one row is followed by no row to judge it against
            greedy = self.head.logits(hidden[stop - last + 1 : stop][None])
            self._judge(hm[:, -last:], mx.argmax(greedy, axis=-1)[0])

    def _chunks(self, n: int, dtype) -> List[int]:
        """The bounds of the chunks ``n`` new rows run in (see
        :meth:`_seen_chunks`); the rows before the first are written as
        zeros (no later row attends to them)."""
        bounds = self._seen_chunks(n)
        if bounds[0]:
            self.head.blank_rows(self.cache, bounds[0], dtype)
            self.verified += bounds[0]
        return bounds

    def _seen_chunks(self, n: int) -> List[int]:
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

    def rows_read(self, n: int) -> int:
        """Of ``n`` rows given at once (a prompt), how many (the last ones)
        the head reads the hidden states of."""
        return n - self._seen_chunks(n)[0]

    @property
    def state(self) -> List[mx.array]:
        """Arrays to save with a session: the verified cache rows of each
        layer (keys, values; float16) and the last row's post-norm hidden."""
        self._run_pending()
        if self._hm is None:
            return []
        rows = []
        for c in self.cache:
            rows += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return rows + [self._hm]

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        """Rebuild the state saved by ``state`` (``history`` is not needed)."""
        self.reset([0], None)  # an empty cache, no rows
        if not arrays:
            return
        *rows, self._hm = arrays
        for c, keys, values in zip(self.cache, rows[0::2], rows[1::2]):
            c.update_and_fetch(keys, values)
        self._logits = self.head.logits(self._hm)[0, 0]
        self.verified = self.offset

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` (1..8) greedy tokens after the pending token."""
        return as_list(self, self.draft_tokens(k))

    def draft_tokens(self, k: int) -> mx.array:
        """:meth:`draft` without a host synchronisation: the tokens [k] as a
        lazy array (the verify pass evaluates them with its own outputs;
        also a draft a batch computed), or [0] (nothing to draft)."""
        self.check_draft_length(k)
        if self._draft_rows:
            raise RuntimeError("draft() called twice without accept()")
        if self._offered is not None:
            self.drafted_on_device = True
            return self._take_offer(k)
        self.draft_probs = None
        self._run_pending()
        self.drafted_on_device = self._logits is not None
        if self._logits is None:
            self.last_draft_logits = None
            return host_draft([])
        logits, hm = self._logits, self._hm
        rows, tokens, probs = [], [], []
        for step in range(k):
            if step:
                # Lazy chain: the token feeds the next embedding without a sync.
                hm = self.head.head_hidden(tokens[-1].reshape(1, 1), hm, self.cache)
                logits = self.head.logits(hm)[0, 0]
            rows.append(logits)
            if self.choose is None:
                tokens.append(mx.argmax(logits))
            else:
                token, q = self.choose(logits, tokens)
                tokens.append(token)
                if q is not None:  # a sample: rejection sampling needs q
                    probs.append(q)
        self._draft_rows = k - 1
        self.last_draft_logits = mx.stack(rows)
        if probs:
            self.draft_probs = mx.stack(probs)
        return mx.stack(tokens).astype(mx.uint32)

    def discard_draft(self):
        """Drop the draft-time rows (the caller verifies some other draft)."""
        if self._draft_rows:
            for c in self.cache:
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
        self._pending.add(mx.array(list(emitted), dtype=mx.uint32), hidden)
        if self.pending_rows >= self.pending_limit:
            self._run_pending()  # bounds the hidden states held

    # -- drafting in a batch (mlx_spec.core.batch_mtp runs several heads' rows
    # as one forward; these hand it the row's state and take its results) ----
    @property
    def head_drafter(self) -> "MTPDrafter":
        """The head's drafting part: this drafter (``contract.HeadBased``)."""
        return self

    def needs_head_state(self, k: int) -> bool:
        """Whether ``draft(k)`` looks at the head's state: always."""
        return True

    def drafts_with_head(self, k: int) -> bool:
        """Whether ``draft(k)`` runs the head (no verified row: it drafts nothing)."""
        return self.next_logits() is not None

    @property
    def head_state(self):
        """(hm [1, 1, H], logits [V]) of the last verified row, where the next
        draft starts; (None, None) before any row."""
        self._run_pending()
        return self._hm, self._logits

    @property
    def pending_rows(self) -> int:
        """Accepted rows not yet run through the head."""
        return self._pending.rows

    def take_pending(self):
        """The deferred accepted rows, (tokens [L], hidden [L, H]), for a
        caller that runs the head over them itself and then calls
        :meth:`set_last_row`; None when there are none."""
        if not self._pending:
            return None
        tokens, hidden = zip(*self._pending.take())
        return mx.concatenate(tokens), mx.concatenate(hidden)

    def take_deferred(self) -> List[Tuple[mx.array, mx.array]]:
        """The deferred rows handed over unrun: (tokens [L], hidden [L, H])
        per pass, copied out of the pass outputs they are slices of."""
        rows = self._pending.take()
        at = list(accumulate(t.size for t, _ in rows))[:-1]
        return list(zip(*(mx.split(mx.concatenate(x), at) for x in zip(*rows))))

    def put_deferred(self, rows: List[Tuple[mx.array, mx.array]]):
        self._pending.extend(rows)  # after any deferred now

    def set_last_row(self, hm: mx.array, logits: mx.array, rows: int):
        """``rows`` verified rows were run elsewhere; hm [1, 1, H] and logits
        [V] are the last one's (what ``_rows`` keeps)."""
        self._hm, self._logits = hm, logits
        self.verified += rows

    def offer(self, k: int, tokens: mx.array, logits: mx.array, probs=None):
        """The draft ``draft(k)`` would make, computed elsewhere with its
        draft-time rows already dropped: the next ``draft(k)`` returns it.
        tokens: [k] (lazy); logits: [k, V]; probs: [k, V] when sampled, else None."""
        self._offered = (k, tokens, logits, probs)

    def _take_offer(self, k: int) -> mx.array:
        offered, tokens, self.last_draft_logits, self.draft_probs = self._offered
        self._offered = None
        if offered != k:
            raise RuntimeError(f"a draft of {offered} tokens was offered, {k} asked")
        return tokens
