"""Route the Qwen3-Next / Qwen3.5 layers of models mlx_spec loaded through
the custom kernels, without copying any of mlx-lm's forward passes and
without touching any other model in the process.

``enable_fast_layers(model)`` swaps, in place and idempotently, the class of
two kinds of module in ``model`` (and in an MTP head attached as
``model.mtp_head``, which lives outside the module tree):

* **Routed experts.** ``Qwen3NextSparseMoeBlock.__call__`` (also Qwen3.5's
  and the MTP head's MoE block) computes ``y = self.switch_mlp(x, inds)``, a
  ``SwitchGLU`` giving each (token, expert) pair's output ``[..., K, H]``,
  then the score-weighted sum itself. Each such ``switch_mlp`` becomes a
  :class:`FastSwitchGLU`, whose ``__call__`` is
  :func:`mlx_spec.kernels.moe.moe_experts`: the expert kernel where the switch
  allows it, otherwise ``SwitchGLU.__call__`` itself.
* **Attention.** ``Qwen3NextAttention.__call__`` (Qwen3.5 and the MTP head
  use the same class) calls the name ``scaled_dot_product_attention``, a
  global of ``mlx_lm.models.qwen3_next``. :class:`FastAttention`'s
  ``__call__`` is that very function (mlx-lm's code object, not a copy)
  bound to a namespace in which the name resolves to the dispatcher
  :func:`scaled_dot_product_attention` below. mlx-lm's module is never
  modified, so every other model keeps mlx-lm's function. Over a batch's
  ragged cache whose rows differ much in length the dispatcher attends each
  row over its own keys, a call per row, instead of every row over the
  longest row's keys, masked (:func:`attend_rows_alone`).

With ``MLX_SPEC_KERNELS=off``, without Metal, or for shapes the kernels do
not take, both run mlx-lm's own code (``SwitchGLU.__call__``, mlx-lm's
attention function) with the same arguments, so results are mlx-lm's bit
for bit. Parameters are kept.
"""

import types
from typing import List

import mlx.core as mx

from ..kernels import switch as kernels
from ..kernels.attention import mtp_attention, verify_attention
from ..kernels.moe import moe_experts
from ..mlx_lm_compat import (
    Qwen3NextAttention,
    Qwen3NextSparseMoeBlock,
    SwitchGLU,
    qwen3_next,
)


class FastSwitchGLU(SwitchGLU):
    """A ``SwitchGLU`` whose call dispatches to the few-token expert kernel.

    Same arguments and result as ``SwitchGLU.__call__`` (the per-pair expert
    outputs, no weighted sum); with kernels off it is that call.
    """

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        # x: [..., H]; indices: [..., K] -> [..., K, H]
        if not kernels.kernels_wanted():
            return super().__call__(x, indices)
        return moe_experts(x, indices, self)


# -- attention ---------------------------------------------------------------

# mlx-lm's attention function, as qwen3_next's attention layer names it.
_mlx_lm_sdpa = qwen3_next.scaled_dot_product_attention
_SDPA_NAME = "scaled_dot_product_attention"


def _is_mtp_cache(cache) -> bool:
    from .mtp.head import MTPKVCache

    return isinstance(cache, MTPKVCache)


def _stored_rows(cache, keys, values):
    """The MTP cache's stored (float16) rows for the keys/values that its
    ``update_and_fetch`` just returned upcast (its last rows: all of them, or
    a window); those when the buffer does not line up. Only the stored rows
    enter the graph then, so MLX never computes the upcast copies."""
    k, v = cache.keys, cache.values
    n = cache.offset
    if (
        k is None
        or v is None
        or n < keys.shape[2]
        or k.shape[:2] != keys.shape[:2]
        or k.shape[3:] != keys.shape[3:]
        or v.shape[:2] != values.shape[:2]
        or v.shape[3:] != values.shape[3:]
    ):
        return keys, values
    start = n - keys.shape[2]
    return k[..., start:n, :], v[..., start:n, :]


def attend_rows_alone(queries, keys, values, counts: List[int], scale: float):
    """Each row's attention over its own first ``counts[b]`` keys, with the
    mask it has decoding alone (none for one query, else causal: query ``t``
    sees the keys up to its own position, never a padded position after
    it). queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D]."""
    mask = None if queries.shape[2] == 1 else "causal"
    return mx.concatenate(
        [
            scaled_dot_product_attention(
                queries[b : b + 1],
                keys[b : b + 1, :, :n],
                values[b : b + 1, :, :n],
                None,
                scale,
                mask,
            )
            for b, n in enumerate(counts)
        ]
    )


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks=None
):
    """The attention function :class:`FastAttention` layers call; same
    arguments and result as mlx-lm's.

    When kernels may run (``MLX_SPEC_KERNELS`` and Metal) and there are no
    attention sinks: over an MTP head's ``MTPKVCache``,
    :func:`mlx_spec.kernels.attention.mtp_attention` on the stored float16 rows;
    over any other unquantised cache (or none),
    :func:`mlx_spec.kernels.attention.verify_attention` (both run the kernel
    only for the shapes it takes, MLX's attention otherwise). Anything else
    (kernels off, no Metal, a quantised cache, sinks): mlx-lm's function.

    queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D] (or a quantised
    cache's tuples). Returns [B, Hq, T, D].

    Over a batch's ragged cache whose rows differ much in length
    (``RaggedKVCache.row_key_counts``), each row attends alone over its own
    keys (same bits as the padded, masked call where the BLAS rounds a row
    alike in any batch: MLX's reference BLAS).
    """
    row_key_counts = getattr(cache, "row_key_counts", None)
    counts = None if row_key_counts is None or sinks is not None else row_key_counts()
    if counts is not None:
        return attend_rows_alone(queries, keys, values, counts, scale)
    if sinks is None and not hasattr(cache, "bits") and kernels.kernels_wanted():
        if _is_mtp_cache(cache):
            keys, values = _stored_rows(cache, keys, values)
            return mtp_attention(queries, keys, values, scale, mask)
        return verify_attention(queries, keys, values, scale, mask)
    return _mlx_lm_sdpa(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def _with_globals(function, **names):
    """``function``'s own code, looking up ``names`` in a private namespace
    (its module's globals plus these) instead of its module."""
    missing = [n for n in names if n not in function.__code__.co_names]
    if missing:
        raise RuntimeError(
            f"{function.__qualname__} no longer calls {', '.join(missing)}: "
            "this mlx-lm version is not supported by mlx_spec's kernel wiring"
        )
    rebound = types.FunctionType(
        function.__code__,
        {**function.__globals__, **names},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    return rebound


class FastAttention(Qwen3NextAttention):
    """mlx-lm's gated attention layer, calling :func:`scaled_dot_product_attention`."""

    __call__ = _with_globals(
        Qwen3NextAttention.__call__, **{_SDPA_NAME: scaled_dot_product_attention}
    )


# -- the model ---------------------------------------------------------------

# mlx-lm class -> the subclass that dispatches to the kernels.
_FAST_CLASSES = {SwitchGLU: FastSwitchGLU, Qwen3NextAttention: FastAttention}


def enable_fast_layers(model) -> int:
    """Hook ``model`` (and an MTP head attached as ``model.mtp_head``) into
    the kernels, in place: every MoE block's ``SwitchGLU`` becomes a
    :class:`FastSwitchGLU` and every ``Qwen3NextAttention`` a
    :class:`FastAttention`. Nothing outside ``model`` changes.

    Idempotent (call it again after attaching an MTP head later); returns how
    many modules were swapped now. With kernels off the model computes
    exactly what it did before.
    """
    trees = [model]
    head = getattr(model, "__dict__", {}).get("mtp_head")  # outside the tree
    if head is not None:
        trees.append(head)
    swapped = 0
    for tree in trees:
        for module in tree.modules():
            if isinstance(module, Qwen3NextSparseMoeBlock):
                module = module.get("switch_mlp")
            elif not isinstance(module, Qwen3NextAttention):
                continue
            fast = _FAST_CLASSES.get(type(module))
            if fast is not None:
                module.__class__ = fast
                swapped += 1
    return swapped
