"""The DFlash training forward: many blocks of one sequence in one forward.

The runtime (``mlx_spec.models.dflash.model``) drafts one block at a time
over a context cache. Training instead takes a whole sequence and ``A``
anchor positions ``a_1..a_A`` in it; block ``j`` is ``[x[a_j], mask x
(B-1)]`` at positions ``a_j .. a_j + B - 1`` and must see exactly what the
runtime block would: the context vectors of positions ``< a_j`` and its own
block (both ways). All blocks of a row share the context keys and values,
so one attention call serves them with a mask::

    keys    = [context positions 0..T-1 | block 1 | ... | block A]
    mask_jq = key < a_j (context)  or  key in block j

The same module (:class:`DFlashDraftModel`) and its own projections, norms
and rotary embedding are used, so the parameters trained are the ones the
runtime loads; :func:`runtime_block_logits` runs the runtime path for the
check that both give the same logits.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.models.dflash.model import DFlashDraftModel


def position_weights(block_size: int, gamma: float) -> mx.array:
    """Loss weight of block position k = 1..B-1: exp(-(k - 1) / gamma)."""
    k = mx.arange(1, block_size, dtype=mx.float32)
    return mx.exp(-(k - 1) / gamma)


def block_tokens(model: DFlashDraftModel, tokens: mx.array, anchors: mx.array):
    """[R, A, B]: each anchor's token followed by B - 1 mask tokens."""
    B = model.config.block_size
    first = mx.take_along_axis(tokens, anchors, axis=1)[..., None]
    masks = mx.full(first.shape[:2] + (B - 1,), model.config.mask_token_id)
    return mx.concatenate([first.astype(masks.dtype), masks], axis=-1)


def training_mask(anchors: mx.array, context_len: int, block_size: int) -> mx.array:
    """[R, 1, A*B, T + A*B] bool: block j's queries see context keys < a_j and
    the keys of block j."""
    R, A = anchors.shape
    q_block = mx.repeat(mx.arange(A), block_size)  # [A*B] block of each query
    q_anchor = mx.repeat(anchors, block_size, axis=1)  # [R, A*B]
    ctx = mx.arange(context_len)[None, None, :] < q_anchor[:, :, None]
    own = q_block[:, None] == q_block[None, :]  # [A*B, A*B]
    own = mx.broadcast_to(own[None], (R,) + own.shape)
    return mx.concatenate([ctx, own], axis=-1)[:, None]


def _attention(attn, h, context, rope, anchors, mask) -> mx.array:
    """One draft layer's attention for every block of every row.

    h: [R, A*B, H] (input-normed block states), context: [R, T, H]."""
    R, AB, _ = h.shape
    A = anchors.shape[1]
    B = AB // A
    ctx_k, ctx_v = attn.keys_values(context, rope, 0)  # [R, kv, T, D]

    def per_block(x, n):  # [R, A*B, n*D] -> [R*A, n, B, D] (rows = blocks)
        return x.reshape(R * A, B, n, attn.head_dim).transpose(0, 2, 1, 3)

    def per_row(x):  # [R*A, n, B, D] -> [R, n, A*B, D]
        n = x.shape[1]
        x = x.reshape(R, A, n, B, attn.head_dim).transpose(0, 2, 1, 3, 4)
        return x.reshape(R, n, AB, attn.head_dim)

    offsets = anchors.reshape(-1)  # block j starts at position a_j
    q = rope(attn.q_norm(per_block(attn.q_proj(h), attn.n_heads)), offset=offsets)
    k = rope(attn.k_norm(per_block(attn.k_proj(h), attn.n_kv_heads)), offset=offsets)
    v = per_block(attn.v_proj(h), attn.n_kv_heads)
    keys = mx.concatenate([ctx_k, per_row(k)], axis=2)
    values = mx.concatenate([ctx_v, per_row(v)], axis=2)
    out = mx.fast.scaled_dot_product_attention(
        per_row(q), keys, values, scale=attn.scale, mask=mask
    )
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(R, AB, -1))


def check_trainable_layout(model: DFlashDraftModel) -> None:
    """This forward covers full, both-ways layers (the demo drafter's layout)."""
    for i in range(model.config.num_hidden_layers):
        if model.config.causal(i) or model.config.window(i) is not None:
            raise ValueError(f"layer {i}: only full, non-causal layers are trained")


def train_logits(
    model: DFlashDraftModel,
    tokens: mx.array,
    features: mx.array,
    anchors: mx.array,
) -> mx.array:
    """Draft logits [R, A, B-1, V] of every anchor's block.

    tokens [R, T'] (T' >= T), features [R, T, n*H] (the target's tapped layer
    outputs of positions 0..T-1), anchors [R, A] with 1 <= a_j <= T: block j's
    context is positions < a_j. Equal to the runtime drafter's
    ``model(model.block(x[a_j]), features[:, :a_j], fresh cache)``."""
    check_trainable_layout(model)
    R, A = anchors.shape
    B = model.config.block_size
    T = features.shape[1]
    context = model.context(features)
    h = model.embed(block_tokens(model, tokens, anchors).reshape(R, A * B))
    mask = training_mask(anchors, T, B)
    for layer in model.layers:
        x = layer.input_layernorm(h)
        h = h + _attention(layer.self_attn, x, context, model._rope, anchors, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = model.norm(h).reshape(R, A, B, -1)[:, :, 1:]
    return model.logits(h)


def labels(tokens: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """[R, A, B-1]: the tokens at a_j + 1 .. a_j + B - 1."""
    idx = anchors[..., None] + mx.arange(1, block_size)
    R = tokens.shape[0]
    return mx.take_along_axis(tokens, idx.reshape(R, -1), axis=1).reshape(idx.shape)


def block_loss(model, tokens, features, anchors, weights, valid):
    """Position-weighted cross-entropy over the blocks (``valid`` [R, A]: 1
    for a real anchor, 0 for padding); also the per-position top-1 hits."""
    logits = train_logits(model, tokens, features, anchors).astype(mx.float32)
    target = labels(tokens, anchors, model.config.block_size)
    ce = nn.losses.cross_entropy(logits, target, reduction="none")  # [R, A, B-1]
    w = weights * valid[..., None]
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-9)
    hits = (mx.argmax(logits, axis=-1) == target) * valid[..., None]
    return loss, hits


def accepted_prefix(hits: mx.array) -> mx.array:
    """[..., B-1] 0/1 hits -> 1 where the first i drafts all hit (cumprod)."""
    return mx.cumprod(hits.astype(mx.float32), axis=-1)


def runtime_block_logits(model: DFlashDraftModel, tokens, features, anchor: int):
    """The runtime's logits [1, B-1, V] for one anchor of row 0: a fresh
    context cache, the context positions < anchor, one block."""
    cache = model.make_cache()
    block = model.block(tokens[:1, anchor])
    return model(block, features[:1, :anchor], cache)


def cosine_lr(peak: float, warmup: int, steps: int, floor: float = 0.1):
    """Linear warmup to ``peak``, then cosine decay to ``floor * peak``."""

    def schedule(step):
        step = step.astype(mx.float32) if isinstance(step, mx.array) else step
        warm = peak * (step + 1) / warmup
        t = mx.clip((step - warmup) / max(1, steps - warmup), 0.0, 1.0)
        cos = floor * peak + (1 - floor) * peak * 0.5 * (1 + mx.cos(math.pi * t))
        return mx.where(step < warmup, warm, cos)

    return schedule
