"""The context cache of one DFlash draft layer: the keys and values of the
target's context vectors, position by position.

The drafter's queries are its block, but its keys and values come from two
sources: the committed positions (the target's features, projected once and
kept here, like a KV cache) and the block itself (recomputed every draft, never
kept). The cache only grows by whole context positions and can be trimmed
back by the last ``n`` of them, so that it follows the target's committed
text exactly when a verify pass is rolled back.

A layer with an attention window needs only the last ``window - 1``
positions; the cache drops older ones, but keeps ``slack`` more so that a
trim of up to ``slack`` positions still leaves every position the window
covers (attention masks positions by their absolute number, so what is kept
beyond the window never changes a result).
"""

from typing import Optional, Tuple

import mlx.core as mx

STEP = 256  # positions allocated at a time: appends rarely copy the buffer


class ContextCache:
    """Keys and values ``[B, kv_heads, N, head_dim]`` of the context positions
    ``start .. offset - 1`` of one draft layer."""

    def __init__(self, window: Optional[int] = None, slack: int = 0):
        self.window = window
        self.slack = slack
        self.offset = 0  # context positions seen: the next one's number
        self.start = 0  # the number of the first position kept
        self._keys: Optional[mx.array] = None
        self._values: Optional[mx.array] = None

    @property
    def size(self) -> int:
        """How many positions are kept."""
        return self.offset - self.start

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Keep the keys and values ``[B, kv_heads, S, head_dim]`` of the next
        ``S`` context positions."""
        S = keys.shape[2]
        if S == 0:
            return
        n = self.size
        if self._keys is None or n + S > self._keys.shape[2]:
            self._grow(keys, values, n + S)
        self._keys[..., n : n + S, :] = keys
        self._values[..., n : n + S, :] = values
        self.offset += S
        self._drop_outside_window()

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        B, H, _, D = keys.shape
        capacity = (needed + STEP - 1) // STEP * STEP
        new_keys = mx.zeros((B, H, capacity, D), keys.dtype)
        new_values = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
        if self._keys is not None and self.size:
            new_keys[..., : self.size, :] = self._keys[..., : self.size, :]
            new_values[..., : self.size, :] = self._values[..., : self.size, :]
        self._keys, self._values = new_keys, new_values

    def _drop_outside_window(self) -> None:
        if self.window is None:
            return
        keep = self.window - 1 + self.slack
        # Dropped only once twice the needed positions are held: a copy every
        # `keep` positions rather than one every append.
        if self.size <= 2 * keep:
            return
        drop = self.size - keep
        self._keys = self._keys[..., drop : self.size, :]
        self._values = self._values[..., drop : self.size, :]
        self.start += drop

    def fetch(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """The kept keys and values (None, None when there are none)."""
        if self._keys is None or self.size == 0:
            return None, None
        return self._keys[..., : self.size, :], self._values[..., : self.size, :]

    def trim(self, n: int) -> int:
        """Forget the last ``n`` context positions; returns ``n``.

        Raises ValueError (nothing changed) when that would need positions the
        window dropped, or more positions than were appended.
        """
        if n < 0 or n > self.offset:
            raise ValueError(f"cannot trim {n} of {self.offset} context positions")
        new_offset = self.offset - n
        if self.window is not None and self.start > max(
            0, new_offset - (self.window - 1)
        ):
            raise ValueError(
                f"cannot trim {n} context positions: the window keeps positions "
                f"from {self.start} on and {self.slack} spare"
            )
        self.offset = new_offset
        return n

    @property
    def nbytes(self) -> int:
        """Bytes held (the allocated buffers, not only the kept positions)."""
        if self._keys is None:
            return 0
        return self._keys.nbytes + self._values.nbytes
