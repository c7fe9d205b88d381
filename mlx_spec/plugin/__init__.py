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
holds). The routed functions themselves are in :mod:`mlx_spec.plugin.routed`.
"""

import os
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

from ..mlx_lm_compat import (
    MLX_LM_VERSION,
    PLUGIN_MODULES,
    PLUGIN_TESTED_MLX_LM,
    generate_step as plain_generate_step,
    load as plain_load,
    plain_stream_generate,
    plugin_modules,
    server_response_generator,
)
from ..session import DecodeOptions
from .coverage import Coverage, coverage, step_coverage
from .routed import (
    Plugin,
    active,
    batchable_unless_covered,
    is_auto,
    routed_generate_step,
    routed_load,
    routed_stream_generate,
    set_active,
)

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
    "routed_load",
    "routed_stream_generate",
    "routed_generate_step",
]

_NAME = "stream_generate"
_STEP = "generate_step"
_LOAD = "load"
_BATCHABLE = "_is_batchable"

_lock = threading.Lock()


def is_enabled() -> bool:
    return active() is not None


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
    # Checked now, not at the first call: the named drafter exists, the
    # length fits it ("auto" may draft with a head: the MTP drafters' bound).
    DecodeOptions(
        draft="mtp+ngram" if is_auto(draft) else draft,
        num_draft_tokens=num_draft_tokens,
        max_ngram=max_ngram,
    )
    _warn_untested()
    with _lock:
        plugin = Plugin(draft, num_draft_tokens, max_ngram)
        # Enabling again also reaches mlx-lm modules imported since.
        current = active()
        plugin._replaced = _install(current._replaced if current else [])
        set_active(plugin)
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


def disable() -> None:
    """Put back every mlx-lm object :func:`enable` replaced; a no-op when
    the plugin is off."""
    with _lock:
        current = active()
        if current is None:
            return
        for owner, name, original in reversed(current._replaced):
            setattr(owner, name, original)
        set_active(None)


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
        setattr(generator, _BATCHABLE, batchable_unless_covered(original))
    return replaced


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
