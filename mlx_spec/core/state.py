"""Slot-pooled state manager: roll every layer back to the accepted prefix.

A verify pass runs the target once over ``T = 1 + drafts`` tokens. Afterwards
``commit(n)`` leaves every layer's cache exactly where plain decoding of the
first ``n`` of those tokens would have left it, without a second forward pass:

- attention layers (``KVCache`` and friends) are trimmed;
- Gated-DeltaNet layers restore their conv window and recurrent state from
  what the verify pass captured: the states after each of its ``T`` tokens
  (at most ``max_draft + 1``), held only until ``commit`` picks one, so a
  long generation holds no more than one pass's worth.

Two GDN rollback strategies are implemented (see ``scripts/bench_rollback.py``):
``"store"`` keeps the recurrent state after every verified token and rollback
picks a slot; ``"replay"`` keeps the recurrence inputs and re-runs the accepted
prefix from the pre-verify state (no matmuls).
"""

from typing import Any, List, NamedTuple, Optional, Sequence

import mlx.core as mx

from ..kernels.gated_delta import gated_delta_steps
from ..mlx_lm_compat import ArraysCache, gated_delta_update, make_prompt_cache
from ..models.gdn import make_verifiable
from ..models.pipeline import pipeline_group

ROLLBACK_STRATEGIES = ("store", "replay")


def verifiable_gdn_layers(model) -> List[bool]:
    """Per layer of ``model``, whether it is a Gated-DeltaNet layer whose
    cache a :class:`GDNSlotCache` rolls back (the others are attention
    layers, trimmed); one scan for a single sequence's caches and a batch's."""
    verifiable = []
    for layer in model.layers:
        gdn = getattr(layer, "linear_attn", None)
        verifiable.append(gdn is not None and make_verifiable(gdn))
    return verifiable


class RowStates(NamedTuple):
    """A GDN recurrent state after one token of a verify pass.

    ``state``: [len(rows), Hv, Dv, Dk] float32, the state of the batch rows
    ``rows`` (ascending indices); ``rows`` None: every row of the batch (a
    ragged pass leaves out the rows that held fewer tokens)."""

    rows: Optional[List[int]]
    state: mx.array

    @classmethod
    def of(cls, entry) -> "RowStates":
        """The kernel's per-token entry (an array, or a ``(rows, state)``
        pair where some rows had ended) as :class:`RowStates`."""
        if isinstance(entry, tuple):
            return cls(list(entry[0]), entry[1])
        return cls(None, entry)

    def row(self, b: int) -> mx.array:
        """Row ``b``'s state, [1, Hv, Dv, Dk]."""
        i = b if self.rows is None else self.rows.index(b)
        return self.state[i : i + 1]


class GDNSlotCache(ArraysCache):
    """The ``[conv_state, ssm_state]`` cache of one GDN layer, able to roll a
    verify pass back to any of its tokens.

    Outside a verify pass it is an ordinary mlx-lm ``ArraysCache``. During a
    pass it holds references to what rollback needs (the conv input and the
    per-token states, or the recurrence inputs for replay); ``commit`` picks
    the kept prefix and drops them all, so nothing survives from one pass to
    the next: no graph of an earlier pass stays reachable (MLX is lazy, and a
    buffer written into but never read keeps every earlier write alive).
    """

    # The layer starts evaluating its output once built (see models/gdn.py);
    # not on the ranks of a pipeline, whose layers then wait on each other.
    evaluate_early = True

    def __init__(self, max_tokens: int, rollback: str = "store", pipelined=False):
        super().__init__(size=2)
        if pipelined:  # a rank of a pipeline
            self.evaluate_early = False
        self.max_tokens = max_tokens
        self.rollback = rollback
        self.capturing = False
        self.row_lengths = None  # a batch pass's row lengths (host ints), if ragged
        self._pass = None  # (T, conv_input [B, K-1+T, C], pre-pass state, saved)

    @classmethod
    def wrap(cls, cache: ArraysCache, max_tokens: int, rollback: str, pipelined=False):
        new = cls(max_tokens, rollback, pipelined)
        new.cache = list(cache.cache)
        new.left_padding, new.lengths = cache.left_padding, cache.lengths
        return new

    @property
    def rollback_nbytes(self) -> int:
        """Bytes held for rollback now: at most ``max_tokens`` states during a
        verify pass, none between passes."""
        if self._pass is None:
            return 0
        _, conv_input, _, saved = self._pass
        arrays = [conv_input] + [a for a in _flatten(saved) if isinstance(a, mx.array)]
        return sum(a.nbytes for a in arrays)

    def set_row_lengths(self, lengths: Optional[List[int]]):
        """The next pass's rows hold ``lengths[b]`` tokens each, padded at
        the end (None: every row is whole): masked as mlx-lm masks them
        (``lengths``), and the recurrence skips the padding (host ints)."""
        self.lengths = None if lengths is None else mx.array(lengths)
        self.row_lengths = lengths

    def verify_recurrence(self, conv_input: mx.array, gdn_inputs, mask) -> mx.array:
        """Run the verify recurrence and capture what rollback needs.

        conv_input: [B, K-1+T, C]; gdn_inputs: (q, k, v, a, b, A_log, dt_bias)
        as in ``gated_delta_steps``. Returns y: [B, T, Hv, Dv].
        """
        T = gdn_inputs[0].shape[1]
        if T > self.max_tokens:
            raise ValueError(
                f"verify pass of {T} tokens exceeds the rollback slots ({self.max_tokens})"
            )
        pre_state = self[1]
        store = self.rollback == "store"
        y, states = gated_delta_steps(
            *gdn_inputs, pre_state, mask, store, self.row_lengths if store else None
        )
        if store:  # states: T per-token states, slot t = after token t
            saved = [RowStates.of(entry) for entry in states]  # [T]
            final = saved[T - 1].state
            if saved[T - 1].rows is not None:  # no state holds every row: commit
                shape = (conv_input.shape[0],) + final.shape[1:]  # sets each
                final = mx.zeros(shape) if pre_state is None else pre_state
        else:
            final, saved = states, (gdn_inputs, mask)
        self._pass = (T, conv_input, pre_state, saved)
        n_keep = conv_input.shape[1] - T
        self[0] = mx.contiguous(conv_input[:, -n_keep:])
        self[1] = final
        self.advance(T)
        return y

    def step_recurrence(self, conv_input, gdn_inputs, mask, use_kernel=True):
        """Outside a verify pass: what mlx-lm's forward does with its cache
        (keep the conv window, at each row's own end where rows are padded,
        and advance the state through ``gated_delta_update``). Returns y:
        [B, T, Hv, Dv]."""
        T = gdn_inputs[0].shape[1]
        n_keep = conv_input.shape[1] - T
        if self.lengths is not None:
            ends = mx.clip(self.lengths, 0, T)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            self[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            self[0] = mx.contiguous(conv_input[:, -n_keep:])
        y, self[1] = gated_delta_update(
            *gdn_inputs, self[1], mask, use_kernel=use_kernel
        )
        self.advance(T)
        return y

    def commit(self, kept: Sequence[int]):
        """Keep the first ``kept[b]`` tokens of the last verify pass in row
        ``b`` (0 <= kept[b] <= T; 0: the row as before the pass)."""
        self.capturing = False
        T, conv_input, pre_state, saved = self._pass
        self._pass = None
        n = kept[0]
        if all(k == n for k in kept) and self._whole(saved, n):
            if n < T:  # every row keeps as many: one pick for the batch
                self[0], self[1] = self._rows_after(n, conv_input, pre_state, saved)
            return
        rows = [
            self._rows_after(k, conv_input[b : b + 1], pre_state, saved, b)
            for b, k in enumerate(kept)
        ]
        self[0] = mx.concatenate([conv for conv, _ in rows])
        self[1] = mx.concatenate([state for _, state in rows])

    def _whole(self, saved, n: int) -> bool:
        """Whether every row's state after ``n`` tokens is one array (a
        ragged pass's rows that ended before are not in it)."""
        return self.rollback != "store" or n == 0 or saved[n - 1].rows is None

    def _rows_after(self, n, conv_input, pre_state, saved, row=None):
        """(conv window, recurrent state) after ``n`` tokens, of every row or
        of ``row`` (then shaped as one row)."""
        pick = (lambda a: a) if row is None else (lambda a: a[row : row + 1])
        n_keep = self.cache[0].shape[1]
        conv = mx.contiguous(conv_input[:, n : n + n_keep])
        if n == 0:
            if pre_state is None:
                return conv, mx.zeros_like(pick(self.cache[1]))
            return conv, pick(pre_state)
        if self.rollback == "store":
            entry = saved[n - 1]
            return conv, (entry.state if row is None else entry.row(row))
        inputs, mask = saved
        prefix = [pick(x)[:, :n] for x in inputs[:5]] + list(inputs[5:])
        mask = None if mask is None else pick(mask)[:, :n]
        pre = None if pre_state is None else pick(pre_state)
        _, state = gated_delta_steps(*prefix, pre, mask, keep_states=False)
        return conv, state

    # -- a batch's rows (see ``core.batch``) --------------------------------
    def append_row(self, cache: ArraysCache, rows_before: int):
        """Append one sequence's state as the last of ``rows_before`` rows
        (None arrays: the zero state)."""
        conv, state = cache.cache
        if self.cache[0] is None and conv is None:
            return  # every row still at the zero state
        if self.cache[0] is None:  # rows so far are at the zero state
            self.cache = [
                mx.zeros((rows_before,) + a.shape[1:], a.dtype) for a in (conv, state)
            ]
        new = [
            mx.zeros_like(a[:1]) if t is None else t
            for a, t in zip(self.cache, (conv, state))
        ]
        self.cache = [mx.concatenate([a, n]) for a, n in zip(self.cache, new)]

    def take_row(self, b: int, cache: ArraysCache):
        """Move row ``b`` out into the single-sequence ``cache`` and drop it
        here (a batch still at the zero state leaves ``cache`` as it is)."""
        if self.cache[0] is not None:
            cache.cache = [mx.array(a[b : b + 1]) for a in self.cache]
        self.remove_row(b)

    def remove_row(self, b: int):
        """Drop row ``b`` (the last one leaves the shapes unset again)."""
        if self.cache[0] is not None and self.cache[0].shape[0] == 1:
            self.cache = [None, None]  # empty: the next row sets the shapes
        elif self.cache[0] is not None:
            rows = range(self.cache[0].shape[0])
            keep = mx.array([i for i in rows if i != b], mx.int32)
            self.cache = [a[keep] for a in self.cache]


def _flatten(tree):
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _flatten(item)
    else:
        yield tree


class SpeculativeCache:
    """The target's per-layer caches with ``begin(T)`` / ``commit(n)`` rollback.

    ``caches`` (a prompt cache from ``make_prompt_cache``) is updated in place:
    its GDN entries become :class:`GDNSlotCache` (still ``ArraysCache``).
    Raises ``ValueError`` for a model with caches that cannot be rolled back.
    """

    def __init__(
        self,
        model,
        max_draft: int,
        rollback: str = "store",
        caches: Optional[List[Any]] = None,
    ):
        if rollback not in ROLLBACK_STRATEGIES:
            raise ValueError(
                f"unknown rollback strategy {rollback!r}; use one of {ROLLBACK_STRATEGIES}"
            )
        self.caches = make_prompt_cache(model) if caches is None else caches
        self.gdn: List[GDNSlotCache] = []
        pipelined = pipeline_group(model) is not None
        bad = []
        for i, (gdn, c) in enumerate(zip(verifiable_gdn_layers(model), self.caches)):
            if gdn:
                if not isinstance(c, GDNSlotCache):
                    c = GDNSlotCache.wrap(c, max_draft + 1, rollback, pipelined)
                    self.caches[i] = c
                c.max_tokens, c.rollback = max_draft + 1, rollback
                self.gdn.append(c)
            elif not c.is_trimmable():
                bad.append(f"layer {i}: {type(c).__name__}")
        if bad:
            model_type = getattr(model, "model_type", type(model).__name__)
            raise ValueError(
                f"model type {model_type!r} has caches that cannot be rolled back "
                f"({', '.join(bad)}); speculative decoding supports attention "
                "caches and the Gated-DeltaNet layers of qwen3_next / qwen3_5"
            )
        self._verifying = 0

    @property
    def trimmable(self) -> List[Any]:
        # Recomputed: KV quantization may replace entries of ``caches``.
        return [c for c in self.caches if not isinstance(c, GDNSlotCache)]

    @property
    def offset(self) -> Optional[int]:
        """Tokens in the attention caches (None for a model without any)."""
        return next((c.offset for c in self.trimmable), None)

    def tokens_before(self, position: int) -> float:
        """Tokens a verify pass may add before the attention caches reach
        ``position`` (plain decoding quantizes the KV cache exactly there, so a
        verify pass must not cross it); unlimited once past it."""
        offset = self.offset
        if offset is None or offset >= position:
            return float("inf")
        return position - offset

    @property
    def rollback_nbytes(self) -> int:
        """Bytes the GDN layers hold for rollback (none between passes)."""
        return sum(c.rollback_nbytes for c in self.gdn)

    def begin(self, T: int):
        """Prepare a verify pass over ``T`` tokens (T == 1 needs no capture)."""
        self._verifying = T
        for c in self.gdn:
            c.capturing = T > 1

    def commit(self, n: int):
        """Leave every layer as after plain decoding of the first ``n`` tokens."""
        T, self._verifying = self._verifying, 0
        if not 1 <= n <= T:
            raise ValueError(f"commit({n}) outside 1..{T} for a {T}-token verify")
        for c in self.trimmable:
            if n < T:
                c.trim(T - n)
        if T > 1:
            for c in self.gdn:
                c.commit([n])
