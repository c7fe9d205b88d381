"""Gated-DeltaNet layers that can be rolled back to any token of a verify pass.

mlx-lm's GDN layers keep only the state after the last token they process, so a
speculative verify pass over ``T`` tokens cannot be undone. The subclasses here
are mlx-lm's layers (``__call__`` is the parent's) except with a
:class:`~mlx_spec.core.state.GDNSlotCache` (mlx-spec's own): then
``_own_forward`` runs, which restates the parent's forward (projections,
causal conv, q/k normalisation, recurrence, gated norm, output projection,
each through the layer's own modules and mlx-lm's functions). In a verify
pass (the cache capturing) it hands the cache the conv input and the
recurrence inputs, so it can restore the state after any prefix of the ``T``
tokens; otherwise (a step, a prompt's prefill) the cache advances as
mlx-lm's would. Its causal conv is ``models/depthwise_conv.py``'s, which
equals the layer's ``Conv1d`` bit for bit where it runs and costs a fraction
of it on a CPU. That restatement is the one piece of mlx-lm's code written
again here; ``tests/models/test_gdn.py`` checks it against the installed mlx-lm
(same output and cache as the parent's forward). A model decoding with
mlx-lm's own caches runs the parent's forward. Rows of a batch padded at the
end (``cache.lengths``, the batch decoder's layout) are masked as mlx-lm
masks them; left-padded caches are refused.

With a cache that sets ``evaluate_early`` (mlx-spec's own; mlx-lm's caches do
not, so mlx-lm decoding the same model object is unchanged), a layer's output
starts evaluating (``mx.async_eval``) as soon as its graph is built: the device
computes the first layers of a pass while the host still builds the rest. A
pass that cannot be queued behind the previous one (a verify pass needs the
last one's accepted tokens) otherwise leaves the device idle for the whole
graph building (1.2-1.9 ms for T = 1..9 on the demo model on a CPU,
``scripts/profile_verify.py``).
"""

import mlx.core as mx
import mlx.nn as nn

from ..mlx_lm_compat import normalize_qk, qwen3_5, qwen3_next
from .depthwise_conv import depthwise_conv


class _VerifyGDNMixin:
    """Verify-pass forward shared by the GDN families; ``_project`` differs."""

    def __call__(self, inputs, mask=None, cache=None):
        if getattr(cache, "capturing", None) is not None:  # mlx-spec's cache
            out = self._own_forward(inputs, mask, cache)
        else:
            out = super().__call__(inputs, mask, cache)
        if getattr(cache, "evaluate_early", False):
            mx.async_eval(out)  # scheduling only: the values are the same
        return out

    def _own_forward(self, inputs: mx.array, mask, cache) -> mx.array:
        # inputs: [B, T, hidden]
        if getattr(self, "sharding_group", None) is not None:
            raise NotImplementedError(
                "Gated-DeltaNet layers sharded over devices (mlx-lm's tensor "
                "parallelism) are not supported; split the model by layers "
                "instead (--pipeline)"
            )
        if cache.left_padding is not None:
            raise NotImplementedError(
                "speculative verify passes over left-padded GDN caches are not "
                "supported (a batch pads its rows at the end: cache.lengths)"
            )
        B, T, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype
            )
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+T, C]
        conv_out = nn.silu(depthwise_conv(self.conv1d, conv_input))
        q, k, v = [
            t.reshape(B, T, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        gdn_inputs = (q, k, v, a, b, self.A_log, self.dt_bias)
        if cache.capturing:
            out = cache.verify_recurrence(conv_input, gdn_inputs, mask)
        else:
            out = cache.step_recurrence(conv_input, gdn_inputs, mask, not self.training)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, T, -1))


class Qwen3NextVerifyGDN(_VerifyGDNMixin, qwen3_next.Qwen3NextGatedDeltaNet):
    def _project(self, inputs):
        B, T, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate(
            [q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1
        )
        return qkv, z, b, a


class Qwen3_5VerifyGDN(_VerifyGDNMixin, qwen3_5.GatedDeltaNet):
    def _project(self, inputs):
        B, T, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return qkv, z, self.in_proj_b(inputs), self.in_proj_a(inputs)


# mlx-lm GDN class -> its verify-capable subclass.
_VERIFY_CLASSES = {
    qwen3_next.Qwen3NextGatedDeltaNet: Qwen3NextVerifyGDN,
    qwen3_5.GatedDeltaNet: Qwen3_5VerifyGDN,
}


def is_verifiable(layer) -> bool:
    """Whether :func:`make_verifiable` can give ``layer`` the verify forward
    (or already did); looks only, changes nothing."""
    return type(layer) in _VERIFY_CLASSES or type(layer) in _VERIFY_CLASSES.values()


def make_verifiable(layer) -> bool:
    """Give a GDN module the verify forward in place; False if it is not GDN.

    Swapping the class keeps every parameter and the layer's plain-decoding
    behaviour; it is idempotent.
    """
    if type(layer) in _VERIFY_CLASSES.values():
        return True
    cls = _VERIFY_CLASSES.get(type(layer))
    if cls is None:
        return False
    layer.__class__ = cls
    return True
