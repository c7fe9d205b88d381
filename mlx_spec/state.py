"""Slot-pooled state manager: roll every layer back to the accepted prefix.

A verify pass runs the target once over ``T = 1 + drafts`` tokens. Afterwards
``commit(n)`` leaves every layer's cache exactly where plain decoding of the
first ``n`` of those tokens would have left it, without a second forward pass:

- attention layers (``KVCache`` and friends) are trimmed;
- Gated-DeltaNet layers restore their conv window and recurrent state from a
  slot pool that the verify pass filled. The pool is allocated once, on the
  first verify pass, with ``max_draft + 1`` slots, and reused every step.

Two GDN rollback strategies are implemented (see ``scripts/bench_rollback.py``):
``"store"`` keeps the recurrent state after every verified token and rollback
picks a slot; ``"replay"`` keeps the recurrence inputs and re-runs the accepted
prefix from the pre-verify state (no matmuls).
"""

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from metal_kernels.gated_delta import gated_delta_steps

from .gdn import make_verifiable

ROLLBACK_STRATEGIES = ("store", "replay")


class GDNSlotCache(ArraysCache):
    """The ``[conv_state, ssm_state]`` cache of one GDN layer, plus a slot pool.

    Outside a verify pass it is an ordinary mlx-lm ``ArraysCache``.
    """

    def __init__(self, max_tokens: int, rollback: str = "store"):
        super().__init__(size=2)
        self.max_tokens = max_tokens
        self.rollback = rollback
        self.capturing = False
        self.conv_pool = None  # [B, K-1+max_tokens, C]: conv input of a verify
        self.state_pool = None  # store: [max_tokens, B, Hv, Dv, Dk] float32
        self._verified = 0
        self._replay = None  # replay: (pre-verify state, inputs, mask)

    @classmethod
    def wrap(cls, cache: ArraysCache, max_tokens: int, rollback: str):
        new = cls(max_tokens, rollback)
        new.cache = list(cache.cache)
        new.left_padding, new.lengths = cache.left_padding, cache.lengths
        return new

    @property
    def pool_nbytes(self) -> int:
        pools = (self.conv_pool, self.state_pool)
        return sum(p.nbytes for p in pools if p is not None)

    def verify_recurrence(self, conv_input: mx.array, gdn_inputs, mask) -> mx.array:
        """Run the verify recurrence and capture what rollback needs.

        conv_input: [B, K-1+T, C]; gdn_inputs: (q, k, v, a, b, A_log, dt_bias)
        as in ``gated_delta_steps``. Returns y: [B, T, Hv, Dv].
        """
        T = gdn_inputs[0].shape[1]
        if T > self.max_tokens:
            raise ValueError(
                f"verify pass of {T} tokens exceeds the slot pool ({self.max_tokens})"
            )
        n_keep = conv_input.shape[1] - T
        if self.conv_pool is None:
            B, _, C = conv_input.shape
            self.conv_pool = mx.zeros(
                (B, n_keep + self.max_tokens, C), conv_input.dtype
            )
        self.conv_pool[:, : n_keep + T] = conv_input

        pre_state = self[1]
        store = self.rollback == "store"
        y, states = gated_delta_steps(
            *gdn_inputs, pre_state, mask, keep_states=store, n_slots=self.max_tokens
        )
        if store and isinstance(states, mx.array):
            # the Metal kernel wrote the states in the pool layout
            # [max_tokens, B, Hv, Dv, Dk] (slots >= T unused until rewritten)
            self.state_pool = states
            final = states[T - 1]
        elif store:
            if self.state_pool is None:
                shape = (self.max_tokens,) + states[0].shape
                self.state_pool = mx.zeros(shape, states[0].dtype)
            for t, s in enumerate(states):
                self.state_pool[t] = s
            final = states[-1]
        else:
            self._replay = (pre_state, gdn_inputs, mask)
            final = states
        self[0] = mx.contiguous(conv_input[:, -n_keep:])
        self[1] = final
        self.advance(T)
        self._verified = T
        return y

    def commit(self, n: int):
        """Keep the first ``n`` tokens of the last verify pass (1 <= n <= T)."""
        self.capturing = False
        T, self._verified = self._verified, 0
        replay, self._replay = self._replay, None
        if n == T:
            return
        n_keep = self.conv_pool.shape[1] - self.max_tokens
        self[0] = self.conv_pool[:, n : n + n_keep]
        if self.rollback == "store":
            self[1] = self.state_pool[n - 1]
        else:
            pre_state, inputs, mask = replay
            prefix = [x[:, :n] for x in inputs[:5]] + list(inputs[5:])
            mask = None if mask is None else mask[:, :n]
            _, self[1] = gated_delta_steps(*prefix, pre_state, mask, keep_states=False)


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
        bad = []
        for i, (layer, c) in enumerate(zip(model.layers, self.caches)):
            gdn = getattr(layer, "linear_attn", None)
            if gdn is not None and make_verifiable(gdn):
                if not isinstance(c, GDNSlotCache):
                    c = self.caches[i] = GDNSlotCache.wrap(c, max_draft + 1, rollback)
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
    def pool_nbytes(self) -> int:
        """Bytes held by the GDN slot pools (constant once allocated)."""
        return sum(c.pool_nbytes for c in self.gdn)

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
                c.commit(n)
