"""Lossless speculation under mlx-lm's own tools: :func:`enable` /
:func:`disable`.

:func:`enable` puts its own function in place of mlx-lm's
``stream_generate`` in every loaded mlx-lm module that holds mlx-lm's
(``mlx_lm.generate``, where ``generate`` and the ``generate`` command look
it up; ``mlx_lm``; the chat and server commands, which imported the name),
of ``generate_step`` likewise (``mlx_lm.generate``, and ``cache_prompt``
once loaded), and for ``load`` in those four. Each ``stream_generate`` call
is judged by :func:`~mlx_spec.plugin.coverage.coverage`: a covered call runs
mlx-spec's ``stream_generate`` (one :class:`~mlx_spec.Session`), which yields
mlx-lm's ``GenerationResponse`` fields (plus ``stats``, the call's
speculation counters); any other call runs mlx-lm's own function with the
arguments it was given. A covered ``generate_step`` call (a script driving
the token loop itself) yields mlx-lm's ``(token, logprobs)`` pairs from one
session; any other returns mlx-lm's own generator. mlx-lm's
``stream_generate`` finds ``generate_step`` in its module when it runs: for
the calls left to it, that is mlx-lm's own again. ``load`` returns what
mlx-lm's returns, a covered model with its MTP head attached.
``mlx_lm.server`` batches requests only on its ``BatchGenerator`` path,
which never speculates: while enabled, a request for a covered model takes
the server's per-request path (``stream_generate``) instead.

:func:`disable` puts mlx-lm's own objects back (the same objects: ``is``
holds).
"""

import collections
import contextlib
import functools
import inspect
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Counter, Dict, List, Optional, Tuple, Union

from ..core.policy_tuning import DEFAULT_TUNING
from ..core.stats import SpecStats
from ..generate import measure_for_auto, on_stream, options_of, steps_within
from ..generate import stream_generate as spec_stream_generate
from ..mlx_lm_compat import (
    MLX_LM_VERSION,
    PLUGIN_MODULES,
    PLUGIN_TESTED_MLX_LM,
    generate_step as plain_generate_step,
    generation_stream,
    load as plain_load,
    plain_stream_generate,
    plugin_modules,
    server_response_generator,
)
from ..session import DecodeOptions, Session
from .coverage import Coverage, coverage, model_coverage, step_coverage
from .loading import ready_for_speculation

__all__ = [
    "enable",
    "enable_from_environment",
    "disable",
    "is_enabled",
    "report",
    "Plugin",
    "Coverage",
    "coverage",
    "step_coverage",
]

_NAME = "stream_generate"
_STEP = "generate_step"
_LOAD = "load"
_BATCHABLE = "_is_batchable"
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


_lock = threading.Lock()
_active: Optional[Plugin] = None


def is_enabled() -> bool:
    return _active is not None


def enable(
    draft: Any = "auto",
    num_draft_tokens: Union[int, str] = "auto",
    max_ngram: int = 3,
) -> Plugin:
    """Route mlx-lm's ``stream_generate`` (and so ``generate``, ``chat`` and
    ``server``) and ``generate_step`` through mlx-spec for the models and
    calls it covers.

    ``draft``: ``"auto"`` (the MTP head with n-gram copies when the model
    has a head, else n-gram) or a drafter name or object, as
    :class:`~mlx_spec.DecodeOptions` takes; ``num_draft_tokens``: ``"auto"``
    or a fixed draft length (1..8 with ``draft="auto"``, which may draft
    with an MTP head). Options are checked here (``ValueError``).
    Enabling again replaces the options and keeps the routing. Returns the
    :class:`Plugin` whose counters the calls update.
    """
    global _active
    # Checked now, not at the first call: the named drafter exists, the
    # length fits it ("auto" may draft with a head: the MTP drafters' bound).
    DecodeOptions(
        draft="mtp+ngram" if _is_auto(draft) else draft,
        num_draft_tokens=num_draft_tokens,
        max_ngram=max_ngram,
    )
    _warn_untested()
    with _lock:
        plugin = Plugin(draft, num_draft_tokens, max_ngram)
        # Enabling again also reaches mlx-lm modules imported since.
        plugin._replaced = _install(_active._replaced if _active else [])
        _active = plugin
    return plugin


def enable_from_environment(environ: Optional[Dict[str, str]] = None) -> Plugin:
    """:func:`enable` with the options of the environment (``environ``,
    default ``os.environ``), as the plugin's command and its switch take
    them: ``MLX_SPEC_DRAFT`` (default ``auto``) and
    ``MLX_SPEC_NUM_DRAFT_TOKENS`` (``auto`` or an integer; anything else is
    a ``ValueError`` naming the variable)."""
    environ = os.environ if environ is None else environ
    text = environ.get("MLX_SPEC_NUM_DRAFT_TOKENS", "auto")
    if text != "auto" and not text.isdigit():
        raise ValueError(
            f"MLX_SPEC_NUM_DRAFT_TOKENS must be 'auto' or an integer, got {text!r:.40}"
        )
    return enable(
        draft=environ.get("MLX_SPEC_DRAFT", "auto"),
        num_draft_tokens=text if text == "auto" else int(text),
    )


def _is_auto(draft) -> bool:
    return isinstance(draft, str) and draft == "auto"


def disable() -> None:
    """Put back every mlx-lm object :func:`enable` replaced; a no-op when
    the plugin is off."""
    global _active
    with _lock:
        if _active is None:
            return
        for owner, name, original in reversed(_active._replaced):
            setattr(owner, name, original)
        _active = None


def _install(replaced: List[Tuple[Any, str, Any]]) -> List[Tuple[Any, str, Any]]:
    """Replace every mlx-lm object still in place; ``replaced`` (what an
    earlier call replaced) with the new replacements appended."""
    replaced = list(replaced)
    for module in plugin_modules():
        for name, original, routed in (
            (_NAME, plain_stream_generate, routed_stream_generate),
            (_STEP, plain_generate_step, routed_generate_step),
            (_LOAD, plain_load, routed_load),
        ):
            # load: only where the generation tools and scripts find it, not
            # in mlx_lm.utils, whence convert, fuse and the quantizers import
            # it (a model they save must be exactly the one mlx-lm loads).
            if name == _LOAD and module.__name__ not in PLUGIN_MODULES:
                continue
            if getattr(module, name, None) is original:
                replaced.append((module, name, original))
                setattr(module, name, routed)
    generator = server_response_generator()
    if generator is None:
        warnings.warn(
            f"mlx_spec.plugin: mlx-lm {MLX_LM_VERSION}'s server has no batching "
            "test to turn off; its batched requests are not speculated on",
            stacklevel=3,
        )
    elif not any(owner is generator for owner, _, _ in replaced):
        original = generator.__dict__[_BATCHABLE]
        replaced.append((generator, _BATCHABLE, original))
        setattr(generator, _BATCHABLE, _batchable_unless_covered(original))
    return replaced


def _batchable_unless_covered(original: Callable) -> Callable:
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
            draft=None if _is_auto(plugin.draft) else plugin.draft,
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
    draft = None if _is_auto(plugin.draft) else plugin.draft
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
        measure_for_auto(model, options, stats)
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


def report(plugin: Plugin) -> str:
    """One line: the calls speculated on, those left to mlx-lm (and why),
    the drafts accepted."""
    covered = plugin.decisions.get("covered", 0)
    others = sum(plugin.decisions.values()) - covered
    line = f"mlx_spec.plugin: {covered} call(s) speculated"
    if others:
        why = "; ".join(r for r in plugin.decisions if r != "covered")
        line += f", {others} run by mlx-lm ({why})"
    total = plugin.total
    if total.verify_passes:
        line += (
            f"; {total.accepted}/{total.drafted} drafted tokens accepted, "
            f"{total.tokens_per_pass:.2f} tokens per pass"
        )
    return line


# functools.wraps gives mlx-lm's signature and docstring to help() and
# inspect; the module and name stay this module's, so that a traceback or a
# repr says whose function runs.
for _routed in (routed_load, routed_stream_generate, routed_generate_step):
    _routed.__module__ = __name__
    _routed.__name__ = _routed.__qualname__ = _routed.__code__.co_name


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


_warned = False


def _warn_untested() -> None:
    """Warn once when mlx-lm's version is not one the plugin was tested
    with: the routing still installs (it replaces one function by name), but
    an mlx-lm that changed its loop may differ from what was checked."""
    global _warned
    if _warned or MLX_LM_VERSION in PLUGIN_TESTED_MLX_LM:
        return
    _warned = True
    warnings.warn(
        f"mlx_spec.plugin was tested with mlx-lm {' and '.join(PLUGIN_TESTED_MLX_LM)}; "
        f"mlx-lm {MLX_LM_VERSION} is installed",
        stacklevel=3,
    )
