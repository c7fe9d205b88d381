"""Decoder states kept between requests, so that a conversation's next turn
prefills only its new tokens.

Gated-DeltaNet state cannot be trimmed back to a shorter prefix, so a state is
reusable only by a prompt that *extends* its history: the normal multi-turn
and agent pattern (the next request's prompt is the previous prompt, the
reply, and the new message). A state is the whole speculative context: the
target's caches, the MTP head's cache and what the n-gram index is rebuilt
from. Bounded by bytes and by count, least recently used evicted first.
"""

import threading
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

from .snapshot import DecoderState


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StateCache:
    def __init__(
        self,
        max_bytes: int,
        max_entries: int = 10,
        evicted: Optional[Callable[[DecoderState], None]] = None,
    ):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.evicted = evicted
        self._entries: "OrderedDict[Tuple, DecoderState]" = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, drafter: str, prompt: Sequence[int]) -> Optional[DecoderState]:
        """The state with the longest history that ``prompt`` continues, for
        ``drafter``: a strict prefix of it, or all of it when the state's last
        token is still pending (decoding goes on from that token)."""
        prompt = tuple(prompt)
        with self._lock:
            best = None
            for (name, history), state in self._entries.items():
                n = len(history)
                fits = n < len(prompt) or (n == len(prompt) and state.pending)
                if name == drafter and fits and prompt[:n] == history:
                    if best is None or n > len(best[0][1]):
                        best = ((name, history), state)
            if best is None:
                return None
            self._entries.move_to_end(best[0])
            return best[1]

    def insert(self, state: DecoderState):
        """Keep ``state`` (it must not be written to afterwards)."""
        key = (state.drafter, tuple(state.history))
        size = state.nbytes
        with self._lock:
            self._pop(key)
            if size > self.max_bytes or self.max_entries == 0:
                left = [state]
            else:
                left = []
                self._entries[key] = state
                self._nbytes += size
            while (
                len(self._entries) > self.max_entries or self._nbytes > self.max_bytes
            ):
                left.append(self._pop(next(iter(self._entries))))
        if self.evicted is not None:
            for gone in left:  # outside the lock: the disk tier copies it
                self.evicted(gone)

    def _pop(self, key) -> Optional[DecoderState]:
        state = self._entries.pop(key, None)
        if state is not None:
            self._nbytes -= state.nbytes
        return state

    def take_all(self) -> List[DecoderState]:
        """Every kept state, most recently used first; none kept afterwards."""
        with self._lock:
            states = list(reversed(self._entries.values()))
            self._entries.clear()
            self._nbytes = 0
        return states

    def histories(self) -> List[int]:
        """Lengths of the kept histories, least recently used first."""
        with self._lock:
            return [len(h) for _, h in self._entries]
