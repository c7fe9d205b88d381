"""Choosing the draft length online: ``--num-draft-tokens auto``.

The expected number of tokens a verify pass with ``k`` drafts yields is
``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i``, where ``a_i`` is the probability that
draft ``i`` is accepted given drafts ``1..i-1`` were. Its cost is modelled as
the verify forward over ``1+k`` tokens at the current context length (the
profile, measured once at two context lengths and interpolated: attention
grows linearly with context), plus what the passes of this generation really
took beyond their verify forward, learned online from every pass as a line in
``k``: a constant (host work, the drafter's catch-up, a busier machine) and a
cost per draft (the drafter's own forwards, which run on the device with the
verify pass and are invisible to a host timer; its slope leans on the
host-timed drafting cost until passes of several lengths are seen). The policy picks the ``k`` that maximises tokens per second, which
is ``k = 0`` (plain decoding) whenever speculation does not pay; it then
re-probes with one draft now and then, so a workload that becomes
predictable is noticed.
"""

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..drafters.base import MAX_AUTO_DRAFT_TOKENS
from ..mlx_lm_compat import make_prompt_cache
from ..models.fingerprint import model_fingerprint
from ..models.pipeline import from_rank0

# Prior acceptance per position before any evidence, and its weight (in passes).
_PRIOR, _PRIOR_WEIGHT = 0.3, 2.0
# Exponential forgetting: acceptance drifts with the content being generated.
_DECAY = 0.97
PROBE_EVERY = 16  # passes at k = 0 before a one-draft probe
# Each rejected probe doubles the wait before the next (a probe costs the
# drafter's catch-up over every deferred row), from PROBE_EVERY up to this; an
# accepted one is followed by another at the next pass while the first draft
# position has less evidence than PROBE_STREAK_EVIDENCE (decayed passes), so
# that a drafter which became useful is re-learned within a few passes, not a
# few probes; with that evidence the policy's own choice takes over.
MAX_PROBE_EVERY = 128
PROBE_STREAK_EVIDENCE = 4.0
_COST_DECAY = 0.95  # forgetting of older passes in the learned pass cost
# Trust in the host-timed draft cost, in one-draft passes' worth of evidence.
_SLOPE_PRIOR_WEIGHT = 0.5
# While drafting, a pass without drafts is timed once the last one's weight
# (decaying with _COST_DECAY per pass) falls below this: about every 28 passes,
# so the cost line is anchored at k = 0, not extrapolated to it.
_PLAIN_PROBE_WEIGHT = 0.25
# Context lengths (tokens before a pass) the verify costs are measured at.
PROFILE_CONTEXTS = (32, 1056)

CACHE_DIR_ENV = "MLX_SPEC_CACHE_DIR"  # default: ~/.cache/mlx_spec

_profiles: Dict[tuple, List[float]] = {}  # (id(model), context) -> costs


def most_drafts(num_draft_tokens) -> int:
    """The most tokens one pass drafts under ``num_draft_tokens`` ("auto"
    or a number)."""
    if num_draft_tokens == "auto":
        return MAX_AUTO_DRAFT_TOKENS
    return num_draft_tokens


def verify_cost_profile(
    model,
    max_tokens: int = MAX_AUTO_DRAFT_TOKENS + 1,
    repeats: int = 3,
    context: int = PROFILE_CONTEXTS[0],
):
    """Seconds of a target forward over T = 1..max_tokens tokens after
    ``context`` tokens; index 0 is T = 1.

    Measured once per machine, MLX version, BLAS and model: kept for the
    process and on disk (:func:`profile_cache_file`), so later runs skip it.
    """
    key = (id(model), context)
    if key in _profiles and len(_profiles[key]) >= max_tokens:
        return _profiles[key][:max_tokens]
    disk_key = _profile_key(model, max_tokens, context)
    costs = _read_profile(disk_key, max_tokens)
    if costs is None:
        costs = measure_verify_costs(model, max_tokens, repeats, context)
        _write_profile(disk_key, costs)
    _profiles[key] = costs
    return costs


def verify_cost_profiles(model) -> Tuple[List[float], List[float]]:
    """The profile after each of ``PROFILE_CONTEXTS`` tokens (measured or cached)."""
    short, long = (verify_cost_profile(model, context=c) for c in PROFILE_CONTEXTS)
    return short, long


def make_policy(model, verify_costs: Optional[List[float]] = None, group=None):
    """The auto policy for ``model`` (per draft source): from ``verify_costs``
    (one profile, no growth with context) when given, else from the measured
    profiles."""
    if verify_costs is not None:
        return SourcePolicies(lambda: DraftLengthPolicy(verify_costs, group=group))
    short, long = verify_cost_profiles(model)
    return SourcePolicies(
        lambda: DraftLengthPolicy(short, group=group, long_costs=long)
    )


def measure_verify_costs(
    model, max_tokens: int, repeats: int = 3, context: int = PROFILE_CONTEXTS[0]
) -> List[float]:
    """Time target forwards over T = 1..max_tokens tokens on this machine.

    On a scratch cache holding ``context`` random tokens (restored after every
    timed forward), after a warm-up round; the minimum of ``repeats`` rounds
    (robust to a busy machine), made non-decreasing in T.
    """
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else 2
    cache = make_prompt_cache(model)
    for start in range(0, context, 512):
        n = min(512, context - start)
        mx.eval(model(mx.random.randint(0, vocab, (1, n)), cache=cache))
    saved = [c.state for c in cache]
    best = [float("inf")] * max_tokens
    for round_ in range(repeats + 1):
        for T in range(1, max_tokens + 1):
            tokens = mx.random.randint(0, vocab, (1, T))
            mx.eval(tokens)
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            if round_:  # round 0 warms up every shape
                best[T - 1] = min(best[T - 1], time.perf_counter() - tic)
            for c, state in zip(cache, saved):
                c.state = state
    costs = []
    for t in best:
        costs.append(max(t, costs[-1] if costs else 0.0))
    return costs


def profile_cache_file() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "mlx_spec"
    return Path(root) / "verify_costs.json"


def _profile_key(model, max_tokens: int, context: int) -> str:
    """What a profile depends on: the machine, its MLX and BLAS, the model."""
    what = {
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "blas": os.environ.get("LD_PRELOAD", ""),
        "model": model_fingerprint(model),
        "tokens": max_tokens,
    }
    if context != PROFILE_CONTEXTS[0]:  # profiles stored before keep their key
        what["context"] = context
    if mx.metal.is_available():
        what["gpu"] = str(mx.device_info().get("device_name", ""))
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _read_profile(key: str, max_tokens: int) -> Optional[List[float]]:
    """The stored profile, or None (missing, unreadable or malformed file)."""
    try:
        costs = json.loads(profile_cache_file().read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    valid = (
        isinstance(costs, list)
        and len(costs) == max_tokens
        and all(isinstance(c, float) and 0 < c < 60 for c in costs)
    )
    return costs if valid else None


def _write_profile(key: str, costs: List[float]):
    """Store the profile (atomic replace); a cache that cannot be written is
    only a cost: the profile is measured again next time."""
    path = profile_cache_file()
    try:
        profiles = json.loads(path.read_text())
        if not isinstance(profiles, dict):
            profiles = {}
    except (OSError, ValueError):
        profiles = {}
    profiles[key] = costs
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, suffix=".tmp", delete=False
        ) as f:
            json.dump(profiles, f)
        os.replace(f.name, path)
    except OSError:
        if "f" in locals():
            Path(f.name).unlink(missing_ok=True)


def reprobe(policy, best: int, limit: int) -> int:
    """``best``, except one draft after ``policy.probe_every`` passes at
    k = 0 (acceptance may have changed); counts ``policy.passes_at_zero`` and
    sets ``policy.probing`` for a probe."""
    policy.probing = False
    if best == 0 and limit > 0:
        policy.passes_at_zero += 1
        if policy.passes_at_zero < policy.probe_every:
            return 0
        policy.probing = True
    policy.passes_at_zero = 0
    return max(best, int(policy.probing))  # MLX refuses a bool as a slice bound


class DraftLengthPolicy:
    """Online choice of the number of drafts per verify pass.

    ``verify_costs`` / ``long_costs``: the profile after ``PROFILE_CONTEXTS``
    tokens of context (seconds, index 0 = 1 token; without ``long_costs``
    the cost does not grow with context). ``group``: the ranks of a pipeline,
    which time their passes differently but must verify the same number of
    tokens: rank 0's choice is used."""

    def __init__(
        self,
        verify_costs: List[float],
        max_draft: int = MAX_AUTO_DRAFT_TOKENS,
        group=None,
        long_costs: Optional[List[float]] = None,
    ):
        self.group = group
        self.verify_costs = list(verify_costs)
        self.long_costs = None if long_costs is None else list(long_costs)
        self.max_draft = min(max_draft, len(self.verify_costs) - 1)
        self.accepted = [0.0] * self.max_draft  # decayed counts per position
        self.drafted = [0.0] * self.max_draft
        self.draft_cost = 0.0  # host-timed seconds per drafted token
        # Decayed sums over observed passes of (1, k, k^2, r, k r), r being a
        # pass's seconds beyond its verify forward: fit r = extra + slope k.
        self._fit = [0.0] * 5
        self._plain_weight = 0.0  # decayed count of timed passes without drafts
        self._warm: set = set()  # draft counts past their first (warm-up) pass
        self.passes_at_zero, self.probe_every, self.probing = 0, PROBE_EVERY, False
        self.last_choice = self.best = 0

    def acceptance(self) -> List[float]:
        """Estimated conditional acceptance a_i per draft position.

        A position with little evidence borrows the estimate of the one before
        it (acceptance changes slowly with depth), so a deeper draft is tried
        once shallower drafts prove reliable.
        """
        rates, prior = [], _PRIOR
        for a, d in zip(self.accepted, self.drafted):
            prior = (a + prior * _PRIOR_WEIGHT) / (d + _PRIOR_WEIGHT)
            rates.append(prior)
        return rates

    def verify_cost(self, k: int, context: int) -> float:
        """Seconds of a verify forward over 1 + k tokens after ``context``."""
        base = self.verify_costs[k]
        if self.long_costs is None:
            return base
        c0, c1 = PROFILE_CONTEXTS
        slope = max(self.long_costs[k] - base, 0.0) / (c1 - c0)
        return base + slope * max(context - c0, 0)

    def pass_cost(self, k: int, context: int = PROFILE_CONTEXTS[0]) -> float:
        """Expected seconds of a pass with ``k`` drafts after ``context`` tokens."""
        extra, slope = self.fitted_costs()
        return max(self.verify_cost(k, context) + extra + slope * k, 1e-9)

    def fitted_costs(self) -> Tuple[float, float]:
        """(extra, per-draft) seconds of a pass beyond its verify forward.

        A least-squares line through the observed passes, its slope pulled
        towards the host-timed drafting cost (all that is known while every
        pass drafts the same number: a lazy draft's device time shows only
        in the pass). Before any pass: (0, the host-timed cost).
        """
        n, sk, skk, sr, skr = self._fit
        lam, b0 = _SLOPE_PRIOR_WEIGHT, self.draft_cost
        det = n * (skk + lam) - sk * sk
        if n == 0 or det <= 0:
            return 0.0, b0
        extra = (sr * (skk + lam) - sk * (skr + lam * b0)) / det
        slope = (n * (skr + lam * b0) - sk * sr) / det
        return extra, max(slope, 0.0)

    @property
    def extra(self) -> Optional[float]:
        """Learned seconds a pass takes beyond verify and drafting (None: no pass yet)."""
        return self.fitted_costs()[0] if self._fit[0] else None

    def expected_speed(self, k: int, context: int = PROFILE_CONTEXTS[0]) -> float:
        """Expected tokens per second with ``k`` drafts."""
        tokens, survive = 1.0, 1.0
        for a in self.acceptance()[:k]:
            survive *= a
            tokens += survive
        return tokens / self.pass_cost(k, context)

    def choose(self, limit: int, context: int = PROFILE_CONTEXTS[0]) -> int:
        """Drafts for the next pass (after ``context`` tokens), at most ``limit``."""
        limit = min(limit, self.max_draft)
        best = max(range(limit + 1), key=lambda k: self.expected_speed(k, context))
        self.best = best
        best = reprobe(self, best, limit)
        if best and self._fit[0] and self._plain_weight < _PLAIN_PROBE_WEIGHT:
            best, self.probing = 0, False  # a cost probe: what a plain pass takes now
        if self.group is not None:
            best = from_rank0(self.group, best)
        self.last_choice = best
        return best

    def next_is_plain(self) -> bool:
        """Whether the pass after a pass without drafts will draft nothing
        too (said before it is chosen): drafting did not pay at the last
        choice and no probe is due. A plain pass may then be queued while
        this one runs (see ``SpeculativeDecoder.verify``)."""
        return self.best == 0 and self.passes_at_zero + 1 < self.probe_every

    def update(
        self, n_drafted: int, n_accepted: int, draft_seconds: Optional[float] = None
    ):
        """Record a verify pass: ``n_accepted`` of ``n_drafted`` drafts kept."""
        if n_drafted == 0:
            return
        if self.probing:  # back off while probes keep failing
            self.probing = False
            longer = min(max(2 * self.probe_every, PROBE_EVERY), MAX_PROBE_EVERY)
            streak = self.drafted[0] + 1 < PROBE_STREAK_EVIDENCE
            self.probe_every = (1 if streak else PROBE_EVERY) if n_accepted else longer
        for i in range(self.max_draft):
            self.accepted[i] *= _DECAY
            self.drafted[i] *= _DECAY
        # Position i was tested only if drafts 0..i-1 were all accepted.
        for i in range(min(n_accepted + 1, n_drafted, self.max_draft)):
            self.drafted[i] += 1
            self.accepted[i] += i < n_accepted
        if draft_seconds is not None:
            per_token = draft_seconds / n_drafted
            self.draft_cost = 0.8 * self.draft_cost + 0.2 * per_token

    def observe_pass(
        self, n_drafted: int, seconds: float, context: int = PROFILE_CONTEXTS[0]
    ):
        """Record what a whole pass with ``n_drafted`` drafts took (seconds)."""
        if n_drafted > self.max_draft or not 0 < seconds < 60:
            return  # not a pass this policy chooses, or a clock anomaly
        if n_drafted not in self._warm:  # the first pass of a shape pays warm-up
            self._warm.add(n_drafted)
            return
        self._plain_weight = _COST_DECAY * self._plain_weight + (n_drafted == 0)
        k, r = n_drafted, seconds - self.verify_cost(n_drafted, context)
        self._fit = [
            _COST_DECAY * old + new
            for old, new in zip(self._fit, (1.0, k, k * k, r, k * r))
        ]


class SourcePolicies:
    """One :class:`DraftLengthPolicy` per draft source of a drafter that
    switches sources (``mtp+ngram``: a copy's acceptance and cost are not the
    head's). Each pass is chosen, recorded and timed by its source's policy,
    so a head that does not pay is switched off where it would draft while
    copies keep their own, longer drafts. Source None: a one-source drafter."""

    def __init__(self, make):
        self._make, self.by_source = make, {}
        self.active: Optional[DraftLengthPolicy] = None

    def select(self, source: Optional[str]) -> DraftLengthPolicy:
        """The policy of ``source``, which the next update goes to."""
        if source not in self.by_source:
            self.by_source[source] = self._make()
        self.active = self.by_source[source]
        return self.active

    def choose(self, limit: int, context: int, source: Optional[str] = None) -> int:
        return self.select(source).choose(limit, context)

    def next_is_plain(self) -> bool:
        """Whether no source's policy would draft in the next pass: its
        source is not known before its input token is."""
        return all(p.next_is_plain() for p in self.by_source.values())

    def update(self, *args):
        self.active.update(*args)

    def observe_pass(self, *args):
        self.active.observe_pass(*args)
