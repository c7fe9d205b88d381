"""The target model seen by the decode loop: logits and the hidden states
its drafter reads (post-norm, or what a drafter's tap recorded)."""

from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from ..models.packed import PassRows
from .state import SpeculativeCache

# Model types whose ``model.model(...)`` returns the post-final-norm hidden
# state and whose logits are exactly ``lm_head(hidden)`` (no softcap/scale).
_SPLIT_MODEL_TYPES = {
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3",
    "qwen3_moe",
    "qwen2",
    "llama",
}


def _lm_head(model) -> Optional[Callable[[mx.array], mx.array]]:
    owner = getattr(model, "language_model", model)
    if getattr(owner, "lm_head", None) is not None:
        return owner.lm_head
    args = getattr(owner, "args", None)
    if getattr(args, "tie_word_embeddings", False):
        return owner.model.embed_tokens.as_linear
    return None


def feature_tap(model):
    """What a drafter attached to ``model`` to read besides the post-norm
    state (``model.feature_tap``: an object with ``width``, the features a
    position; ``begin()``, record the next forward alone; ``take()``, what
    it recorded, ``[B, T, width]``), or None.

    With a tap, the target's hidden rows are the post-norm state and the
    tap's features side by side (:func:`rows_for` gives each drafter its
    part), taken right after each forward is built, so that they follow
    the forward they belong to even when the engine queues the next pass
    first, and nothing recorded is held past a pass."""
    return getattr(model, "__dict__", {}).get("feature_tap")


def rows_for(model, hidden: Optional[mx.array], features: bool):
    """Of ``hidden`` rows the target handed over, the part a drafter reads:
    the tap's features (``features``) or the post-norm state."""
    tap = feature_tap(model)
    if hidden is None or tap is None:
        return hidden
    split = hidden.shape[-1] - tap.width
    if features:
        return hidden[..., split:]
    return hidden[..., :split] if split else None


def hidden_width(model) -> int:
    """The width of the hidden rows the target hands over for ``model``
    (0: none)."""
    owner = getattr(model, "language_model", model)
    split = getattr(model, "model_type", None) in _SPLIT_MODEL_TYPES
    width = int(owner.args.hidden_size) if split and _lm_head(model) else 0
    tap = feature_tap(model)
    return width + (0 if tap is None else tap.width)


def queue_after(token: mx.array, logprobs: mx.array, start_forward: Callable):
    """Start evaluating a plain pass's ``token`` (and its ``logprobs``), then
    the forward ``start_forward()`` builds over it; that forward's outputs.

    Two evaluations, the token's first, as mlx-lm's ``generate_step`` does:
    MLX signals an evaluation's arrays once all of it is done, so the host,
    waiting for the token, then waits for this pass only while the device
    goes on with the next forward."""
    mx.async_eval(token, logprobs)
    outputs = start_forward()
    mx.async_eval(*(a for a in outputs if a is not None))
    return outputs


def _beside(hidden: Optional[mx.array], tap) -> Optional[mx.array]:
    """The post-norm state and the tap's features of one forward, side by side."""
    if tap is None:
        return hidden
    features = tap.take()
    if hidden is None:
        return features
    return mx.concatenate([hidden, features.astype(hidden.dtype)], axis=-1)


class Target:
    """Runs the target over token blocks on a :class:`SpeculativeCache`.

    ``forward`` returns hidden states (the tensor that feeds ``lm_head``) when
    the model type allows the split, else ``None`` for them; when the model
    carries a :func:`feature_tap`, those and the recorded features side by
    side (the logits are the same either way).
    """

    def __init__(self, model, cache: SpeculativeCache):
        self.model = model
        self.cache = cache
        self.head = None
        if getattr(model, "model_type", None) in _SPLIT_MODEL_TYPES:
            self.head = _lm_head(model)

    def hidden(self, tokens: mx.array) -> Optional[mx.array]:
        """Advance the caches over ``tokens`` [T]; hidden: [T, H] (lazy) or None."""
        tap = self._begin()
        if self.head is None:
            self.model(tokens[None], cache=self.cache.caches)
            hidden = None
        else:
            hidden = self.model.model(tokens[None], cache=self.cache.caches)
        hidden = _beside(hidden, tap)
        return None if hidden is None else hidden[0]

    def _begin(self):
        """The model's feature tap, recording this forward alone (nothing a
        forward outside the decoder may have left on it)."""
        tap = feature_tap(self.model)
        if tap is not None:
            tap.begin()
        return tap

    def forward(self, tokens: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        """tokens: [T] -> (logits [T, V], hidden [T, H] or None)."""
        logits, hidden = self.forward_rows(tokens[None])
        return logits[0], None if hidden is None else hidden[0]

    def forward_rows(
        self, tokens: mx.array, rows: Optional[PassRows] = None
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """tokens: [B, T] -> (logits [B, T, V], hidden [B, T, H] or None);
        ``rows``: the head runs at the positions holding tokens only (zero
        logits at a ragged pass's padding)."""
        tap = self._begin()
        if self.head is None:
            logits, hidden = self.model(tokens, cache=self.cache.caches), None
        else:
            hidden = self.model.model(tokens, cache=self.cache.caches)
            logits = (
                self.head(hidden) if rows is None else rows.apply(self.head, hidden)
            )
        return logits, _beside(hidden, tap)

    def prefill(
        self,
        tokens: mx.array,
        step_size: int,
        progress: Callable[[int], None],
        after_chunk: Callable[[], None],
        keep_hidden: bool = False,
    ) -> Optional[List[mx.array]]:
        """Process ``tokens`` [N] in chunks as mlx-lm does; hidden: a list of
        [n_i, H] per chunk (N rows in all; left lazy: their caller evaluates
        the rows it reads) or None."""
        hidden = []
        done = 0
        while done < tokens.size:
            chunk = tokens[done : done + step_size]
            h = self.hidden(chunk)
            after_chunk()
            if keep_hidden and h is not None:
                hidden.append(h)
            mx.eval([c.state for c in self.cache.caches])
            done += chunk.size
            progress(done)
            mx.clear_cache()
        return hidden or None
