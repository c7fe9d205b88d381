"""Drafters propose tokens; the target verifies them.

A user's drafter implements ``reset(prompt, hidden)``, ``draft(k) -> list[int]``
and ``accept(tokens, hidden)`` (the tokens a verify step emitted, with the
target's hidden states for the verified positions); what the engine asks of
the drafters it holds is in :mod:`.contract` (docs/drafters.md).
"""

from .ngram import NgramDrafter

DRAFTS = ("none", "ngram", "mtp", "mtp+ngram")


def default_draft(model) -> str:
    """``mtp+ngram`` for a model with an MTP head, else ``ngram``."""
    return "mtp+ngram" if getattr(model, "mtp_head", None) is not None else "ngram"


def make_drafter(draft: str, model=None, max_ngram: int = 3):
    """Build the drafter named by ``draft`` for ``model`` (``"none"``: None)."""
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft {draft!r}; choose one of {', '.join(DRAFTS)}")
    if draft == "ngram":
        return NgramDrafter(max_ngram=max_ngram)
    if draft in ("mtp", "mtp+ngram"):
        # The head comes from mlx_spec.load (model.mtp_head); the error for a
        # model without one says which command writes it.
        from ..models.mtp import mtp_head_of
        from .combined import MTPNgramDrafter
        from .mtp import MTPDrafter

        head = mtp_head_of(model)
        if draft == "mtp":
            return MTPDrafter(head)
        return MTPNgramDrafter(head, max_ngram=max_ngram)
    return None
