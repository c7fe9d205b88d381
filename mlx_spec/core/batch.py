"""Batched speculative decoding: the active sequences verified in one target pass.

A :class:`BatchDecoder` holds ``n_slots`` sequence slots, allocated once. A
sequence joins (:meth:`add`) as a prefilled single-sequence
:class:`SpeculativeDecoder` and leaves (:meth:`take`) as one again, between
passes, without touching the others. Each :meth:`step`:

1. every active row drafts with its own drafter and draft length (0 allowed);
2. the target runs once over ``[B, T]`` tokens, ``T = 1 + the longest draft``;
   shorter rows are padded at the end and masked (attention: each row sees
   only its own positions; GDN: padded tokens leave the state unchanged);
3. each row verifies its own draft (greedy, or rejection sampling with its
   own sampler) and commits its own accepted prefix: attention rows move
   their own offsets back, GDN rows take their own per-token state.

So each row's tokens are those it would get decoded alone.
"""

from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional

import mlx.core as mx

from ..models.gdn import make_verifiable
from .decode import SpeculativeDecoder
from .policy import DraftLengthPolicy, verify_cost_profile
from .sampling import make_draft_sampler, make_sampler
from .state import GDNSlotCache
from .target import Target
from .verify import verify_draft


class RaggedKVCache:
    """The attention cache of a batch whose rows hold different numbers of
    tokens: row ``b`` occupies positions ``[0, offsets[b])`` of ``[B, H, L, D]``
    buffers; a pass writes each row's ``T`` new positions after its own."""

    step = 256

    def __init__(self, n_slots: int):
        self.keys = self.values = None
        self.offsets = [0] * n_slots

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets)  # per-row rope positions

    def _reserve(self, length: int, like: mx.array):
        if self.keys is not None and length <= self.keys.shape[2]:
            return
        B, H, _, D = like.shape
        cap = (length + self.step - 1) // self.step * self.step
        keys = mx.zeros((len(self.offsets), H, cap, D), like.dtype)
        values = mx.zeros(
            (len(self.offsets), like.shape[1], cap, like.shape[3]), like.dtype
        )
        if self.keys is not None:
            n = self.keys.shape[2]
            keys[..., :n, :], values[..., :n, :] = self.keys, self.values
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, H, T, D] -> the buffers up to the longest row
        T = keys.shape[2]
        end = max(self.offsets) + T
        self._reserve(end, keys)
        for b, o in enumerate(self.offsets):
            self.keys[b : b + 1, :, o : o + T, :] = keys[b : b + 1]
            self.values[b : b + 1, :, o : o + T, :] = values[b : b + 1]
        self.offsets = [o + T for o in self.offsets]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """[B, 1, N, L]: query t of row b sees positions ``<= offsets[b] + t``."""
        offsets = mx.array(self.offsets)[:, None, None, None]
        query = mx.arange(N)[None, None, :, None]
        key = mx.arange(max(self.offsets) + N)[None, None, None, :]
        return key <= offsets + query

    def is_trimmable(self) -> bool:
        return True

    def trim_rows(self, counts: List[int]):
        self.offsets = [o - c for o, c in zip(self.offsets, counts)]

    def set_row(self, b: int, cache):
        """Put one sequence's ``KVCache`` into slot ``b``."""
        n = cache.offset
        self.offsets[b] = n
        if n == 0:
            return
        keys, values = cache.keys[..., :n, :], cache.values[..., :n, :]
        self._reserve(n, keys)
        self.keys[b : b + 1, :, :n, :] = keys
        self.values[b : b + 1, :, :n, :] = values

    def row(self, b: int):
        o = self.offsets[b]
        return self.keys[b : b + 1, :, :o, :], self.values[b : b + 1, :, :o, :]

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@dataclass
class _Row:
    decoder: SpeculativeDecoder  # its drafter, history and stats; caches live here
    sampler: object
    policy: Optional[DraftLengthPolicy]
    max_draft: int
    remaining: int  # tokens it may still emit
    stop_tokens: Collection[int] = field(default_factory=set)
    done: bool = False


class BatchDecoder:
    """``n_slots`` sequences decoded together, one target pass per step."""

    def __init__(self, model, n_slots: int, max_draft: int, rollback: str = "store"):
        self.model, self.n_slots, self.max_draft = model, n_slots, max_draft
        self.caches, self.gdn, self.attention = [], [], []
        for layer in model.layers:
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None and make_verifiable(gdn):
                c = GDNSlotCache(max_draft + 1, rollback)
                self.gdn.append(c)
            else:
                c = RaggedKVCache(n_slots)
                self.attention.append(c)
            self.caches.append(c)
        self.target = Target(model, self)
        self.rows: List[Optional[_Row]] = [None] * n_slots

    @property
    def active(self) -> List[int]:
        return [b for b, r in enumerate(self.rows) if r is not None and not r.done]

    def free_slots(self) -> List[int]:
        return [b for b, r in enumerate(self.rows) if r is None]

    # -- joining and leaving -------------------------------------------------
    def add(
        self,
        decoder: SpeculativeDecoder,
        max_tokens: int,
        sampler=None,
        num_draft_tokens="auto",
        verify_costs: Optional[List[float]] = None,
        stop_tokens: Collection[int] = (),
    ) -> int:
        """Move ``decoder`` (fed: one pending token) into a free slot."""
        if not decoder.pending:
            raise ValueError("the decoder has no pending token: feed it first")
        free = self.free_slots()
        if not free:
            raise RuntimeError(f"all {self.n_slots} slots are in use")
        b = free[0]
        for mine, theirs in zip(self.caches, decoder.cache.caches):
            if isinstance(mine, RaggedKVCache):
                mine.set_row(b, theirs)
            else:
                self._set_gdn_row(mine, b, theirs)
        sampler = sampler or make_sampler(0.0)
        if decoder.drafter is not None:
            history = list(decoder.history)
            decoder.drafter.set_sampling(make_draft_sampler(sampler, None, history))
        auto = num_draft_tokens == "auto"
        most = self.max_draft if auto else min(num_draft_tokens, self.max_draft)
        policy = None
        if auto:  # costs of one sequence's passes (measured once per model)
            costs = verify_costs or verify_cost_profile(self.model)
            policy = DraftLengthPolicy(costs, self.max_draft)
        self.rows[b] = _Row(
            decoder, sampler, policy, most, max_tokens, set(stop_tokens)
        )
        return b

    def _set_gdn_row(self, mine: GDNSlotCache, b: int, theirs):
        conv, state = theirs.cache  # None: nothing processed, the zero state
        if mine.cache[0] is None:
            if conv is None:
                return  # every row still at the zero state
            mine.cache = [  # the first row with a state sets the shapes
                mx.zeros((self.n_slots,) + conv.shape[1:], conv.dtype),
                mx.zeros((self.n_slots,) + state.shape[1:], state.dtype),
            ]
        for mine_array, theirs_array in zip(mine.cache, (conv, state)):
            row = (
                mx.zeros_like(mine_array[:1]) if theirs_array is None else theirs_array
            )
            mine_array[b : b + 1] = row

    def take(self, b: int) -> SpeculativeDecoder:
        """Free slot ``b``; its sequence leaves as a single-sequence decoder
        whose caches hold exactly what the row decoded."""
        row, self.rows[b] = self.rows[b], None
        decoder = row.decoder
        for mine, theirs in zip(self.caches, decoder.cache.caches):
            if isinstance(mine, RaggedKVCache):
                keys, values = mine.row(b)
                theirs.keys, theirs.values = mx.array(keys), mx.array(values)
                theirs.offset = keys.shape[2]
            elif mine.cache[0] is not None:
                theirs.cache = [mx.array(a[b : b + 1]) for a in mine.cache]
        return decoder

    # -- one pass ------------------------------------------------------------
    def step(self) -> Dict[int, List[int]]:
        """One verify pass over the active rows; the tokens each emitted."""
        active = self.active
        if not active:
            return {}
        drafts = {b: self._draft(self.rows[b]) for b in active}
        T = 1 + max(len(d) for d in drafts.values())
        tokens, lengths = [[0] * T for _ in range(self.n_slots)], [0] * self.n_slots
        for b in active:
            seq = self.rows[b].decoder.history[-1:] + drafts[b]
            tokens[b][: len(seq)], lengths[b] = seq, len(seq)
        for c in self.gdn:
            c.capturing, c.lengths = True, mx.array(lengths)
        logits, hidden = self.target.forward_rows(mx.array(tokens))  # [B, T, V]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kept, out = [0] * self.n_slots, {}
        for b in active:
            row, draft = self.rows[b], drafts[b]
            q = row.decoder.drafter.draft_probs if draft else None
            n, token = verify_draft(draft, logprobs[b, : lengths[b]], row.sampler, q)
            emitted = self._finish(row, draft[:n] + [token])
            j = len(emitted)
            kept[b] = j + (row.done and j <= n)
            out[b] = emitted
            self._record(row, draft, n, emitted, kept[b], hidden, b)
        for c in self.attention:
            c.trim_rows([T - k for k in kept])
        for c in self.gdn:
            c.commit(kept)
            c.lengths = None
        return out

    def _draft(self, row: _Row) -> List[int]:
        d = row.decoder
        room = min(row.max_draft, row.remaining - 1)
        k = row.policy.choose(room) if row.policy else room
        if k <= 0 or d.drafter is None:
            d.drafted = 0
            return []
        d.drafter.catch_up()
        draft = d.drafter.draft(k)
        d.drafted = len(draft)
        return draft

    def _finish(self, row: _Row, emitted: List[int]) -> List[int]:
        stop = next((i for i, t in enumerate(emitted) if t in row.stop_tokens), None)
        if stop is not None:
            emitted, row.done = emitted[: stop + 1], True
        if len(emitted) >= row.remaining:
            emitted, row.done = emitted[: row.remaining], True
        row.remaining -= len(emitted)
        return emitted

    def _record(self, row, draft, n, emitted, kept, hidden, b):
        d, j = row.decoder, len(emitted)
        if row.policy:
            row.policy.update(len(draft), n, 0.0)
        d.stats.record(len(draft), min(n, j), j)
        h = None if hidden is None else hidden[b]
        if d.drafter is not None:
            d.drafter.accept(emitted, None if h is None else h[:j])
        d.history += emitted
        d.processed = len(d.history) - (kept == j)
        if kept > j and h is not None:
            d.last_hidden = h[kept - 1 : kept]
