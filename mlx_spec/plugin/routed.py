"""mlx-lm's functions as the plugin routes them: ``stream_generate``,
``generate_step`` and ``load``, and its server's batching test, each judged by
:mod:`~mlx_spec.plugin.coverage` call by call while a :class:`Plugin` is
enabled (:func:`mlx_spec.plugin.enable` installs them; with none enabled, each
is mlx-lm's own).

A covered ``stream_generate`` call runs mlx-spec's (one
:class:`~mlx_spec.Session`); a covered ``generate_step`` call yields mlx-lm's
``(token, logprobs)`` pairs from one session; ``load`` adds what
:func:`mlx_spec.load` adds to a covered model. Any other call runs mlx-lm's own
function with the arguments it was given.
"""

import collections
import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Counter, Dict, List, Optional, Tuple, Union

from ..core.policy_tuning import DEFAULT_TUNING
from ..core.stats import SpecStats
from ..generate import measure_for_auto, on_stream, options_of, steps_within
from ..generate import stream_generate as spec_stream_generate
from ..mlx_lm_compat import (
    generate_step as plain_generate_step,
    generation_stream,
    load as plain_load,
    plain_stream_generate,
)
from ..session import Session
from .coverage import Coverage, coverage, model_coverage, step_coverage
from .loading import ready_for_speculation

_SIGNATURE = inspect.signature(plain_stream_generate)
_STEP_SIGNATURE = inspect.signature(plain_generate_step)
_LOAD_SIGNATURE = inspect.signature(plain_load)


@dataclass
class Plugin:
    """The plugin's options while it is enabled, and what it did.

    ``decisions``: how many calls took each path (``"covered"`` or the
    reason a call ran mlx-lm's own code), ``stream_generate`` and
    ``generate_step`` calls together; ``step_decisions``: those of the
    ``generate_step`` calls alone (a call mlx-lm's own ``stream_generate``
    makes for a call left to it is neither: it is part of that call);
    ``last_stats``: the speculation counters of the latest covered call;
    ``total``: those of every covered call, added when the call ends.
    """

    draft: Any = "auto"
    num_draft_tokens: Union[int, str] = "auto"
    max_ngram: int = 3
    decisions: Counter[str] = field(default_factory=collections.Counter)
    step_decisions: Counter[str] = field(default_factory=collections.Counter)
    last_stats: Optional[SpecStats] = None
    total: SpecStats = field(default_factory=SpecStats)
    # (object, attribute name, mlx-lm's value) for every replacement made
    _replaced: List[Tuple[Any, str, Any]] = field(default_factory=list, repr=False)


# The enabled plugin; None while it is off. Set only by enable and disable
# (under their lock); the routed functions read it once per call.
_active: Optional[Plugin] = None


def active() -> Optional[Plugin]:
    """The enabled plugin, or None while it is off."""
    return _active


def set_active(plugin: Optional[Plugin]) -> None:
    global _active
    _active = plugin


def is_auto(draft) -> bool:
    return isinstance(draft, str) and draft == "auto"


def batchable_unless_covered(original: Callable) -> Callable:
    """mlx-lm server's batching test, false for a model the plugin covers:
    its batched path never speculates, its per-request path now does."""

    @functools.wraps(original)
    def _is_batchable(self, args):
        batchable = original(self, args)
        if batchable and _active is not None:
            model = self.model_provider.model
            return not model_coverage(model).covered
        return batchable

    return _is_batchable


@functools.wraps(plain_load)
def routed_load(*args, **kwargs):
    """mlx-lm's ``load``; while the plugin is on, a model it covers comes
    back with what :func:`mlx_spec.load` adds (its MTP head above all: see
    :func:`~mlx_spec.plugin.loading.ready_for_speculation`)."""
    loaded = plain_load(*args, **kwargs)
    if _active is not None:
        bound = _LOAD_SIGNATURE.bind(*args, **kwargs).arguments
        ready_for_speculation(
            loaded[0],
            bound["path_or_hf_repo"],
            revision=bound.get("revision"),
            lazy=bound.get("lazy", False),
        )
    return loaded


@functools.wraps(plain_stream_generate)
def routed_stream_generate(*args, **kwargs):
    """mlx-lm's ``stream_generate``, speculating where the plugin covers the
    call (see :mod:`mlx_spec.plugin`)."""
    plugin = _active
    decision = _decide(args, kwargs) if plugin is not None else None
    if decision is None or not decision.covered:
        if plugin is not None:
            plugin.decisions[decision.reason] += 1
        yield from _as_mlx_lm(plain_stream_generate(*args, **kwargs))
        return
    plugin.decisions[decision.reason] += 1
    bound = _SIGNATURE.bind(*args, **kwargs).arguments
    rest: Dict[str, Any] = dict(bound.pop("kwargs", {}))
    rest.pop("num_draft_tokens", None)  # a separate draft model's
    if "stream" in bound:
        rest["stream"] = bound["stream"]
    stats = plugin.last_stats = SpecStats()
    try:
        yield from spec_stream_generate(
            bound["model"],
            bound["tokenizer"],
            bound["prompt"],
            max_tokens=bound.get("max_tokens", 256),
            draft=None if is_auto(plugin.draft) else plugin.draft,
            num_draft_tokens=plugin.num_draft_tokens,
            max_ngram=plugin.max_ngram,
            stats=stats,
            **rest,
        )
    finally:
        _add(plugin.total, stats)


# A depth per thread, above zero while a step of mlx-lm's own
# stream_generate runs for a call left to mlx-lm: that function looks
# generate_step up in its module as it runs, finds the routed one, which must
# then be mlx-lm's own. Raised only around each next() (and the close), never
# across a yield: the caller's code between two responses, which may call
# generate_step itself, is not inside mlx-lm's.
_in_mlx_lm = threading.local()


@contextlib.contextmanager
def _running_mlx_lm():
    _in_mlx_lm.depth = getattr(_in_mlx_lm, "depth", 0) + 1
    try:
        yield
    finally:
        _in_mlx_lm.depth -= 1


def _as_mlx_lm(generator):
    """What ``generator`` (mlx-lm's own ``stream_generate``) yields, each
    of its steps run with ``generate_step`` passing straight through to
    mlx-lm's."""
    return steps_within(_running_mlx_lm, generator)


@functools.wraps(plain_generate_step)
def routed_generate_step(*args, **kwargs):
    """mlx-lm's ``generate_step``: where the plugin covers the call (see
    :func:`~mlx_spec.plugin.coverage.step_coverage`), a generator of mlx-lm's
    ``(token, logprobs [V])`` pairs from one session; otherwise mlx-lm's own
    generator, the very object its function returns (its errors too).

    Not a generator function: the call is judged, and a call that does not
    fit mlx-lm's signature raises its ``TypeError``, when it is made, as
    mlx-lm's does; a covered call's session opens at the first ``next()``,
    when mlx-lm's would start decoding."""
    plugin = _active
    if plugin is None or getattr(_in_mlx_lm, "depth", 0):
        return plain_generate_step(*args, **kwargs)
    decision = _decide_step(args, kwargs)
    plugin.decisions[decision.reason] += 1
    plugin.step_decisions[decision.reason] += 1
    if not decision.covered:
        return plain_generate_step(*args, **kwargs)
    return _speculative_steps(plugin, _STEP_SIGNATURE.bind(*args, **kwargs).arguments)


def _speculative_steps(plugin: "Plugin", bound: Dict[str, Any]):
    """A covered ``generate_step`` call (``bound``: its arguments by name):
    what mlx-lm's yields, ``(token, logprobs [V])`` for ``max_tokens``
    tokens, never stopping at an end-of-sequence token (its caller does)."""
    model, prompt = bound["model"], bound["prompt"]
    draft = None if is_auto(plugin.draft) else plugin.draft
    options = options_of(
        model,
        draft,
        plugin.num_draft_tokens,
        plugin.max_ngram,
        DEFAULT_TUNING,
        bound,
    )
    stats = plugin.last_stats = SpecStats()
    try:
        if not options.speculates:  # draft="none": mlx-lm's decoding
            yield from plain_generate_step(**bound)
            return
        cache = bound.get("prompt_cache")
        session = Session(model, options, prompt_cache=cache, stats=stats)
        measure_for_auto(model, options, stats, session.decoder.drafter)
        steps = on_stream(
            bound.get("stream", generation_stream),
            session.generate(
                prompt,
                max_tokens=bound.get("max_tokens", 256),
                sampler=bound.get("sampler"),
                logits_processors=bound.get("logits_processors"),
                prompt_progress_callback=bound.get("prompt_progress_callback"),
                # mlx-lm leaves a caller's cache holding every token it
                # yielded; a cache of the call's own is dropped unflushed
                flush=cache is not None,
            ),
        )
        try:
            for token, logprobs, _ in steps:
                yield token, logprobs
        finally:  # a caller that stops early: the caches keep what it read
            steps.close()
    finally:
        _add(plugin.total, stats)


def _add(total: SpecStats, stats: SpecStats) -> None:
    total.verify_passes += stats.verify_passes
    total.drafted += stats.drafted
    total.accepted += stats.accepted
    total.generated += stats.generated


def _decide(args, kwargs) -> Coverage:
    """The coverage of a call given as mlx-lm's arguments (a call that does
    not fit mlx-lm's signature is left to mlx-lm, which says why)."""
    try:
        bound = _SIGNATURE.bind(*args, **kwargs).arguments
    except TypeError:
        return Coverage(False, "arguments: not mlx-lm's signature")
    return coverage(
        bound.get("model"),
        bound.get("prompt"),
        bound.get("max_tokens", 256),
        bound.get("draft_model"),
        bound.get("kwargs", {}),
    )


def _decide_step(args, kwargs) -> Coverage:
    """The coverage of a ``generate_step`` call given as mlx-lm's
    arguments."""
    try:
        bound = _STEP_SIGNATURE.bind(*args, **kwargs).arguments
    except TypeError:
        return Coverage(False, "arguments: not mlx-lm's signature")
    rest = {
        k: v for k, v in bound.items() if k not in ("prompt", "model", "max_tokens")
    }
    return step_coverage(
        bound.get("model"), bound.get("prompt"), bound.get("max_tokens", 256), rest
    )


# functools.wraps gives mlx-lm's signature and docstring to help() and
# inspect; the module is the package's (where users find them) and the name
# this module's, so that a traceback or a repr says whose function runs.
for _routed in (routed_load, routed_stream_generate, routed_generate_step):
    _routed.__module__ = __name__.rpartition(".")[0]
    _routed.__name__ = _routed.__qualname__ = _routed.__code__.co_name
