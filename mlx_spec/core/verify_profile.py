"""The cost profile behind ``auto``: what a target forward over T = 1..9
tokens takes on this machine (further for a drafter whose ``auto`` drafts
go deeper: :func:`cost_profile`'s ``tokens``), after a short and a long
context (see :func:`long_context`), and what one step of the model's MTP
head takes.

Measured once per machine, MLX version, BLAS and model (the minimum of a few
rounds), kept for the process and on disk (:func:`profile_cache_file`), so
later runs skip it; :func:`cost_profile` corrects it there from the passes
``auto`` times (see :mod:`~mlx_spec.core.cost_profile`).
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

from ..drafters.contract import MAX_AUTO_DRAFT_TOKENS
from ..mlx_lm_compat import ArraysCache, KVCache, make_prompt_cache
from ..cache_dir import cache_dir
from ..models.identity import model_fingerprint
from .cost_profile import SHORT_CONTEXT, CostProfile
from .policy_tuning import DEFAULT_TUNING, PolicyTuning

# Context lengths (tokens before a pass) the long verify costs are measured
# at: far enough from SHORT_CONTEXT for the growth with context to stand out
# of a busy machine's noise (see long_context).
LONG_CONTEXT, PREFILLED_LONG_CONTEXT = 8224, 1056
SEED_TOKENS = 32  # tokens run through the model before a long scratch context

# (id(model), context) -> costs; ("cost profile", id(model)) -> CostProfile
_profiles: Dict[tuple, object] = {}
# (id(model), long context) -> {T covered: (short key, long key)} on disk
_store_keys: Dict[tuple, Dict[int, Tuple[str, str]]] = {}
DEFAULT_TOKENS = MAX_AUTO_DRAFT_TOKENS + 1  # what a profile covers unless asked more


def verify_cost_profile(
    model,
    max_tokens: int = DEFAULT_TOKENS,
    repeats: int = 3,
    context: int = SHORT_CONTEXT,
):
    """Seconds of a target forward over T = 1..max_tokens tokens after
    ``context`` tokens; index 0 is T = 1.

    Measured once per machine, MLX version, BLAS and model: kept for the
    process and on disk (:func:`profile_cache_file`), so later runs skip it.
    A longer profile than one held (in the process, or stored for the
    default T = 1..9) measures only the lengths after it.
    """
    key = (id(model), context)
    held = _profiles.get(key, [])
    if len(held) >= max_tokens:
        return held[:max_tokens]
    disk_key = _profile_key(model, max_tokens, context)
    costs = _read_profile(disk_key, max_tokens)
    if costs is None:
        if not held and max_tokens > DEFAULT_TOKENS:
            default = _profile_key(model, DEFAULT_TOKENS, context)
            held = _read_profile(default, DEFAULT_TOKENS) or []
        first = len(held) + 1
        tail = measure_verify_costs(model, max_tokens, repeats, context, first)
        # each rises already; the tail costs no less than the held lengths' last
        costs = held + [max(c, held[-1]) if held else c for c in tail]
        _write_profile(disk_key, costs)
    _profiles[key] = costs
    return costs


def head_step_cost(model, repeats: int = 5) -> Optional[float]:
    """Seconds of one step of the model's MTP head (a row through its layer,
    its logits and their argmax) after ``SHORT_CONTEXT`` rows; None
    without a head. A drafting pass runs about one step per draft (the
    catch-up on the last pass's rows, then a step per draft after the
    first), which its host timer does not see: the drafts are lazy.
    Measured once, like the verify costs."""
    head = getattr(model, "__dict__", {}).get("mtp_head")
    if head is None:
        return None
    key = ("head", id(model))
    if key not in _profiles:
        disk_key = _profile_key(model, 1, "head")
        cost = _read_profile(disk_key, 1)
        if cost is None:
            cost = [_measure_head_step(head, repeats)]
            _write_profile(disk_key, cost)
        _profiles[key] = cost
    return _profiles[key][0]


def _measure_head_step(head, repeats: int) -> float:
    """The minimum over ``repeats`` timed steps, after a warm-up step, on a
    scratch cache of random rows (trimmed back after every step)."""
    H, vocab = head.hidden_size, head.vocab_size
    dtype = head.pre_fc_norm_hidden.weight.dtype  # the compute dtype
    cache = head.make_cache()

    def step(n: int) -> float:
        """Seconds of n rows through the head, to the last one's argmax."""
        tokens = mx.random.randint(0, vocab, (1, n))
        hidden = mx.random.normal((1, n, H)).astype(dtype)
        mx.eval(tokens, hidden)
        tic = time.perf_counter()
        hm = head.head_hidden(tokens, hidden, cache)[:, -1:]
        mx.eval(mx.argmax(head.logits(hm)), [c.state for c in cache])
        return time.perf_counter() - tic

    step(SHORT_CONTEXT)
    times = []
    for _ in range(repeats + 1):  # the first warms the shape up
        times.append(step(1))
        for c in cache:
            c.trim(1)
    return min(times[1:])


def long_context(model, tuning: PolicyTuning = DEFAULT_TUNING) -> int:
    """The long profile's context: ``LONG_CONTEXT`` tokens where a scratch
    cache of that length is written without running the model over it (see
    :func:`_scratch_cache`), else ``PREFILLED_LONG_CONTEXT`` (a prefill of
    8k tokens would make a first run wait long on a CPU). At 1,056 tokens the
    growth with context was lost in the noise of a busy machine: a 4-token
    pass after 16k tokens was priced at 30 ms and took 46 (demo model, CPU)."""
    direct = tuning.long_profile and _written_directly(make_prompt_cache(model))
    return LONG_CONTEXT if direct else PREFILLED_LONG_CONTEXT


def verify_cost_profiles(
    model, tuning: PolicyTuning = DEFAULT_TUNING, tokens: int = DEFAULT_TOKENS
) -> Tuple[List[float], Tuple[int, List[float]]]:
    """The profile over T = 1..``tokens`` after ``SHORT_CONTEXT`` tokens, and
    the long context's length with its profile (measured or cached)."""
    long = long_context(model, tuning)
    short = verify_cost_profile(model, tokens)
    return short, (long, verify_cost_profile(model, tokens, context=long))


def cost_profile(
    model, tuning: PolicyTuning = DEFAULT_TUNING, tokens: int = DEFAULT_TOKENS
) -> CostProfile:
    """``model``'s :class:`CostProfile`, one per process (and long context,
    which ``tuning`` chooses), covering at least T = 1..``tokens``: the short
    and long profiles (measured or stored), corrected in place by the passes
    ``auto`` times and then written back to disk. One held shorter is
    extended in place by the lengths after it, measured now."""
    long = long_context(model, tuning)
    key = ("cost profile", id(model), long)
    profile = _profiles.get(key)
    if profile is not None and len(profile) >= tokens:
        return profile
    tokens = max(tokens, len(_profiles.get((id(model), SHORT_CONTEXT), [])))
    verify_cost_profiles(model, tuning, tokens)
    # The process's own lists, so that corrections show in them too.
    short, long_costs = (_profiles[(id(model), c)] for c in (SHORT_CONTEXT, long))
    n = min(len(short), len(long_costs))
    short, long_costs = (c if len(c) == n else c[:n] for c in (short, long_costs))
    keys = _store_keys.setdefault((id(model), long), {})
    keys[n] = _profile_key(model, n, SHORT_CONTEXT), _profile_key(model, n, long)
    if profile is None:

        def store(short_costs, long_profile):
            short_key, long_key = keys[len(short_costs)]
            _write_profiles({short_key: short_costs, long_key: long_profile[1]})

        profile = _profiles[key] = CostProfile(short, (long, long_costs), store)
    else:
        held = len(profile)
        profile.extend(short[held:], long_costs[held:])
        _profiles[(id(model), SHORT_CONTEXT)] = profile.short
        _profiles[(id(model), long)] = profile.long[1]
    return profile


def measure_verify_costs(
    model,
    max_tokens: int,
    repeats: int = 3,
    context: int = SHORT_CONTEXT,
    first: int = 1,
) -> List[float]:
    """Time target forwards over T = first..max_tokens tokens on this machine.

    On a scratch cache holding ``context`` random tokens (restored after every
    timed forward), after a warm-up round; the minimum of ``repeats`` rounds
    (robust to a busy machine), made non-decreasing in T.
    """
    vocab = model.model.embed_tokens.weight.shape[0] if hasattr(model, "model") else 2
    cache = _scratch_cache(model, vocab, context)
    saved = [c.state for c in cache]
    best = [float("inf")] * (max_tokens - first + 1)
    for round_ in range(repeats + 1):
        for T in range(first, max_tokens + 1):
            tokens = mx.random.randint(0, vocab, (1, T))
            mx.eval(tokens)
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            if round_:  # round 0 warms up every shape
                best[T - first] = min(best[T - first], time.perf_counter() - tic)
            for c, state in zip(cache, saved):
                c.state = state
    costs = []
    for t in best:
        costs.append(max(t, costs[-1] if costs else 0.0))
    return costs


def _scratch_cache(model, vocab: int, context: int) -> list:
    """A prompt cache holding ``context`` tokens. A forward's cost depends on
    the cache's shapes, not on what it holds: when every cache that grows
    with the context is a plain ``KVCache``, a few random tokens go through
    the model and the rest of the context is random key/value rows (a
    prefill of 1,056 tokens took most of a first run's profile, 6 of 9 s with
    the reference BLAS); otherwise all ``context`` tokens are prefilled."""
    cache = make_prompt_cache(model)
    growing = [c for c in cache if not isinstance(c, ArraysCache)]
    direct = _written_directly(cache)
    prefill = min(context, SEED_TOKENS) if direct else context
    for start in range(0, prefill, 512):
        n = min(512, prefill - start)
        mx.eval(model(mx.random.randint(0, vocab, (1, n)), cache=cache))
    if direct and context > prefill:
        for c in growing:
            extra = [
                mx.random.normal(a.shape[:2] + (context - prefill,) + a.shape[3:])
                for a in (c.keys, c.values)
            ]
            c.update_and_fetch(
                *(e.astype(a.dtype) for e, a in zip(extra, (c.keys, c.values)))
            )
        mx.eval([c.state for c in growing])
    return cache


def _written_directly(cache: list) -> bool:
    """Whether every cache in ``cache`` that grows with the context is a
    plain ``KVCache`` (its rows can be written without the model)."""
    return all(type(c) is KVCache for c in cache if not isinstance(c, ArraysCache))


def profile_cache_file() -> Path:
    return cache_dir() / "verify_costs.json"


def _profile_key(model, max_tokens: int, context) -> str:
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
    if context != SHORT_CONTEXT:  # profiles stored before keep their key
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
    _write_profiles({key: costs})


def _write_profiles(updates: Dict[str, List[float]]):
    """Store several profiles at once (see :func:`_write_profile`)."""
    path = profile_cache_file()
    try:
        profiles = json.loads(path.read_text())
        if not isinstance(profiles, dict):
            profiles = {}
    except (OSError, ValueError):
        profiles = {}
    profiles.update({key: list(costs) for key, costs in updates.items()})
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
