"""An attention cache for a batch whose rows hold different numbers of tokens.

Used by :class:`~mlx_spec.core.batch.BatchDecoder` for the target's attention
layers and by :class:`~mlx_spec.core.batch_mtp.MTPBatch` for the MTP head's
one layer. Rows join (:meth:`RaggedKVCache.append_row`, from a single
sequence's ``KVCache``) and leave (:meth:`RaggedKVCache.take_row`, back
into one) between passes; a pass writes ``T`` new
positions after every row's own offset, and a row that keeps fewer moves its
offset back (:meth:`RaggedKVCache.trim_rows`).
"""

from typing import List, Optional

import mlx.core as mx

from ..models.mtp.head import attention_start, window_mask


class RaggedKVCache:
    """Row ``b`` occupies positions ``[0, offsets[b])`` of ``[B, H, L, D]``
    buffers; a pass writes each row's ``T`` new positions after its own.

    ``dtype``: the stored dtype (None: the incoming keys'); keys and values
    come back in the incoming dtype, as from the MTP head's float16 cache.
    ``window``: each position attends to its last ``window`` (None: all),
    as in the head's own :class:`~mlx_spec.models.mtp.MTPKVCache`."""

    step = 256
    # A pass attends over every row's keys up to the longest row's, masked;
    # the shorter rows' share of that is waste. Past SPLIT_RATIO times the
    # rows' own keys (and SPLIT_WASTE positions), each row attends over its
    # own keys, in a call of its own (see ``row_key_counts``).
    SPLIT_RATIO = 1.5
    SPLIT_WASTE = 512

    def __init__(self, dtype: Optional[mx.Dtype] = None, window: Optional[int] = None):
        self.keys = self.values = None
        self.offsets: List[int] = []
        self.dtype = dtype
        self.window = window

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets)  # per-row rope positions

    def _buffers(self, rows: int, capacity: int, like: mx.array):
        B, H, _, D = like.shape
        dtype = self.dtype or like.dtype
        return (mx.zeros((rows, H, capacity, D), dtype) for _ in range(2))

    def _reserve(self, length: int, like: mx.array):
        """Room for ``length`` positions in every present row."""
        if self.keys is not None and length <= self.keys.shape[2]:
            return
        cap = (length + self.step - 1) // self.step * self.step
        rows = len(self.offsets) if self.keys is None else self.keys.shape[0]
        keys, values = self._buffers(rows, cap, like)
        if self.keys is not None:
            n = self.keys.shape[2]
            keys[..., :n, :], values[..., :n, :] = self.keys, self.values
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # keys, values: [B, H, T, D] -> the buffers up to the longest row
        T, dt = keys.shape[2], keys.dtype
        start = attention_start(min(self.offsets), self.window)
        end = max(self.offsets) + T
        self._reserve(end, keys)
        if self.dtype is not None:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        if len(set(self.offsets)) == 1:
            o = self.offsets[0]
            self.keys[..., o : o + T, :] = keys
            self.values[..., o : o + T, :] = values
        else:  # one scatter for all rows: row b's T positions after its offset
            at = mx.array(self.offsets)[:, None, None, None] + mx.arange(T)[:, None]
            at = mx.broadcast_to(at, keys.shape)
            self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
            self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.offsets = [o + T for o in self.offsets]
        k, v = self.keys[..., start:end, :], self.values[..., start:end, :]
        if self.dtype is not None:
            k, v = k.astype(dt), v.astype(dt)
        return k, v

    def row_key_counts(self) -> Optional[List[int]]:
        """After :meth:`update_and_fetch`: the keys each row attends to (its
        own, the first ``offsets[b]`` of those fetched) when one attention call
        per row over them costs less than one over every row padded to the
        longest; None when one call does (rows of about one length, or a
        window, whose fetched keys start past some rows' first).

        On the demo model on a CPU (OpenBLAS), one layer over 4 rows of 40 to
        2,119 tokens took 1.19 ms padded and 0.46 ms a call per row (T = 1),
        and over rows of 150 to 380 tokens 0.19 ms padded, 0.23 ms per row
        (``scripts/bench_batch.py --attention``)."""
        if self.window is not None or len(self.offsets) < 2:
            return None
        padded, own = max(self.offsets) * len(self.offsets), sum(self.offsets)
        if padded - own < self.SPLIT_WASTE or padded < self.SPLIT_RATIO * own:
            return None
        return list(self.offsets)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        """[B, 1, N, L]: query t of row b sees positions ``<= offsets[b] + t``
        (rows at the same offset: mlx-lm's own causal mask, as one sequence),
        and with a ``window`` no further back than its last ``window``."""
        same = len(set(self.offsets)) == 1
        if self.window is not None and max(self.offsets) + N > self.window:
            if N == 1 and same:
                return None  # the fetched rows are exactly each row's window
            return window_mask(self.offsets, N, self.window)
        if same and not return_array:
            return "causal" if N > 1 else None
        offsets = mx.array(self.offsets)[:, None, None, None]
        query = mx.arange(N)[None, None, :, None]
        key = mx.arange(max(self.offsets) + N)[None, None, None, :]
        return key <= offsets + query

    def is_trimmable(self) -> bool:
        return True

    def trim_rows(self, counts: List[int]):
        self.offsets = [o - c for o, c in zip(self.offsets, counts)]

    def append_row(self, cache):
        """Append one sequence's ``KVCache`` as the last row."""
        n = cache.offset
        if n == 0 and self.keys is None:
            self.offsets.append(n)
            return  # shapes unknown until a row has tokens
        like = cache.keys if n else self.keys
        self._reserve(max(n, 1), like)  # rows so far (empty ones too) get room
        keys, values = self._buffers(1, self.keys.shape[2], like)
        if n:
            keys[..., :n, :] = cache.keys[..., :n, :]
            values[..., :n, :] = cache.values[..., :n, :]
        self.keys = mx.concatenate([self.keys, keys])
        self.values = mx.concatenate([self.values, values])
        self.offsets.append(n)

    def remove_row(self, b: int):
        self.offsets.pop(b)
        if not self.offsets:
            self.keys = self.values = None
        elif self.keys is not None:
            keep = mx.array([i for i in range(self.keys.shape[0]) if i != b], mx.int32)
            self.keys, self.values = self.keys[keep], self.values[keep]

    def row(self, b: int):
        """Row ``b``'s keys and values [1, H, offset, D] (None: empty)."""
        o = self.offsets[b]
        if self.keys is None or o == 0:
            return None, None
        return self.keys[b : b + 1, :, :o, :], self.values[b : b + 1, :, :o, :]

    def take_row(self, b: int, cache):
        """Move row ``b`` out into the single-sequence ``KVCache`` ``cache``
        (its tokens copied, nothing else kept) and drop it here."""
        keys, values = self.row(b)
        cache.keys = cache.values = None
        if keys is not None:
            cache.keys, cache.values = mx.array(keys), mx.array(values)
        cache.offset = self.offsets[b]
        self.remove_row(b)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
