"""Saving and loading a whole speculative session (``--prompt-cache-file``).

The file is an mlx-lm prompt-cache file (``mlx_lm.models.cache.save_prompt_cache``
safetensors layout). Before saving, the pending token is processed, so the
first ``n_target`` entries are exactly the prompt cache plain decoding of the
conversation would have: ``mlx_lm.models.cache.load_prompt_cache`` reads them.
After them come one ``ArraysCache`` holding the token history and the hidden
state of the last token, then the drafter's own state arrays. The metadata
names the model (a fingerprint of its config and weights) and the drafter.
"""

import hashlib
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, load_prompt_cache, save_prompt_cache

from .state import GDNSlotCache

FORMAT = "mlx_spec.session.v1"


def model_fingerprint(model) -> str:
    """A short hash of the model's config and a slice of its embedding."""
    args = getattr(model, "args", None)
    config = json.dumps(
        vars(args) if args is not None else {}, sort_keys=True, default=str
    )
    embed = model.model.embed_tokens
    rows = embed(mx.arange(4))  # works for quantized embeddings too
    digest = hashlib.sha256(config.encode())
    digest.update(str(mx.sum(rows.astype(mx.float32)).item()).encode())
    return digest.hexdigest()[:16]


def _drafter_name(drafter) -> str:
    return (
        "none" if drafter is None else getattr(drafter, "name", type(drafter).__name__)
    )


def _plain(cache):
    """mlx-lm's own class for a cache entry (so mlx-lm can load the file)."""
    if isinstance(cache, GDNSlotCache):
        plain = ArraysCache(len(cache.cache))
        plain.cache = list(cache.cache)
        return plain
    return cache


def save_session(path, decoder, model_name: str = ""):
    """Write ``decoder``'s whole state to ``path`` (safetensors)."""
    decoder.flush()
    drafter = decoder.drafter
    arrays = [] if drafter is None else list(getattr(drafter, "state", []))
    session = ArraysCache(2)
    session.cache = [mx.array(decoder.history, mx.uint32), decoder.last_hidden]
    extra = ArraysCache(max(len(arrays), 1))
    extra.cache = arrays or [None]
    caches = [_plain(c) for c in decoder.cache.caches] + [session, extra]
    meta = {
        "format": FORMAT,
        "model": model_fingerprint(decoder.model),
        "model_name": str(model_name),
        "drafter": _drafter_name(drafter),
        "n_target": str(len(decoder.cache.caches)),
    }
    save_prompt_cache(str(path), caches, meta)


def load_session(path, decoder, model_name: str = ""):
    """Restore a session saved by :func:`save_session` into a fresh ``decoder``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming
    the file for one made for another model or drafter.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt cache file {str(path)!r} does not exist")
    caches, meta = load_prompt_cache(str(path), return_metadata=True)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an mlx_spec session file")
    if meta["model"] != model_fingerprint(decoder.model):
        raise ValueError(
            f"{str(path)!r} was saved for another model "
            f"({meta.get('model_name') or meta['model']}), not {model_name or 'this one'}"
        )
    drafter = decoder.drafter
    name = _drafter_name(drafter)
    if meta["drafter"] != name:
        raise ValueError(
            f"{str(path)!r} was saved with draft {meta['drafter']!r}, not {name!r}"
        )
    n = int(meta["n_target"])
    history, last_hidden = caches[n].cache
    target = decoder.cache.caches
    if n != len(target):
        raise ValueError(
            f"{str(path)!r} holds {n} layer caches, the model has {len(target)}"
        )
    for i, c in enumerate(caches[:n]):
        if isinstance(target[i], GDNSlotCache):
            target[i].cache = list(c.cache)  # in place: the slot pool stays
        else:
            target[i] = c
    decoder.history = history.tolist()
    decoder.processed = len(decoder.history)
    decoder.last_hidden = last_hidden
    if drafter is not None:
        arrays = [a for a in caches[n + 1].cache if a is not None]
        drafter.restore(decoder.history, arrays)
