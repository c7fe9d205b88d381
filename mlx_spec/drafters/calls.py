"""How the engine calls a drafter: each optional contract of
:mod:`.contract` through one function, with the default for a drafter
without it (a drafter that keeps no arrays saves none, one that defers no
work has nothing to catch up). Core calls these, never a drafter's optional
methods, so a drafter implements only what it has."""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .contract import (
    MAX_AUTO_DRAFT_TOKENS,
    NO_DRAFT_FORWARD,
    DefersWork,
    DeferredPass,
    DraftChooser,
    Drafter,
    DraftForwardCost,
    DraftsLong,
    ForwardsToDraft,
    Hindsight,
    KeepsArrays,
    KnowsEmpty,
    ReadsFeatures,
    ReadsPromptRows,
    SamplesDrafts,
    SelfJudging,
    Suspends,
    TakesPromptInPieces,
)

_IMPLEMENTS: Dict[Tuple[type, type], bool] = {}


def implements(drafter, contract) -> bool:
    """Whether ``drafter`` implements the optional ``contract`` (a
    runtime-checkable protocol), asked once per class: the engine asks every
    pass, and a protocol's ``isinstance`` looks up each of its members."""
    key = (type(drafter), contract)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(drafter, contract)
    return known


def set_sampling(drafter: Drafter, choose: Optional[DraftChooser]):
    """Tell ``drafter`` how drafts are chosen; a deterministic one keeps its
    own (the verifier treats its q as one-hot)."""
    if implements(drafter, SamplesDrafts):
        drafter.set_sampling(choose)


def reads_features(drafter: Optional[Drafter]) -> bool:
    """Whether ``drafter`` reads the tap's features (else the post-norm state)."""
    if drafter is None or not implements(drafter, ReadsFeatures):
        return False
    return bool(drafter.reads_features)


def takes_prompt_in_pieces(drafter: Optional[Drafter]) -> bool:
    """Whether ``drafter`` takes a chunked prompt chunk by chunk."""
    if drafter is None or not implements(drafter, TakesPromptInPieces):
        return False
    return bool(drafter.takes_prompt_in_pieces)


def max_auto_draft(drafter: Optional[Drafter]) -> int:
    """The longest draft ``auto`` may choose for ``drafter``."""
    if drafter is not None and implements(drafter, DraftsLong):
        return int(drafter.max_auto_draft)
    return MAX_AUTO_DRAFT_TOKENS


def forwards_to_draft(drafter: Optional[Drafter]) -> bool:
    """Whether ``drafter``'s drafts run a forward of their own."""
    return drafter is not None and implements(drafter, ForwardsToDraft)


def draft_forward_cost(drafter: Optional[Drafter]) -> DraftForwardCost:
    """What ``drafter``'s draft forward costs (nothing for one without)."""
    if forwards_to_draft(drafter):
        return drafter.draft_forward_cost()
    return NO_DRAFT_FORWARD


def can_draft(drafter: Drafter) -> bool:
    return drafter.can_draft() if implements(drafter, KnowsEmpty) else True


def rows_read(drafter: Drafter, n: int) -> int:
    return drafter.rows_read(n) if implements(drafter, ReadsPromptRows) else n


def draft_source(drafter: Drafter, k: int, look: bool = True) -> Optional[str]:
    if implements(drafter, SelfJudging):
        return drafter.draft_source(k, look)
    return None


def judged(drafter: Drafter) -> Hindsight:
    """What ``drafter`` judged in hindsight since it was last asked (and,
    asked once, it goes on judging); nothing for one that does not judge."""
    return drafter.hindsight() if implements(drafter, SelfJudging) else {}


def tell_paying(drafter: Drafter, source: str, paying: bool):
    if implements(drafter, SelfJudging):
        drafter.set_source_paying(source, paying)


def rest(drafter: Drafter, source: str, resting: bool):
    """Suspend (``resting``) or resume the upkeep of ``drafter``'s ``source``;
    nothing for a drafter without upkeep to stop."""
    if implements(drafter, Suspends):
        if resting:
            drafter.suspend(source)
        else:
            drafter.resume(source)


def catch_up(drafter: Drafter):
    if implements(drafter, DefersWork):
        drafter.catch_up()


def take_deferred(drafter: Drafter) -> List[DeferredPass]:
    return drafter.take_deferred() if implements(drafter, DefersWork) else []


def put_deferred(drafter: Drafter, rows: List[DeferredPass]):
    if implements(drafter, DefersWork):
        drafter.put_deferred(rows)
    elif rows:
        raise ValueError(f"drafter {drafter.name!r} defers no work")


def saved_arrays(drafter: Drafter) -> List[mx.array]:
    return drafter.saved_arrays() if implements(drafter, KeepsArrays) else []


def check_state(drafter: Drafter, arrays, deferred: List[DeferredPass]):
    """``ValueError`` unless ``arrays`` and ``deferred`` fit ``drafter``: a
    drafter keeping no arrays and deferring nothing has none."""
    if implements(drafter, KeepsArrays):
        drafter.check_state(arrays, deferred)
    elif arrays or (deferred and not implements(drafter, DefersWork)):
        raise ValueError(f"drafter {drafter.name!r} keeps no arrays, the state has")


def restore(drafter: Drafter, history: Sequence[int], arrays: Sequence[mx.array]):
    """Rebuild ``drafter`` for a saved ``history``: from its arrays, or, for
    a drafter keeping none, from the tokens alone (one that reads hidden
    states cannot be: they were not saved)."""
    if implements(drafter, KeepsArrays):
        drafter.restore(history, arrays)
    elif drafter.needs_hidden:
        raise ValueError(f"drafter {drafter.name!r} cannot be restored")
    else:
        drafter.reset(list(history), None)
