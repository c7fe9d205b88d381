"""Route mlx-lm's Qwen3-Next / Qwen3.5 layers through the custom kernels,
without copying any of mlx-lm's forward passes.

``enable_fast_layers(model)`` hooks two calls that mlx-lm's own forwards
make, in place and idempotently:

* **Routed experts.** ``Qwen3NextSparseMoeBlock.__call__`` (also Qwen3.5's
  and the MTP head's MoE block) computes ``y = self.switch_mlp(x, inds)``, a
  ``SwitchGLU`` giving each (token, expert) pair's output ``[..., K, H]``,
  then the score-weighted sum itself. The class of each such ``switch_mlp``
  (in ``model``'s module tree and in an MTP head attached as
  ``model.mtp_head``, which lives outside the tree) becomes
  :class:`FastSwitchGLU`, whose ``__call__`` is
  :func:`metal_kernels.moe.moe_experts`: the expert kernel where the switch
  allows it, otherwise ``SwitchGLU.__call__`` itself. Parameters are kept.
* **Attention.** ``Qwen3NextAttention.__call__`` (Qwen3.5 and the MTP head
  use the same class) calls the module-level name
  ``scaled_dot_product_attention`` of ``mlx_lm.models.qwen3_next`` (imported
  there from ``mlx_lm.models.base``). Because the call goes through that
  module global, not through anything on the layer, rebinding the global is
  the one place to reroute it without forking the layer: the install replaces
  it (once per process) by :func:`scaled_dot_product_attention` below, which
  keeps a reference to the original. It only affects code that looks the name
  up in ``mlx_lm.models.qwen3_next``; ``mlx_lm.models.base`` and every other
  model keep mlx-lm's function.

With ``MLX_SPEC_KERNELS=off``, without Metal, or for shapes the kernels do
not take, both hooks run mlx-lm's own code (``SwitchGLU.__call__``, the
original attention function) with the same arguments, so results are
mlx-lm's bit for bit.
"""

import mlx.core as mx
from mlx_lm.models import base, qwen3_next
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import SwitchGLU

from metal_kernels.attention import mtp_attention, verify_attention
from metal_kernels.moe import moe_experts

from . import kernels


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

# The function the install replaced (mlx-lm's, which the global names now).
_original_sdpa = base.scaled_dot_product_attention


def _is_mtp_cache(cache) -> bool:
    from .mtp.head import MTPKVCache

    return isinstance(cache, MTPKVCache)


def _stored_rows(cache, keys, values):
    """The MTP cache's stored (float16) rows for the keys/values that its
    ``update_and_fetch`` just returned upcast; those when the buffer does
    not line up. Only the stored rows enter the graph then, so MLX never
    computes the upcast copies."""
    k, v = cache.keys, cache.values
    n = cache.offset
    if (
        k is None
        or v is None
        or n != keys.shape[2]
        or k.shape[:2] != keys.shape[:2]
        or k.shape[3:] != keys.shape[3:]
        or v.shape[:2] != values.shape[:2]
        or v.shape[3:] != values.shape[3:]
    ):
        return keys, values
    return k[..., :n, :], v[..., :n, :]


def scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask, sinks=None
):
    """What ``mlx_lm.models.qwen3_next.scaled_dot_product_attention`` is once
    installed; same arguments and result as mlx-lm's function.

    When kernels may run (``MLX_SPEC_KERNELS`` and Metal) and there are no
    attention sinks: over an MTP head's ``MTPKVCache``,
    :func:`metal_kernels.attention.mtp_attention` on the stored float16 rows;
    over any other unquantised cache (or none),
    :func:`metal_kernels.attention.verify_attention` (both run the kernel
    only for the shapes it takes, MLX's attention otherwise). Anything else
    (kernels off, no Metal, a quantised cache, sinks): the original
    function, unchanged.

    queries: [B, Hq, T, D]; keys, values: [B, Hkv, N, D] (or a quantised
    cache's tuples). Returns [B, Hq, T, D].
    """
    if sinks is None and not hasattr(cache, "bits") and kernels.kernels_wanted():
        if _is_mtp_cache(cache):
            keys, values = _stored_rows(cache, keys, values)
            return mtp_attention(queries, keys, values, scale, mask)
        return verify_attention(queries, keys, values, scale, mask)
    return _original_sdpa(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def install_attention() -> bool:
    """Put :func:`scaled_dot_product_attention` in place of
    ``mlx_lm.models.qwen3_next.scaled_dot_product_attention`` (keeping the
    original). Idempotent; True when it installed now."""
    global _original_sdpa
    current = qwen3_next.scaled_dot_product_attention
    if current is scaled_dot_product_attention:
        return False
    # a dispatcher of an earlier import of this module: its original
    _original_sdpa = getattr(current, "mlx_spec_original", current)
    scaled_dot_product_attention.mlx_spec_original = _original_sdpa
    qwen3_next.scaled_dot_product_attention = scaled_dot_product_attention
    return True


# -- the model ---------------------------------------------------------------


def enable_fast_layers(model) -> int:
    """Hook ``model`` (and an MTP head attached as ``model.mtp_head``) into
    the kernels, in place: install the attention dispatcher and swap the
    class of every MoE block's ``SwitchGLU`` to :class:`FastSwitchGLU`.

    Idempotent (call it again after attaching an MTP head later); returns how
    many ``SwitchGLU`` modules were swapped now. With kernels off the model
    computes exactly what it did before.
    """
    install_attention()
    trees = [model]
    head = getattr(model, "__dict__", {}).get("mtp_head")  # outside the tree
    if head is not None:
        trees.append(head)
    swapped = 0
    for tree in trees:
        for module in tree.modules():
            if not isinstance(module, Qwen3NextSparseMoeBlock):
                continue
            experts = module.get("switch_mlp")
            if type(experts) is SwitchGLU:
                experts.__class__ = FastSwitchGLU
                swapped += 1
    return swapped
