"""A decoder's whole state as values: saved with a chat session, or kept in
memory by the server to continue a conversation without prefilling it again.

By default the pending token is processed first, so the target caches hold
every token of the history (what plain decoding's prompt cache would hold).
The server keeps its states with the last token still pending instead: a
state may never be continued, and one that is processes that token with the
next prompt's tokens, in the same forward. So too the drafter's deferred
work (the MTP head's accepted rows not yet run): a state kept in memory
carries it (``Drafter.take_deferred``), to be run when a continuation first
drafts with the head. The drafter contributes its own arrays
(``Drafter.state``) and rebuilds from them with ``Drafter.restore``.
"""

import copy
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional, Tuple

import mlx.core as mx

from ..drafters import calls, make_drafter
from ..mlx_lm_compat import ArraysCache, KVCache, make_prompt_cache
from ..models.mtp.head import text_args
from ..core.state import GDNSlotCache
from ..core.target import hidden_width


@dataclass
class DecoderState:
    history: List[int]
    last_hidden: Optional[mx.array]  # [1, H]: the target's hidden of history[-1]
    caches: List[Any]  # the target's per-layer caches
    drafter: str  # the drafter's name ("none" without one)
    drafter_arrays: List[mx.array]
    pending: int = 0  # last tokens of history not in the caches (0 or 1)
    drafter_deferred: list = field(default_factory=list)  # its work not yet run

    @property
    def nbytes(self) -> int:
        arrays = [a for c in self.caches for a in _arrays(c.state)]
        arrays += [a for a in self.drafter_arrays if a is not None]
        arrays += list(_arrays(self.drafter_deferred))
        if self.last_hidden is not None:
            arrays.append(self.last_hidden)
        return sum(a.nbytes for a in arrays)


def _arrays(tree):
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _arrays(item)


def _share(value):
    """A new handle on the same data: a later write through either handle
    (``a[...] = b`` rebinds only that handle) leaves the other unchanged, and
    nothing is copied until such a write."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_share(v) for v in value)
    return value


def copy_cache(cache):
    """An independent copy of a layer cache, without copying its arrays."""
    new = copy.copy(cache)
    new.__dict__.update({k: _share(v) for k, v in vars(cache).items()})
    return new


def drafter_name(drafter) -> str:
    return "none" if drafter is None else drafter.name


def capture(decoder, copy_caches: bool = False, flush: bool = True) -> DecoderState:
    """The state of ``decoder`` after processing its pending token and its
    drafter's deferred work, or with both still pending (``flush=False``: no
    forward now; at most one token may be pending).

    ``copy_caches``: the state must survive the decoder going on (the
    attention caches are written in place as decoding continues)."""
    decoder.update_drafter()
    if flush:
        decoder.flush()
    elif len(decoder.pending) > 1:
        raise ValueError(
            f"{len(decoder.pending)} tokens are pending; at most one can be kept"
        )
    drafter = decoder.drafter
    deferred = [] if drafter is None or flush else calls.take_deferred(drafter)
    arrays = [] if drafter is None else calls.saved_arrays(drafter)
    if deferred:
        calls.put_deferred(drafter, deferred)  # the decoder may go on
    caches = list(decoder.cache.caches)
    mx.eval([c.state for c in caches], arrays, deferred)
    if copy_caches:
        caches = [copy_cache(c) for c in caches]
    pending = len(decoder.pending)
    return DecoderState(
        list(decoder.history),
        None if pending else decoder.last_hidden,
        caches,
        drafter_name(drafter),
        arrays,
        pending,
        deferred,
    )


Shape = Tuple[int, ...]


@dataclass(frozen=True)
class LayerLayout:
    """What a state's cache of one target layer must look like: an attention
    layer's keys and values ``[1, heads, positions, dim]`` (``shapes`` has
    ``-1`` for the positions), or a recurrent layer's arrays."""

    kind: type  # KVCache or ArraysCache
    shapes: Tuple[Shape, ...]
    dtypes: Tuple[Any, ...]

    def check(self, cache, layer: int):
        if not isinstance(cache, self.kind):
            raise ValueError(
                f"layer {layer} holds a {type(cache).__name__}, the model a "
                f"{self.kind.__name__}"
            )
        arrays = (
            [cache.keys, cache.values] if self.kind is KVCache else list(cache.cache)
        )
        if len(arrays) != len(self.shapes):
            raise ValueError(f"layer {layer} holds {len(arrays)} arrays")
        for a, shape, dtype in zip(arrays, self.shapes, self.dtypes):
            if a is None and shape is None:
                continue
            got = None if a is None else tuple(a.shape)
            if (
                got is None
                or shape is None
                or len(got) != len(shape)
                or any(w not in (-1, g) for g, w in zip(got, shape))
                or a.dtype != dtype
            ):
                what = "nothing" if a is None else f"{got} {a.dtype}"
                raise ValueError(
                    f"layer {layer} holds {what}, the model needs {shape} {dtype}"
                )


def target_layout(model) -> List[LayerLayout]:
    """The layout of ``model``'s layer caches, read from the caches one
    token's forward fills (once per model)."""
    memo = getattr(model, "__dict__", {}).get("_layer_layout")
    if memo is not None:
        return memo
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    layout = []
    for c in caches:
        if isinstance(c, KVCache):
            heads, dim = c.keys.shape[1], c.keys.shape[3]
            shape = (1, heads, -1, dim)
            layout.append(LayerLayout(KVCache, (shape, shape), (c.keys.dtype,) * 2))
        else:
            arrays = list(c.cache)
            layout.append(
                LayerLayout(
                    ArraysCache,
                    tuple(None if a is None else tuple(a.shape) for a in arrays),
                    tuple(None if a is None else a.dtype for a in arrays),
                )
            )
    object.__setattr__(model, "_layer_layout", layout)
    return layout


def check_fits(model, drafter, state: DecoderState):
    """``ValueError`` saying what of ``state`` does not fit ``model`` and
    ``drafter`` (a drafter of the kind it was saved with); nothing is
    changed. What a state file holds is checked here before it is decoded
    from, so that a damaged or foreign state fails its own load, never a
    forward that other requests share."""
    name = drafter_name(drafter)
    if state.drafter != name:
        raise ValueError(f"state saved with draft {state.drafter!r}, not {name!r}")
    layout = target_layout(model)
    if len(state.caches) != len(layout):
        raise ValueError(
            f"state holds {len(state.caches)} layer caches, the model has {len(layout)}"
        )
    for i, (cache, want) in enumerate(zip(state.caches, layout)):
        want.check(cache, i)
    args = text_args(model)
    vocab = getattr(args, "vocab_size", None)
    if vocab is not None and any(not 0 <= t < vocab for t in state.history):
        raise ValueError(f"state holds token ids outside the vocabulary ({vocab})")
    hidden = state.last_hidden
    width = hidden_width(model)  # with a feature tap, its features too
    if hidden is not None and tuple(hidden.shape) != (1, width):
        raise ValueError(f"state holds a hidden state of shape {hidden.shape}")
    if drafter is not None:
        calls.check_state(drafter, state.drafter_arrays, state.drafter_deferred)
    elif state.drafter_arrays or state.drafter_deferred:
        raise ValueError("state holds a drafter's arrays, but no drafter")


def check_loadable(model, state: DecoderState):
    """:func:`check_fits` for a drafter of the kind ``state`` names (a state
    read from a file, before a decoder is made for it)."""
    check_fits(model, make_drafter(state.drafter, model), state)


def shared(state: DecoderState) -> DecoderState:
    """``state`` with its own copies of the attention caches (their arrays
    shared until written): a decoder that restores it and goes on leaves
    ``state`` as it was (a state the server keeps serves every request that
    continues it). Recurrent caches are restored as new lists of their
    arrays, which are replaced, never written: they are kept as they are."""
    caches = [c if isinstance(c, ArraysCache) else copy_cache(c) for c in state.caches]
    return replace(state, caches=caches)


def restore(decoder, state: DecoderState, copy_caches: bool = False):
    """Put ``state`` into ``decoder``, a fresh decoder of the same model and
    drafter kind; ``ValueError`` when they do not fit (``decoder`` then
    unchanged). ``copy_caches``: keep ``state`` usable afterwards (restore
    :func:`shared` of it)."""
    if copy_caches:
        state = shared(state)
    check_fits(decoder.model, decoder.drafter, state)
    target = decoder.cache.caches
    for i, c in enumerate(state.caches):
        if isinstance(target[i], GDNSlotCache):
            target[i].cache = list(c.cache)  # arrays are replaced, never written
        else:
            target[i] = c
    decoder.history = list(state.history)
    decoder.processed = len(decoder.history) - state.pending
    decoder.last_hidden = state.last_hidden
    if decoder.drafter is not None:
        calls.restore(decoder.drafter, decoder.history, state.drafter_arrays)
        calls.put_deferred(decoder.drafter, state.drafter_deferred)
