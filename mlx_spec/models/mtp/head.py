"""The MTP (multi-token prediction) head of Qwen3-Next / Qwen3.5 as an MLX module.

One step (see docs/mtp_head.md)::

    e  = target.embed_tokens(t)                          # shared, not copied
    x  = fc(concat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]))
    x  = layer(x)       # gated attention (own KV cache) + MoE or dense SwiGLU
    hm = norm(x)
    logits = target.lm_head(hm)                          # shared, tied or not

The decoder layer is built from mlx-lm's own blocks (``Qwen3NextAttention``,
``Qwen3NextSparseMoeBlock`` / ``SwitchGLU``, ``Qwen3NextMLP``) with the target's
args, so it is exactly the class of the target's full-attention layers. The
norms are plain ``nn.RMSNorm``: the loaders add the ``+1`` of the zero-centred
checkpoint norms once, as mlx-lm does for the backbone.

The target's ``embed_tokens`` and ``lm_head`` are looked up on the target model
at every call (through a weak reference held outside the module tree), so they
are never parameters of the head, never copied, and a later ``nn.quantize`` of
the target is picked up.
"""

import weakref
from typing import Any, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...kernels import switch as kernels
from ...mlx_lm_compat import (
    KVCache,
    Qwen3NextAttention,
    Qwen3NextMLP,
    Qwen3NextSparseMoeBlock,
    create_attention_mask,
)

# Model types whose checkpoints carry an ``mtp.*`` head this module implements.
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def text_model(model):
    """The module holding ``model`` (backbone), ``args`` and ``lm_head``."""
    return getattr(model, "language_model", model)


def text_args(model):
    """The target's text-model args (``ModelArgs`` / ``TextModelArgs``)."""
    return text_model(model).args


def attention_start(offset: int, window: Optional[int]) -> int:
    """The first position that rows written after ``offset`` positions
    attend to, when each attends to its last ``window`` (None: all)."""
    return 0 if window is None else max(0, offset - window + 1)


def window_mask(offsets: List[int], N: int, window: int) -> mx.array:
    """[B, 1, N, L] (bool): query ``t`` of row ``b`` (at position
    ``offsets[b] + t``) sees the positions ``start + j`` within its last
    ``window``, ``start`` being the first any row reaches
    (:func:`attention_start`); L reaches the longest row's last query."""
    start = attention_start(min(offsets), window)
    query = mx.array(offsets)[:, None, None, None] + mx.arange(N)[:, None]
    key = start + mx.arange(max(offsets) + N - start)
    return (key <= query) & (key > query - window)


class MTPKVCache(KVCache):
    """A ``KVCache`` that stores keys/values in ``dtype`` (None: as they come)
    and lets each row attend to its last ``window`` positions (None: all).

    The head's one layer needs one row per verified position; float16 halves
    its memory against float32 heads. ``update_and_fetch`` returns the cached
    rows in the dtype of the incoming keys, so attention runs in the head's
    compute dtype (the rounding of the stored rows is the only change).
    With a ``window`` it returns only the rows the new ones can see and
    :meth:`make_mask` bands the rest out, so a head forward over ``L`` rows
    costs ``L * window`` at any context, and every row sees the same
    positions however the rows are batched. Every row stays stored (rope
    positions, rollback and sessions are unchanged). Rollback is the
    inherited ``trim(n)``.
    """

    def __init__(
        self, dtype: Optional[mx.Dtype] = mx.float16, window: Optional[int] = None
    ):
        super().__init__()
        self.dtype = dtype
        self.window = window

    def update_and_fetch(self, keys, values):
        # keys: [B, kv_heads, L, head_dim] -> the rows they attend to
        start = attention_start(self.offset, self.window)
        dt = keys.dtype
        upcast = self.dtype is not None and self.dtype != dt
        if upcast:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        k, v = super().update_and_fetch(keys, values)
        if start:
            k, v = k[..., start:, :], v[..., start:, :]
        return (k.astype(dt), v.astype(dt)) if upcast else (k, v)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if self.window is None or self.offset + N <= self.window:
            return super().make_mask(
                N, return_array=return_array, window_size=window_size
            )
        if N == 1:
            return None  # the fetched rows are exactly its window
        return window_mask([self.offset], N, self.window)[0]


class MTPDecoderLayer(nn.Module):
    """Pre-norm decoder layer: gated full attention, then MoE or SwiGLU MLP."""

    def __init__(self, args, moe: bool):
        super().__init__()
        self.self_attn = Qwen3NextAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )
        if moe:
            self.mlp = Qwen3NextSparseMoeBlock(args)
        else:
            self.mlp = Qwen3NextMLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        # x: [B, L, H]
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _write_keys_values(layer: MTPDecoderLayer, x: mx.array, cache):
    """Write the keys and values of ``x`` [B, L, H] (the layer's input) to
    ``cache``, as ``layer``'s attention (mlx-lm's ``Qwen3NextAttention``)
    computes them, without its queries, attention or MLP."""
    attn, (B, L, _) = layer.self_attn, x.shape
    x = layer.input_layernorm(x)
    keys = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.num_key_value_heads, -1))
    keys = attn.rope(keys.transpose(0, 2, 1, 3), offset=cache.offset)
    values = attn.v_proj(x).reshape(B, L, attn.num_key_value_heads, -1)
    cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))


class _TargetRef:
    """Weak link to the target model; a plain object, so not in the module tree."""

    def __init__(self, model):
        self._ref = weakref.ref(model)

    def get(self):
        model = self._ref()
        if model is None:
            raise RuntimeError("the target model of this MTP head no longer exists")
        return model


class MTPHead(nn.Module):
    """The MTP head of a Qwen3-Next / Qwen3.5 target.

    Parameters (module paths = the checkpoint's sanitised ``mtp.*`` names
    without the prefix): ``fc``, ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden``, ``norm``, ``layers[0]`` (``MTPDecoderLayer``).
    ``args`` are the target's text-model args. The head computes nothing
    until :meth:`bind` links it to the target whose ``embed_tokens`` /
    ``lm_head`` it uses (not owns).
    """

    def __init__(self, args, model_type: str, moe: Optional[bool] = None):
        super().__init__()
        if moe is None:
            moe = getattr(args, "num_experts", 0) > 0
        H, eps = args.hidden_size, args.rms_norm_eps
        self.model_type = model_type
        self.hidden_size = H
        self.vocab_size = args.vocab_size
        self.moe = moe
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        # Released checkpoints have one MTP layer (reused for every draft step).
        self.layers = [MTPDecoderLayer(args, moe)]
        self.norm = nn.RMSNorm(H, eps=eps)
        self._target = None
        self._window = None

    def bind(self, model) -> "MTPHead":
        """Share ``model``'s embedding and output head (weakly referenced)."""
        self._target = _TargetRef(model)
        return self

    # -- the shared target modules ------------------------------------------

    @property
    def target(self):
        if self._target is None:
            raise RuntimeError("MTPHead is not bound to a target model (call bind)")
        return self._target.get()

    def embed(self, input_ids: mx.array) -> mx.array:
        """input_ids: [B, L] -> [B, L, H] through the target's embedding."""
        return text_model(self.target).model.embed_tokens(input_ids)

    def logits(self, hm: mx.array) -> mx.array:
        """hm: [B, L, H] (the head's post-``mtp.norm`` state) -> [B, L, V]
        through the target's output head."""
        lm = text_model(self.target)
        if getattr(lm.args, "tie_word_embeddings", False):
            return lm.model.embed_tokens.as_linear(hm)
        return lm.lm_head(hm)

    # -- forward -------------------------------------------------------------

    @property
    def attention_window(self) -> Optional[int]:
        """How many positions each row of the head attends to (its last
        ones; None: all). A head trained on short windows drafts better and
        cheaper at long contexts with its training window (the config's
        ``mtp_attention_window``); drafts only, never an output token."""
        return self._window

    @attention_window.setter
    def attention_window(self, window: Optional[int]):
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1
        ):
            raise ValueError(
                f"attention_window must be a positive integer or None, got {window!r}"
            )
        self._window = window

    def make_cache(self) -> List[MTPKVCache]:
        """float16 rows where the attention kernel reads them as stored;
        elsewhere the compute dtype's, since upcasting the whole cache at
        every head step costs more than the memory saves (on the CPU, one
        draft step over 4,096 cached rows: 4.8 ms stored float16, 1.9 ms
        float32; ``scripts/profile_verify.py --head``). Rows attend to
        their last :attr:`attention_window` positions."""
        dtype = mx.float16 if kernels.kernels_wanted() else None
        return [MTPKVCache(dtype, self.attention_window) for _ in self.layers]

    def blank_rows(self, cache: List[MTPKVCache], n: int, dtype: mx.Dtype):
        """Advance each layer's cache by ``n`` rows of zero keys and values:
        positions that no later row attends to (outside every window), kept
        so that the rows after them have their true rope positions."""
        for layer, c in zip(self.layers, cache):
            attn = layer.self_attn
            zeros = mx.zeros((1, attn.num_key_value_heads, n, attn.head_dim), dtype)
            c.update_and_fetch(zeros, zeros)

    def head_hidden(
        self,
        input_ids: mx.array,
        target_hidden: mx.array,
        cache: Optional[List[Any]] = None,
        outputs: Optional[int] = None,
    ) -> mx.array:
        """The head's own post-``mtp.norm`` state ``hm`` (``hidden`` elsewhere
        always means the target's).

        input_ids: [B, L] (token_{p+1}); target_hidden: [B, L, H] (h_p, the
        target's post-final-norm state). RoPE positions start at the cache
        offset. Returns [B, L, H]; with ``outputs`` (and a cache), only the
        last ``outputs`` rows' [B, min(L, outputs), H]: the rows before them
        run the last layer only as far as its keys and values (what later
        rows attend to), not its attention and MLP, whose output nobody reads.
        """
        e = self.embed(input_ids)
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(target_hidden)],
            axis=-1,
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        skip = 0  # rows that write only keys and values (not the last row)
        if outputs is not None and cache[-1] is not None:
            skip = x.shape[1] - max(outputs, 1)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers[:-1], cache[:-1]):
            x = layer(x, mask, c)
        if skip > 0:
            _write_keys_values(self.layers[-1], x[:, :skip], cache[-1])
            x = x[:, skip:]
            mask = create_attention_mask(x, cache[-1])
        return self.norm(self.layers[-1](x, mask, cache[-1]))

    def __call__(
        self,
        input_ids: mx.array,
        target_hidden: mx.array,
        cache: Optional[List[Any]] = None,
    ) -> Tuple[mx.array, mx.array]:
        """Logits [B, L, V] and the head's state hm [B, L, H].

        input_ids: [B, L]; target_hidden: [B, L, H]; see :meth:`head_hidden`.
        """
        hm = self.head_hidden(input_ids, target_hidden, cache)
        return self.logits(hm), hm
