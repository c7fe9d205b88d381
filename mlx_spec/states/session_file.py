"""Saving and loading a whole speculative session (``--prompt-cache-file``).

The file is a state file (:mod:`mlx_spec.states.file`: an mlx-lm prompt-cache
file with the token history and the drafter's state after the target's
caches). Before saving, the pending token is processed, so its first
``n_target`` entries are exactly the prompt cache plain decoding of the
conversation would have: ``mlx_lm.models.cache.load_prompt_cache`` reads
them. The metadata names the model (the identity of every byte of its
weights, :mod:`mlx_spec.models.identity`), the DFlash drafter model attached
to it (its context is in the file) and the drafter. The file is
written to exactly the path given, whatever its suffix. Files of the first
version named the model by its config and a few weight rows only, so that a
fine-tune passed for its base: they are refused, with a message saying so.
"""

from pathlib import Path

from .snapshot import capture, drafter_name
from ..drafters.dflash import attached_draft_model
from ..models.identity import draft_model_fingerprint, model_fingerprint
from .file import (
    check_writable,
    plain_state,
    read_metadata,
    read_state,
    write_state,
)

FORMAT = "mlx_spec.session.v2"
EARLIER_FORMATS = ("mlx_spec.session.v1",)

__all__ = ["FORMAT", "check_writable", "load_session", "save_session"]


def save_session(path, session, model_name: str = ""):
    """Write the whole state of ``session`` (a :class:`mlx_spec.Session`) to
    exactly ``path`` (safetensors, whatever its suffix), atomically: a file
    beside it, renamed onto it when complete."""
    decoder = session.decoder
    meta = {
        "format": FORMAT,
        "model": model_fingerprint(decoder.model),
        "model_name": str(model_name),
        "draft_model": _draft_model(decoder.model),
    }
    write_state(path, plain_state(capture(decoder)), meta)


def _draft_model(model) -> str:
    return draft_model_fingerprint(attached_draft_model(model))


def load_session(path, session, model_name: str = ""):
    """Restore a session saved by :func:`save_session` into a fresh ``session``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming
    the file for one that is unreadable or made for another model or drafter.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt cache file {str(path)!r} does not exist")
    real = path.resolve()  # a link the user made is followed, once, here
    try:
        header = read_metadata(real)
    except ValueError as e:
        raise ValueError(
            f"{str(path)!r} is not a readable prompt cache file ({e})"
        ) from None
    if header.get("format") in EARLIER_FORMATS:
        raise ValueError(
            f"{str(path)!r} was saved by an earlier mlx_spec, whose session files "
            "cannot tell which weights they were made with; start a new session"
        )
    decoder = session.decoder
    # Another model's file is refused from its header, before any array is
    # read: a command that stops right after reading one could abort (MLX's
    # reading thread lets go of the file after the interpreter has stopped).
    fingerprint = model_fingerprint(decoder.model)
    if header.get("format") == FORMAT and header.get("model") != fingerprint:
        raise ValueError(
            f"{str(path)!r} was saved for another model or other weights "
            f"({header.get('model_name') or header.get('model')}), "
            f"not {model_name or 'this one'}"
        )
    # A drafter's context is in the file: another drafter model of the same
    # shapes would draft from it as if it were its own.
    theirs = header.get("draft_model", "")  # files written before it: none
    mine = _draft_model(decoder.model)
    if header.get("format") == FORMAT and theirs != mine:
        if not theirs:
            which = "without a DFlash drafter model, and one is loaded now"
        elif not mine:
            which = "with a DFlash drafter model (--draft-model), and none is loaded"
        else:
            which = "with another DFlash drafter model than the one loaded now"
        raise ValueError(f"{str(path)!r} was saved {which}")
    state, meta = read_state(real)  # its checksum covers the header too
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an mlx_spec session file")
    name = drafter_name(decoder.drafter)
    if state.drafter != name:
        raise ValueError(
            f"{str(path)!r} was saved with draft {state.drafter!r}, not {name!r}"
        )
    try:
        session.restore(state)
    except ValueError as e:
        raise ValueError(f"{str(path)!r} does not fit the model: {e}") from None
