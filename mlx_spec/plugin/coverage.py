"""Which calls of mlx-lm's ``stream_generate`` and ``generate_step`` the
plugin speculates on.

A call is covered when mlx-spec decodes it exactly as mlx-lm would: greedy
tokens identical, a sampled call's distribution kept, a caller's prompt cache
left as mlx-lm leaves it. Every other call runs mlx-lm's own code, unchanged;
the decision says why, so a user (and a test) can see which path a call took.
"""

from typing import Any, Mapping, NamedTuple, Optional

import mlx.core as mx
import numpy as np

from ..generate import PLAIN_ONLY, SPECULATIVE_ARGUMENTS
from ..mlx_lm_compat import make_prompt_cache
from ..models.gdn import is_verifiable
from ..session import is_integer

# mlx-lm's stream_generate arguments the plugin reads or drops itself:
# ``stream`` (mlx-spec runs on it too) and ``num_draft_tokens`` (a separate
# draft model's, which a covered call has not).
_ROUTED = ("stream", "num_draft_tokens")


class Coverage(NamedTuple):
    """The plugin's decision for one call: ``covered`` (speculate) or not,
    and ``reason``, a short phrase naming what decided it."""

    covered: bool
    reason: str


COVERED = Coverage(True, "covered")


def coverage(
    model, prompt, max_tokens, draft_model, kwargs: Mapping[str, Any]
) -> Coverage:
    """Whether a ``stream_generate(model, tokenizer, prompt, max_tokens,
    draft_model, **kwargs)`` call is speculated on; never raises (a call it
    cannot judge is left to mlx-lm, whose own errors it then gets)."""
    if draft_model is not None:
        return Coverage(False, "draft_model: mlx-lm's own speculative decoding")
    if not is_integer(max_tokens) or max_tokens <= 0:
        return Coverage(False, f"max_tokens={max_tokens!r:.40}")
    unknown = sorted(set(kwargs) - set(SPECULATIVE_ARGUMENTS + PLAIN_ONLY + _ROUTED))
    if unknown:
        return Coverage(False, f"argument {unknown[0]!r:.60}")
    plain = [k for k in PLAIN_ONLY if kwargs.get(k) is not None]
    if plain:
        return Coverage(False, f"argument {plain[0]!r}")
    if not _is_prompt(prompt):
        return Coverage(False, "prompt: not a string or a 1-D sequence of token ids")
    return model_coverage(model, kwargs.get("prompt_cache"))


def step_coverage(model, prompt, max_tokens, kwargs: Mapping[str, Any]) -> Coverage:
    """Whether a ``generate_step(prompt, model, max_tokens=..., **kwargs)``
    call is speculated on: as a ``stream_generate`` call, its prompt an
    ``mx.array`` (mlx-lm's ``generate_step`` slices and indexes it as one:
    anything else is left to mlx-lm, whose own error it then gets). A
    prefill (``max_tokens=0``, as ``cache_prompt`` runs it) is mlx-lm's."""
    if not isinstance(prompt, mx.array):
        return Coverage(False, "prompt: not an mx.array of token ids")
    return coverage(model, prompt, max_tokens, None, kwargs)


def _is_prompt(prompt) -> bool:
    """A non-empty string or 1-D sequence of integer ids (what mlx-spec's
    ``stream_generate`` takes; the vocabulary is checked there)."""
    if isinstance(prompt, str):
        return len(prompt) > 0
    if isinstance(prompt, (mx.array, np.ndarray)):
        kind = prompt.dtype
        integer = (
            mx.issubdtype(kind, mx.integer)
            if isinstance(prompt, mx.array)
            else np.issubdtype(kind, np.integer)
        )
        return integer and prompt.ndim == 1 and prompt.size > 0
    if isinstance(prompt, (list, tuple)):
        return len(prompt) > 0 and all(is_integer(t) for t in prompt)
    return False


def model_coverage(model, prompt_cache: Optional[list] = None) -> Coverage:
    """Whether every layer of ``model`` can be rolled back after a rejected
    draft: an attention layer whose cache trims, or a Gated-DeltaNet layer
    mlx-spec verifies. ``prompt_cache``: the caller's caches, judged too."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return Coverage(False, f"model {type(model).__name__}: no layers")
    kind = getattr(model, "model_type", type(model).__name__)
    try:
        caches = make_prompt_cache(model) if prompt_cache is None else prompt_cache
        layers = list(layers)
    except Exception as error:  # a model mlx-lm's cache maker does not know
        return Coverage(False, f"model type {kind!r}: {type(error).__name__}")
    if len(caches) != len(layers):
        return Coverage(False, f"model type {kind!r}: one cache per layer expected")
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None and is_verifiable(gdn):
            continue
        trims = getattr(cache, "is_trimmable", None)
        if trims is None or not trims():
            return Coverage(
                False,
                f"model type {kind!r}: layer {i}'s {type(cache).__name__} "
                "cannot be rolled back",
            )
    return COVERED
