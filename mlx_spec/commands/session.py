"""Saving and loading a whole speculative session (``--prompt-cache-file``).

The file is an mlx-lm prompt-cache file (``mlx_lm.models.cache.save_prompt_cache``
safetensors layout). Before saving, the pending token is processed, so the
first ``n_target`` entries are exactly the prompt cache plain decoding of the
conversation would have: ``mlx_lm.models.cache.load_prompt_cache`` reads them.
After them come one ``ArraysCache`` holding the token history and the hidden
state of the last token, then the drafter's own state arrays. The metadata
names the model (a fingerprint of its config and weights) and the drafter.
The file is written to exactly the path given, whatever its suffix.
"""

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from ..core.snapshot import DecoderState, capture, drafter_name, restore
from ..core.state import GDNSlotCache
from ..mlx_lm_compat import ArraysCache, load_prompt_cache, save_prompt_cache
from ..models.fingerprint import model_fingerprint
from .common import one_line

FORMAT = "mlx_spec.session.v1"


def _plain(cache):
    """mlx-lm's own class for a cache entry (so mlx-lm can load the file)."""
    if isinstance(cache, GDNSlotCache):
        plain = ArraysCache(len(cache.cache))
        plain.cache = list(cache.cache)
        return plain
    return cache


def _temp_file_beside(path: Path) -> Path:
    """A new empty file in ``path``'s directory, named ``*.safetensors`` (the
    suffix ``mx.save_safetensors`` would otherwise append)."""
    fd, name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".safetensors"
    )
    os.close(fd)
    return Path(name)


def check_writable(path):
    """Raise ``ValueError`` naming ``path`` if a session cannot be saved there
    (checked by creating a file beside it, so it fails before a session is lost)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt cache file {str(path)!r} is a directory")
    try:
        _temp_file_beside(path).unlink()
    except OSError as e:
        raise ValueError(
            f"cannot write the prompt cache file {str(path)!r}: {e.strerror}"
        ) from None


def save_session(path, decoder, model_name: str = ""):
    """Write ``decoder``'s whole state to exactly ``path`` (safetensors, whatever
    its suffix), atomically: a file beside it, renamed onto it when complete."""
    state = capture(decoder)
    session = ArraysCache(2)
    session.cache = [mx.array(state.history, mx.uint32), state.last_hidden]
    extra = ArraysCache(max(len(state.drafter_arrays), 1))
    extra.cache = state.drafter_arrays or [None]
    caches = [_plain(c) for c in state.caches] + [session, extra]
    meta = {
        "format": FORMAT,
        "model": model_fingerprint(decoder.model),
        "model_name": str(model_name),
        "drafter": state.drafter,
        "n_target": str(len(state.caches)),
    }
    path = Path(path)
    tmp = _temp_file_beside(path)
    try:
        save_prompt_cache(str(tmp), caches, meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _safetensors_name(path: Path):
    """A name for ``path`` ending in ``.safetensors``: ``mx.load``, which
    ``load_prompt_cache`` calls, tells the format from the suffix."""
    if path.suffix == ".safetensors":
        yield path
        return
    with tempfile.TemporaryDirectory() as tmp:
        link = Path(tmp) / "session.safetensors"
        link.symlink_to(path.resolve())
        yield link


def _read(path: Path):
    """``(caches, metadata)`` of a prompt-cache file; ``ValueError`` naming it
    for anything that is not one."""
    if path.is_dir():
        raise ValueError(f"prompt cache file {str(path)!r} is a directory")
    try:
        with _safetensors_name(path) as name:
            return load_prompt_cache(str(name), return_metadata=True)
    except Exception as e:  # whatever the bytes are, the file is unreadable
        raise ValueError(
            f"{str(path)!r} is not a readable prompt cache file ({one_line(e)})"
        ) from None


def load_session(path, decoder, model_name: str = ""):
    """Restore a session saved by :func:`save_session` into a fresh ``decoder``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming
    the file for one that is unreadable or made for another model or drafter.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt cache file {str(path)!r} does not exist")
    caches, meta = _read(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an mlx_spec session file")
    if meta["model"] != model_fingerprint(decoder.model):
        raise ValueError(
            f"{str(path)!r} was saved for another model "
            f"({meta.get('model_name') or meta['model']}), not {model_name or 'this one'}"
        )
    name = drafter_name(decoder.drafter)
    if meta["drafter"] != name:
        raise ValueError(
            f"{str(path)!r} was saved with draft {meta['drafter']!r}, not {name!r}"
        )
    n = int(meta["n_target"])
    if n != len(decoder.cache.caches):
        raise ValueError(
            f"{str(path)!r} holds {n} layer caches, the model has "
            f"{len(decoder.cache.caches)}"
        )
    history, last_hidden = caches[n].cache
    arrays = [a for a in caches[n + 1].cache if a is not None]
    state = DecoderState(history.tolist(), last_hidden, caches[:n], name, arrays)
    restore(decoder, state)
