"""The target caches a decode pass runs on: a batch's rows, or one sequence's own.

The engine (:class:`~mlx_spec.core.batch.BatchDecoder`) runs every pass the
same way: a target forward over ``[B, T]`` tokens, then each row keeps the
first ``kept[b]`` of its ``T`` inputs. What holds the rows differs:

- :class:`BatchCaches`: rows of different sequences side by side (a
  :class:`~mlx_spec.core.ragged_cache.RaggedKVCache` per attention layer, a
  :class:`~mlx_spec.core.state.GDNSlotCache` per GDN layer), which join and
  leave between passes by copying their state in and out;
- :class:`SequenceCaches`: one sequence decoded alone, on its own
  :class:`~mlx_spec.core.state.SpeculativeCache` (mlx-lm's caches, a prompt
  cache the caller passed, KV quantization as mlx-lm applies it), with nothing
  copied in or out.
"""

from typing import List, Optional, Protocol

from ..mlx_lm_compat import maybe_quantize_kv_cache
from .ragged_cache import RaggedKVCache
from .state import GDNSlotCache, SpeculativeCache, verifiable_gdn_layers


class RowCaches(Protocol):
    """What the engine needs of the caches its rows live in."""

    caches: list  # per layer, what the target's forward takes as ``cache``
    gdn: list  # the GDN layers' caches among them
    # Rows of several sequences side by side (their MTP heads run together,
    # and a plain pass rolls back), or one sequence's own caches.
    shared: bool

    def join(self, cache: SpeculativeCache, rows_before: int) -> None:
        """Take one sequence's caches in as the last row."""

    def leave(self, b: int, cache: SpeculativeCache) -> None:
        """Give row ``b``'s state back to ``cache`` and drop the row."""

    def begin(self, lengths: Optional[List[int]], T: int) -> None:
        """A pass over ``T`` positions follows, its rows holding ``lengths[b]``
        tokens each, padded at the end (None: every row holds all ``T``)."""

    def commit(self, kept: List[int], T: int) -> None:
        """Row ``b`` keeps the first ``kept[b]`` of the pass's ``T`` inputs
        (0: as before the pass)."""


class BatchCaches:
    """Rows of several sequences, each at its own offset (see module)."""

    shared = True

    def __init__(self, model, max_draft: int, rollback: str, pipelined: bool):
        self.caches, self.gdn, self.attention = [], [], []
        for gdn in verifiable_gdn_layers(model):
            if gdn:
                c = GDNSlotCache(max_draft + 1, rollback, pipelined=pipelined)
                self.gdn.append(c)
            else:
                c = RaggedKVCache()
                self.attention.append(c)
            self.caches.append(c)

    def join(self, cache: SpeculativeCache, rows_before: int):
        for mine, theirs in zip(self.caches, cache.caches):
            if isinstance(mine, RaggedKVCache):
                mine.append_row(theirs)
            else:
                mine.append_row(theirs, rows_before)

    def leave(self, b: int, cache: SpeculativeCache):
        for mine, theirs in zip(self.caches, cache.caches):
            mine.take_row(b, theirs)

    def begin(self, lengths: Optional[List[int]], T: int):
        for c in self.gdn:
            c.capturing = True
            c.set_row_lengths(lengths)

    def commit(self, kept: List[int], T: int):
        for c in self.attention:
            c.trim_rows([T - k for k in kept])
        for c in self.gdn:
            c.commit(kept)
            c.set_row_lengths(None)


class SequenceCaches:
    """One sequence's own caches, decoded in place: a batch of one whose row
    never moves. ``kv``: (bits, group size, start) of mlx-lm's KV
    quantization, applied after every pass as plain decoding applies it
    after every step."""

    shared = False

    def __init__(self, cache: SpeculativeCache, kv=(None, 64, 0)):
        self.cache, self.kv = cache, kv
        self.caches, self.gdn = cache.caches, cache.gdn
        self.captured = False  # whether the GDN layers capture this pass

    def join(self, cache: SpeculativeCache, rows_before: int):
        if cache is not self.cache:
            raise ValueError("a sequence's own caches hold that sequence only")

    def leave(self, b: int, cache: SpeculativeCache):
        pass  # its caches never left it

    def begin(self, lengths: Optional[List[int]], T: int):
        # A one-token pass runs as a plain decoding step (mlx-lm's recurrence,
        # nothing captured): kept whole, as a sequence alone always keeps it.
        self.captured = T > 1
        for c in self.gdn:
            c.capturing = self.captured

    def commit(self, kept: List[int], T: int):
        (k,) = kept
        if not self.captured and k < T:
            # A plain step whose sampler raised: nothing to roll back from,
            # as in mlx-lm, whose caches keep a step that then failed. The
            # sequence's generation ends with that error.
            self.captured = False
            return
        for c in self.cache.trimmable:
            if k < T:
                c.trim(T - k)
        if self.captured:
            for c in self.gdn:
                c.commit(kept)
        self.captured = False
        kv_bits, group_size, start = self.kv
        maybe_quantize_kv_cache(self.caches, start, group_size, kv_bits)
