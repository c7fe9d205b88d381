"""What a DFlash block forward adds to a pass: measured once per drafter model.

A dflash row that drafts runs one block forward of the drafter model,
whatever the draft's length (the whole block, always), and that forward
attends to every committed position the drafter keeps, so it grows with the
context. ``auto`` prices it per drafting row
(:class:`~mlx_spec.drafters.contract.ForwardsToDraft`); what is measured
here is where that price starts, and the pass-cost fit refines it from the
passes it times (as the MTP head's profiled step).
"""

import time
from typing import List

import mlx.core as mx

from .contract import DraftForwardCost

# Context positions the block forward is timed after: far enough apart for
# its growth with context to stand out, few enough to take in at once.
SHORT_POSITIONS, LONG_POSITIONS = 32, 1056
_ATTRIBUTE = "dflash_forward_cost"  # where a drafter model keeps its measurement


def feature_width(draft_model) -> int:
    """The width of the feature rows ``draft_model`` reads (its input
    projection's, unpacked where its weights are quantized)."""
    fc = draft_model.fc
    width = fc.weight.shape[-1]
    if getattr(fc, "bits", None) is not None:  # packed weights
        width = width * 32 // fc.bits
    return width


def block_forward_cost(draft_model, repeats: int = 3) -> DraftForwardCost:
    """What one block forward of ``draft_model`` costs: its seconds at no
    context and their growth per 1,000 positions, from the minimum of
    ``repeats`` timed forwards after 32 and after 1,056 random context
    positions. Measured once and kept on the drafter model (a plain
    attribute outside its module tree, as its attachment to a target)."""
    known = getattr(draft_model, "__dict__", {}).get(_ATTRIBUTE)
    if known is None:
        short, long = (
            _timed_block(draft_model, n, repeats)
            for n in (SHORT_POSITIONS, LONG_POSITIONS)
        )
        per_position = max(long - short, 0.0) / (LONG_POSITIONS - SHORT_POSITIONS)
        seconds = max(short - per_position * SHORT_POSITIONS, 0.0)
        known = DraftForwardCost(seconds, per_position * 1000)
        object.__setattr__(draft_model, _ATTRIBUTE, known)
    return known


def _timed_block(draft_model, positions: int, repeats: int) -> float:
    """The fastest of ``repeats`` block forwards (after a warm-up one) over
    a scratch context of ``positions`` random feature rows."""
    cache = draft_model.make_cache()
    fc = draft_model.fc
    dtype = getattr(fc, "scales", fc.weight).dtype  # the compute dtype
    width = feature_width(draft_model)
    for start in range(0, positions, 512):
        n = min(512, positions - start)
        rows = mx.random.normal((1, n, width)).astype(dtype)
        draft_model.extend(rows, cache)
        mx.eval([a for c in cache for a in c.fetch() if a is not None])
    block = draft_model.block(mx.array([0], mx.uint32))
    times: List[float] = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(mx.argmax(draft_model(block, None, cache), axis=-1))
        times.append(time.perf_counter() - tic)
    return min(times[1:])
