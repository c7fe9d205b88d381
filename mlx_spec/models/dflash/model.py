"""The DFlash (version 1) draft model as an MLX module.

One draft (see docs/dflash.md)::

    ctx = hidden_norm(fc(concat(target layer outputs at target_layer_ids)))
    h   = target.embed_tokens([last token, mask, ..., mask]) * embedding scale
    for each layer:                 # Qwen3 style, pre-norm, residuals
        keys/values = k/v_proj(ctx) (kept in the layer's ContextCache)
                      + k/v_proj(input_layernorm(h)) (the block: never kept)
        h = h + o_proj(attention(q_proj(input_layernorm(h)), keys, values))
        h = h + mlp(post_attention_layernorm(h))
    logits = target.lm_head(norm(h)[:, 1:])   # block positions 1..B-1

Queries and keys are RMS-normed per head and rotated: context positions at
their own numbers, the block at the numbers that follow the context. The
context vectors enter every layer's attention as they are (no layer norm):
they are the target's, projected once.

The target's ``embed_tokens`` and output head are looked up on the target at
every call through a weak reference (held outside the module tree), so they
are never the drafter's parameters, never copied, and a later quantisation of
the target is picked up.
"""

import weakref
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from ...errors import InputError, one_line
from ...mlx_lm_compat import initialize_rope
from .config import DFlashConfig, TargetDims
from .context_cache import ContextCache


def text_model(model):
    """The module holding the target's backbone (``model``), ``args`` and
    ``lm_head``: the text model of a multimodal checkpoint."""
    return getattr(model, "language_model", model)


def target_dims(model) -> TargetDims:
    """The dimensions a drafter must agree with in ``model``."""
    args = text_model(model).args
    return TargetDims(
        hidden_size=int(args.hidden_size),
        vocab_size=int(args.vocab_size),
        num_layers=int(args.num_hidden_layers),
    )


def make_rope(config: DFlashConfig) -> nn.Module:
    """The rotary embedding of every draft layer (the whole head dimension)."""
    try:
        return initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(
            f"drafter config.json: rope_parameters={config.rope_scaling!r} cannot "
            f"be used ({one_line(e)})"
        ) from None


def block_mask(
    L: int, start: int, offset: int, causal: bool, window: Optional[int]
) -> Optional[mx.array]:
    """[L, (offset - start) + L] (bool, True: attended): block position i (at
    ``offset + i``) against the kept context ``start .. offset - 1`` and the
    block; None when every query sees every key.

    The window limits the context only: inside the block a query sees every
    block position (or those up to its own when causal), as z-lab's reference
    implementation does (the block is never longer than a window in practice).
    """
    if not causal and window is None:
        return None
    query = offset + mx.arange(L)[:, None]
    key = mx.concatenate([mx.arange(start, offset), offset + mx.arange(L)])[None]
    in_block = key >= offset
    if window is None:
        context = ~in_block
    else:
        context = ~in_block & (query - key < window)
    block = in_block & (key <= query) if causal else in_block
    return context | block


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer: int):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = D
        self.scale = D**-0.5
        self.causal = config.causal(layer)
        self.window = config.window(layer)
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = nn.RMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(D, eps=config.rms_norm_eps)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim)

    def keys_values(self, x: mx.array, rope, offset: int):
        """Keys (normed, rotated from position ``offset``) and values
        ``[B, kv_heads, L, head_dim]`` of ``x`` [B, L, hidden]."""
        keys = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
        values = self._heads(self.v_proj(x), self.n_kv_heads)
        keys = rope(keys.transpose(0, 2, 1, 3), offset=offset)
        return keys, values.transpose(0, 2, 1, 3)

    def __call__(
        self, x: mx.array, context: Optional[mx.array], rope, cache: ContextCache
    ) -> mx.array:
        B, L, _ = x.shape
        if context is not None and context.shape[1]:
            cache.append(*self.keys_values(context, rope, cache.offset))
        queries = self.q_norm(self._heads(self.q_proj(x), self.n_heads))
        queries = rope(queries.transpose(0, 2, 1, 3), offset=cache.offset)
        keys, values = self.keys_values(x, rope, cache.offset)
        kept_keys, kept_values = cache.fetch()
        if kept_keys is not None:
            keys = mx.concatenate([kept_keys, keys], axis=2)
            values = mx.concatenate([kept_values, values], axis=2)
        mask = block_mask(L, cache.start, cache.offset, self.causal, self.window)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DFlashAttention(config, layer)
        self.mlp = DFlashMLP(H, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)

    def __call__(self, x, context, rope, cache: ContextCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context, rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """A ``DFlashDraftModel`` checkpoint's module tree (parameter paths are the
    checkpoint's tensor names). Computes nothing until :meth:`bind` links it
    to the target whose embedding and output head it uses."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        if config.target_layer_ids is None:
            raise ValueError("fit the config to its target first (fit_to_target)")
        H = config.hidden_size
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self._rope = make_rope(config)
        self._target = None

    # -- the shared target modules ------------------------------------------

    def bind(self, target) -> "DFlashDraftModel":
        """Share ``target``'s embedding and output head (weakly referenced)."""
        self._target = weakref.ref(target)
        return self

    @property
    def target(self):
        target = None if self._target is None else self._target()
        if target is None:
            raise RuntimeError("the drafter is not bound to a live target (bind)")
        return target

    def embed(self, tokens: mx.array) -> mx.array:
        h = text_model(self.target).model.embed_tokens(tokens)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        return h

    def logits(self, hidden: mx.array) -> mx.array:
        """hidden [B, L, H] (after the final norm) -> [B, L, V] through the
        target's output head, then the config's multiplier and soft cap."""
        lm = text_model(self.target)
        if getattr(lm, "lm_head", None) is not None:
            logits = lm.lm_head(hidden)
        else:  # tied: the embedding is the output head
            logits = lm.model.embed_tokens.as_linear(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = mx.tanh(logits / cap) * cap
        return logits

    # -- forward -------------------------------------------------------------

    def make_cache(self, slack: Optional[int] = None) -> List[ContextCache]:
        """One context cache per layer; ``slack``: how many positions a sliding
        layer can be trimmed back by (default: a block)."""
        slack = self.config.block_size if slack is None else slack
        return [
            ContextCache(window=self.config.window(i), slack=slack)
            for i in range(self.config.num_hidden_layers)
        ]

    def context(self, features: mx.array) -> mx.array:
        """features [B, S, len(target_layer_ids) * H] (the target's layer
        outputs, concatenated in ``target_layer_ids`` order) -> the context
        vectors [B, S, H]."""
        return self.hidden_norm(self.fc(features))

    def extend(self, features: mx.array, cache: List[ContextCache]) -> None:
        """Append the context positions of ``features`` [B, S, n * H] to every
        layer's cache without drafting: a layer's context keys and values
        depend on the context vectors alone, so accepted positions can be
        taken in as they come and the next draft runs the block only."""
        context = self.context(features)
        for layer, layer_cache in zip(self.layers, cache):
            attn = layer.self_attn
            layer_cache.append(
                *attn.keys_values(context, self._rope, layer_cache.offset)
            )

    def hidden_states(
        self,
        block: mx.array,
        features: Optional[mx.array],
        cache: List[ContextCache],
    ) -> mx.array:
        """block [B, L] token ids, features [B, S, n * H] of the ``S`` context
        positions new since the last call (None or S = 0: none) -> the final
        normed states [B, L, H]; the features are appended to ``cache``."""
        context = None if features is None else self.context(features)
        h = self.embed(block)
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, context, self._rope, layer_cache)
        return self.norm(h)

    def __call__(
        self,
        block: mx.array,
        features: Optional[mx.array],
        cache: List[ContextCache],
    ) -> mx.array:
        """The draft logits [B, L - 1, V] of block positions 1..L-1 (see
        :meth:`hidden_states`)."""
        return self.logits(self.hidden_states(block, features, cache)[:, 1:])

    def block(self, last_token: mx.array, length: Optional[int] = None) -> mx.array:
        """The input block [B, length] (default: the config's block size): each
        row's last committed token followed by mask tokens."""
        length = self.config.block_size if length is None else length
        B = last_token.shape[0]
        masks = mx.full((B, length - 1), self.config.mask_token_id, last_token.dtype)
        return mx.concatenate([last_token.reshape(B, 1), masks], axis=1)
