"""Drafters propose tokens; the target verifies them.

A drafter implements the core contract of :mod:`.contract` (``reset``,
``propose``, ``accept``; or, as a user's simple object, ``reset``,
``draft(k) -> list[int]`` and ``accept``) and is made available by name with
:func:`register`; nothing in ``core/`` names a drafter (docs/drafters.md).
The built-in ones: ``ngram`` (:mod:`.ngram`), ``mtp`` (:mod:`.mtp`),
``mtp+ngram`` (:mod:`.combined`) and ``dflash`` (:mod:`.dflash`, with a
drafter model attached to the target); ``none`` is plain decoding.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .base import MAX_DRAFT_TOKENS, MAX_MTP_DRAFT_TOKENS, as_drafter
from .contract import Drafter
from .ngram import NgramDrafter

NO_DRAFTER = "none"  # plain decoding


@dataclass(frozen=True)
class DrafterOptions:
    """What a registered drafter may be made with, besides the model."""

    max_ngram: int = 3  # longest n-gram a lookup matches


@dataclass(frozen=True)
class Registration:
    """How a named drafter is made: ``make(model, options)``, and the most
    tokens one pass may ask of it."""

    make: Callable[[Any, DrafterOptions], Drafter]
    max_draft: int = MAX_DRAFT_TOKENS


_REGISTERED: Dict[str, Registration] = {}


def register(
    name: str,
    make: Callable[[Any, DrafterOptions], Drafter],
    max_draft: int = MAX_DRAFT_TOKENS,
):
    """Make ``draft=name`` (the Python API, the commands' ``--draft``, a
    server request's ``"draft"``) build a drafter with ``make(model,
    options)``; ``max_draft``: the most tokens a pass may ask of it (up to
    ``MAX_DRAFT_TOKENS``). A name already taken is refused."""
    if not isinstance(name, str) or not name or name == NO_DRAFTER:
        raise ValueError(f"a drafter's name must be a non-empty string, got {name!r}")
    if name in _REGISTERED:
        raise ValueError(f"a drafter named {name!r} is registered already")
    if not callable(make):
        raise ValueError(f"drafter {name!r}: make must be callable, got {make!r}")
    if not isinstance(max_draft, int) or not 1 <= max_draft <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"drafter {name!r}: max_draft must be in 1..{MAX_DRAFT_TOKENS}, "
            f"got {max_draft!r}"
        )
    _REGISTERED[name] = Registration(make, max_draft)


def unregister(name: str):
    """Forget the drafter registered as ``name`` (a test's own)."""
    _REGISTERED.pop(name, None)


def draft_names() -> Tuple[str, ...]:
    """Every name ``draft=`` takes: ``none`` and the registered drafters."""
    return (NO_DRAFTER,) + tuple(_REGISTERED)


def max_draft_of(name: str) -> int:
    """The most tokens a pass may ask of the drafter named ``name``."""
    return _REGISTERED[name].max_draft if name in _REGISTERED else MAX_DRAFT_TOKENS


def default_draft(model) -> str:
    """``mtp+ngram`` for a model with an MTP head, else ``ngram``."""
    return "mtp+ngram" if getattr(model, "mtp_head", None) is not None else "ngram"


def make_drafter(draft: str, model=None, max_ngram: int = 3) -> Optional[Drafter]:
    """Build the drafter named by ``draft`` for ``model`` (``"none"``: None)."""
    if draft == NO_DRAFTER:
        return None
    if draft not in _REGISTERED:
        names = ", ".join(draft_names())
        raise ValueError(f"unknown draft {draft!r}; choose one of {names}")
    drafter = _REGISTERED[draft].make(model, DrafterOptions(max_ngram))
    return as_drafter(drafter)


def _head_drafter(model, options: DrafterOptions):
    # The head comes from mlx_spec.load (model.mtp_head); the error for a
    # model without one says which command writes it.
    from ..models.mtp import mtp_head_of
    from .mtp import MTPDrafter

    return MTPDrafter(mtp_head_of(model))


def _head_and_copies(model, options: DrafterOptions):
    from ..models.mtp import mtp_head_of
    from .combined import MTPNgramDrafter

    return MTPNgramDrafter(mtp_head_of(model), max_ngram=options.max_ngram)


register("ngram", lambda model, options: NgramDrafter(max_ngram=options.max_ngram))
register("mtp", _head_drafter, MAX_MTP_DRAFT_TOKENS)
register("mtp+ngram", _head_and_copies, MAX_MTP_DRAFT_TOKENS)


def _block_drafter(model, options: DrafterOptions):
    from .dflash import make_dflash_drafter

    return make_dflash_drafter(model, options)


# A block of 16 (every release) drafts at most 15; a smaller block, fewer.
register("dflash", _block_drafter, MAX_DRAFT_TOKENS - 1)
