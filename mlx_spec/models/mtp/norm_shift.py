"""Whether the head's seven zero-centred norms still need their ``+1``.

The decision is taken once for the whole head (never per tensor), from the
strongest evidence there is, in this order:

1. metadata that says so: an ``mlx_spec`` sidecar's ``mlx_spec.sanitized``,
   or a manifest's ``rmsnorm_weight_format`` (``mlx_gamma``: shifted);
2. where the tensors came from: ``mtp.*`` in the model's own shards of a
   release checkpoint (not written by mlx) are raw, zero-centred;
3. the norms' values, the weakest: refused when they do not all point the
   same way.

Whatever decided, the shifted norms are checked last: a head whose norms
would end up un-shifted (weights around 0) or shifted twice (every weight at
least 1) is refused. A wrong shift otherwise loads fine and silently drafts
nothing.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx

from .weights import MTP_NORMS, MTPWeightsError

# Evidence names, strongest first (reported in the one-line summary).
EVIDENCE_METADATA = "mlx-spec metadata"
EVIDENCE_MANIFEST = "manifest"
EVIDENCE_RELEASE = "release checkpoint: mtp.* in the model's shards"
EVIDENCE_VALUES = "norm values"

# A norm whose weights are more than this share negative, or whose mean is
# within _NEAR_ZERO of 0, is stored zero-centred: real gammas (1 + w) are
# positive, and a whole norm of gammas near 0 would silence its channels.
_ZERO_CENTRED_NEGATIVE = 0.10
_NEAR_ZERO = 0.1
# A norm with fewer negatives than this and a positive mean holds gammas.
_GAMMA_NEGATIVE = 0.01
# Shifted twice: (almost) every weight of every norm at least 1.
_DOUBLE_BELOW_ONE = 0.01


@dataclass(frozen=True)
class ShiftDecision:
    add_one: bool  # whether the +1 is applied when loading
    evidence: str  # which evidence decided (one of EVIDENCE_*), with detail

    def describe(self) -> str:
        what = "+1 applied" if self.add_one else "already shifted"
        return f"norms {what} ({self.evidence})"


@dataclass(frozen=True)
class _NormStats:
    mean: float
    negative: float  # share of weights < 0
    below_one: float  # share of weights < 1

    @property
    def kind(self) -> str:
        """'zero-centred', 'gamma' or 'unclear' (how the stored values look)."""
        if self.negative > _ZERO_CENTRED_NEGATIVE or abs(self.mean) < _NEAR_ZERO:
            return "zero-centred"
        if self.negative < _GAMMA_NEGATIVE and self.mean > 0:
            return "gamma"
        return "unclear"


def _stats(tensors: Dict[str, mx.array], source: str, add: float = 0.0):
    out = {}
    for name in MTP_NORMS:
        if name not in tensors:
            raise MTPWeightsError(f"{source}: MTP tensor {name} is missing")
        v = tensors[name].astype(mx.float32) + add
        out[name] = _NormStats(
            mean=mx.mean(v).item(),
            negative=mx.mean(v < 0).item(),
            below_one=mx.mean(v < 1).item(),
        )
    return out


def _short(names: List[str]) -> str:
    return ", ".join(n[len("mtp.") : -len(".weight")] for n in names)


def _from_values(stats, source: str) -> ShiftDecision:
    kinds = {name: s.kind for name, s in stats.items()}
    by_kind: Dict[str, List[str]] = {}
    for name, kind in kinds.items():
        by_kind.setdefault(kind, []).append(name)
    if set(by_kind) == {"zero-centred"}:
        return ShiftDecision(True, f"{EVIDENCE_VALUES}: all seven zero-centred")
    if set(by_kind) == {"gamma"}:
        return ShiftDecision(False, f"{EVIDENCE_VALUES}: all seven already gammas")
    detail = "; ".join(f"{_short(v)} look {k}" for k, v in sorted(by_kind.items()))
    raise MTPWeightsError(
        f"{source}: cannot tell whether the MTP norms need their +1 (no metadata "
        f"says, and the values disagree: {detail}); a half-shifted head? Write "
        "the sidecar with `mlx_spec convert` from the raw checkpoint"
    )


def _check_result(tensors, decision: ShiftDecision, source: str):
    """Refuse a head whose norms end up un-shifted or shifted twice."""
    stats = _stats(tensors, source, 1.0 if decision.add_one else 0.0)
    unshifted = [n for n, s in stats.items() if s.kind == "zero-centred"]
    if unshifted:
        raise MTPWeightsError(
            f"{source}: with {decision.describe()} the MTP norms "
            f"{_short(unshifted)} would still be zero-centred (weights around 0): "
            "un-shifted or half-shifted head refused"
        )
    if all(s.below_one < _DOUBLE_BELOW_ONE for s in stats.values()):
        raise MTPWeightsError(
            f"{source}: with {decision.describe()} every MTP norm weight is at "
            "least 1, the mark of a +1 applied twice: head refused"
        )


def decide_shift(
    tensors: Dict[str, mx.array],
    source: str,
    evidence: Optional[ShiftDecision] = None,
) -> ShiftDecision:
    """The decision for ``tensors`` (canonical names): ``evidence`` from
    metadata or provenance when there is any, else from the values; then the
    result is checked. Raises :class:`MTPWeightsError` naming ``source``."""
    decision = evidence or _from_values(_stats(tensors, source), source)
    _check_result(tensors, decision, source)
    return decision


def apply_shift(
    tensors: Dict[str, mx.array], decision: ShiftDecision
) -> Dict[str, mx.array]:
    """``tensors`` with the ``+1`` on the seven norms when decided (in
    float32, cast back to each norm's dtype)."""
    if not decision.add_one:
        return dict(tensors)
    out = dict(tensors)
    for name in MTP_NORMS:
        v = out[name]
        out[name] = (v.astype(mx.float32) + 1.0).astype(v.dtype)
    return out
