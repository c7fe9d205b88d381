"""A batch pass's per-position layers over only the positions holding tokens.

A batch verify pass computes ``[B, T]`` positions, ``T = 1 +`` the longest
draft, the rows with shorter drafts padded at the end. The sequence mixers
need that layout (attention's per-row caches, the GDN conv and recurrence,
which already skips the padding: ``metal_kernels/gated_delta.py``), but the
decoder layers' MLPs (the MoE blocks, on the Qwen3-Next family most of a
position's cost after the recurrence) and the LM head work on each position
alone. While :meth:`PassRows.ragged` holds a pass's row lengths, they run on
the ``N`` positions holding tokens, gathered into ``[1, N, H]``, and their
outputs are put back in place, zeros at the padding: a row's positions get
what they get padded (each position's result depends on it alone), and the
padding, whose outputs nothing reads, costs nothing there.

Only the model a :class:`~mlx_spec.core.batch.BatchDecoder` runs is changed
(:func:`pack_positions` swaps, in place, the class of each decoder layer's
``mlp`` for a subclass); outside a ragged pass every call is the parent's.
"""

from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import mlx.core as mx


class PassRows:
    """Which positions of the ``[B, T]`` pass being built hold tokens."""

    def __init__(self):
        self.index: Optional[mx.array] = None  # [N] int32 flat positions, or None

    @contextmanager
    def ragged(self, lengths: Optional[List[int]], T: int):
        """While a pass over rows holding ``lengths[b]`` of its ``T``
        positions is built (None: every position holds a token)."""
        if lengths is not None:
            flat = [b * T + t for b, n in enumerate(lengths) for t in range(n)]
            self.index = mx.array(flat, mx.int32)
        try:
            yield
        finally:
            self.index = None

    def apply(self, f: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        """``f(x)`` for x: [B, T, H] -> [B, T, D], computed at the positions
        holding tokens only (zeros at the padding) while a ragged pass is
        built."""
        if self.index is None:
            return f(x)
        B, T, H = x.shape
        y = f(x.reshape(B * T, H)[self.index][None])[0]  # [N, D]
        out = mx.zeros((B * T, y.shape[-1]), y.dtype)
        out[self.index] = y
        return out.reshape(B, T, -1)


class _PackedMLP:
    """An MLP computed at the positions holding tokens (see module); a call
    with more than the hidden states (another model's MLP) is the parent's."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        if args or kwargs or x.ndim != 3:
            return super().__call__(x, *args, **kwargs)
        return self._pass_rows.apply(super().__call__, x)


_PACKED: Dict[type, type] = {}  # an MLP class -> its packed subclass


def pack_positions(model) -> PassRows:
    """Swap each decoder layer's ``mlp`` for its packed subclass, in place
    and idempotently; the model's :class:`PassRows` (one per model)."""
    rows = model.__dict__.get("_mlx_spec_pass_rows")
    if rows is None:
        rows = PassRows()
        object.__setattr__(model, "_mlx_spec_pass_rows", rows)
    for layer in model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or isinstance(mlp, _PackedMLP):
            continue
        cls = type(mlp)
        if cls not in _PACKED:
            _PACKED[cls] = type(f"Packed{cls.__name__}", (_PackedMLP, cls), {})
        mlp.__class__ = _PACKED[cls]
        object.__setattr__(mlp, "_pass_rows", rows)
    return rows
