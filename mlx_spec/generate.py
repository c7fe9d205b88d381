"""mlx-lm compatible ``stream_generate`` / ``generate`` with speculative decoding."""

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import mlx.core as mx
import numpy as np

from .core.policy_tuning import DEFAULT_TUNING, PolicyTuning
from .core.policy import checked_cost_profile
from .core.verify_profile import head_step_cost
from .core.stats import SpecStats
from .drafters import calls, default_draft
from .drafters.base import MAX_DRAFT_TOKENS
from .loading import use_draft_model
from .mlx_lm_compat import (
    GenerationResponse,
    TokenizerWrapper,
    generate_step,
    generation_stream,
    wired_limit,
)
from .session import (
    DecodeOptions,
    KVQuantization,
    Session,
    check_max_tokens,
    is_integer,
)

# Arguments of mlx-lm's generate_step that only plain decoding supports.
PLAIN_ONLY = ("max_kv_size", "input_embeddings")
# Those speculative decoding takes (the cache options are in the session's).
SPECULATIVE_ARGUMENTS = (
    "max_tokens",
    "sampler",
    "logits_processors",
    "prompt_progress_callback",
    "prompt_cache",
    "prefill_step_size",
    "kv_bits",
    "kv_group_size",
    "quantized_kv_start",
)


@dataclass
class SpecGenerationResponse(GenerationResponse):
    """A ``GenerationResponse`` that also carries the run's speculation counters."""

    stats: Optional[SpecStats] = None


def vocab_size(model) -> int:
    """Rows of the model's input embedding: the ids it can take."""
    owner = getattr(model, "language_model", model)
    return owner.model.embed_tokens.weight.shape[0]


def check_token_ids(ids: List[int], vocab: int):
    """``ValueError`` naming the first id outside ``0..vocab-1``."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(
            f"token id {bad} is outside the model's vocabulary of {vocab} ids (0..{vocab - 1})"
        )


def _encode(model, tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """The prompt as [N] uint32 ids, checked against the model's vocabulary.

    Takes what ``mlx_lm.stream_generate`` takes (a string, an ``mx.array``
    or NumPy array of ids, a list of ids, NumPy integers included); anything
    else is a ``TypeError`` naming its type."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    if isinstance(prompt, np.ndarray):
        prompt = mx.array(prompt)
    if not isinstance(prompt, (mx.array, list, tuple)):
        raise TypeError(
            "prompt must be a string, a list of token ids or an mx.array / NumPy "
            f"array of them, got {type(prompt).__name__}"
        )
    if not isinstance(prompt, mx.array):
        bad = next((t for t in prompt if not is_integer(t)), None)
        if bad is not None:
            raise ValueError(f"token ids must be integers, got {bad!r:.60}")
        ids = [int(t) for t in prompt]  # NumPy integers too
        prompt = mx.array(ids, mx.int64) if ids else mx.array([])
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(
            f"prompt must be a non-empty 1-D sequence of token ids, got shape {prompt.shape}"
        )
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise ValueError(f"token ids must be integers, got an array of {prompt.dtype}")
    check_token_ids(prompt.tolist(), vocab_size(model))
    return prompt.astype(mx.uint32)


def options_of(
    model, draft, num_draft_tokens, max_ngram, tuning, kwargs
) -> DecodeOptions:
    """The :class:`DecodeOptions` of a ``stream_generate`` call (``kwargs``:
    mlx-lm's, read, not taken: plain decoding passes them on)."""
    given = {"rollback": kwargs["rollback"]} if "rollback" in kwargs else {}
    if kwargs.get("prefill_step_size") is not None:
        given["prefill_step_size"] = kwargs["prefill_step_size"]
    if kwargs.get("kv_bits") is not None:
        kv = {"bits": kwargs["kv_bits"]}
        for name, field in (
            ("kv_group_size", "group_size"),
            ("quantized_kv_start", "start"),
        ):
            if kwargs.get(name) is not None:
                kv[field] = kwargs[name]
        given["kv"] = KVQuantization(**kv)
    return DecodeOptions(
        draft=default_draft(model) if draft is None else draft,
        num_draft_tokens=num_draft_tokens,
        max_ngram=max_ngram,
        tuning=tuning,
        **given,
    )


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft=None,
    num_draft_tokens="auto",
    max_ngram: int = 3,
    stats: Optional[SpecStats] = None,
    timing: bool = False,
    session: Optional[Session] = None,
    tuning: PolicyTuning = DEFAULT_TUNING,
    **kwargs,
):
    """Like ``mlx_lm.stream_generate``, drafting with ``draft`` and verifying.

    ``draft`` is a drafter name (``"none"``, ``"ngram"``, ``"mtp"``,
    ``"mtp+ngram"``; default: ``mtp+ngram`` when the model has an MTP head,
    else ``ngram``) or an object with ``reset(prompt, hidden)``, ``draft(k)``
    and ``accept(tokens, hidden)``. ``draft_model``: a DFlash drafter (a
    path, a repo id or :func:`~mlx_spec.loading.load_drafter`'s result) for
    ``draft="dflash"`` (the default when it is given).

    Yields ``SpecGenerationResponse`` (a ``GenerationResponse``) objects;
    ``from_draft`` is True for tokens that were drafted and accepted. Extra
    keyword arguments are those of ``mlx_lm.generate_step``. ``draft="none"``
    (or ``num_draft_tokens=0``) is plain mlx-lm decoding.

    ``session``: a :class:`~mlx_spec.Session` to continue (its caches,
    drafter, history, statistics and options; ``draft``, ``num_draft_tokens``,
    ``max_ngram``, ``stats``, ``tuning`` and the cache options are then
    unused): ``prompt`` holds only the new tokens, and at the end the caches
    hold every token, as a reused mlx-lm prompt cache does.

    ``tuning``: the constants of ``num_draft_tokens="auto"`` (a
    :class:`~mlx_spec.core.policy_tuning.PolicyTuning`; experiments build
    variants of the default with ``dataclasses.replace``).
    """
    check_max_tokens(max_tokens)
    draft_model = kwargs.pop("draft_model", None)
    if draft_model is not None:
        if session is not None:
            raise ValueError("draft_model is a new session's; a session has its own")
        draft = "dflash" if draft is None else draft
        if draft != "dflash":
            raise ValueError(f"draft_model is read by draft='dflash', not {draft!r}")
        use_draft_model(model, draft_model)
    if session is None:
        options = options_of(model, draft, num_draft_tokens, max_ngram, tuning, kwargs)
    else:
        options, stats = session.options, session.stats
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode(model, tokenizer, prompt)
    stats = SpecStats() if stats is None else stats
    stream = kwargs.pop("stream", generation_stream)
    kwargs.pop("num_draft_tokens", None)
    kwargs.pop("rollback", None)
    kwargs["max_tokens"] = max_tokens

    if session is None and not options.speculates:
        tokens = generate_step(prompt, model, stream, **kwargs)
        tokens = ((t, lp, False) for t, lp in tokens)
    else:
        used = [k for k in PLAIN_ONLY if kwargs.get(k) is not None]
        if used:
            raise ValueError(
                f"{', '.join(used)} is not supported with speculative decoding "
                f"(draft={options.draft!r}); use draft='none'"
            )
        unknown = sorted(set(kwargs) - set(SPECULATIVE_ARGUMENTS + PLAIN_ONLY))
        if unknown:  # what mlx-lm's generate_step would refuse too
            raise TypeError(
                f"stream_generate() got an unexpected keyword argument {unknown[0]!r}"
            )
        # mlx-lm leaves a caller's cache holding every token it yielded
        flush = session is not None or kwargs.get("prompt_cache") is not None
        if session is None:
            cache = kwargs.get("prompt_cache")
            session = Session(model, options, prompt_cache=cache, stats=stats)
        measure_for_auto(model, options, stats, session.decoder.drafter)
        tokens = on_stream(
            stream,
            session.generate(
                prompt,
                max_tokens=max_tokens,
                sampler=kwargs.get("sampler"),
                logits_processors=kwargs.get("logits_processors"),
                prompt_progress_callback=kwargs.get("prompt_progress_callback"),
                stop_tokens=tokenizer.eos_token_ids,
                timing=timing,
                flush=flush,
            ),
        )
    yield from _responses(model, tokenizer, prompt, tokens, max_tokens, stream, stats)


def measure_for_auto(
    model, options: DecodeOptions, stats: SpecStats, drafter=None
) -> None:
    """Under ``num_draft_tokens="auto"``, the verify costs it decides from
    (as deep as ``drafter``'s ``auto`` drafts go) and what its own draft
    forward costs, measured before the prompt is fed so that their time is
    not the prompt's (once per machine, MLX version and model, then read
    from disk); the seconds go to ``stats.profile_seconds``."""
    if options.num_draft_tokens == "auto":
        tic = time.perf_counter()
        tokens = 1 + min(calls.max_auto_draft(drafter), MAX_DRAFT_TOKENS)
        checked_cost_profile(model, options.tuning, tokens), head_step_cost(model)
        calls.draft_forward_cost(drafter)
        stats.profile_seconds = time.perf_counter() - tic


def on_stream(stream, generator):
    """Run each step of ``generator`` (and its closing) with ``stream`` as the
    default stream."""
    return steps_within(lambda: mx.stream(stream), generator)


def steps_within(context: Callable, generator):
    """What ``generator`` yields, each of its steps (and its closing) run
    inside a fresh ``context()``, never across a ``yield``: the caller's code
    between two items runs outside it."""
    try:
        while True:
            with context():
                try:
                    item = next(generator)
                except StopIteration:
                    return
            yield item
    finally:
        with context():
            generator.close()


def _responses(model, tokenizer, prompt, tokens, max_tokens, stream, stats):
    """Detokenize and time ``(token, logprobs, from_draft)`` like mlx-lm does.

    ``tokens`` is closed before the last response (and when the caller stops
    early), so the caches hold exactly the tokens that were yielded.
    """
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = tokenizer.eos_token_ids

    def response(token, logprobs, from_draft, n, finish_reason=None):
        return SpecGenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
            stats=stats,
        )

    with wired_limit(model, [stream]):
        try:
            tic = time.perf_counter()
            for n, (token, logprobs, from_draft) in enumerate(tokens):
                if n == 0:
                    prompt_tps = prompt.size / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                if token in eos:
                    break
                detokenizer.add_token(token)
                if n + 1 == max_tokens:
                    break
                yield response(token, logprobs, from_draft, n)
            tokens.close()
            detokenizer.finalize()
            reason = "stop" if token in eos else "length"
            yield response(token, logprobs, from_draft, n, reason)
        finally:
            tokens.close()


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response; prints text, timing and speculation
    statistics with ``verbose``. Keyword arguments are ``stream_generate``'s."""
    stats = kwargs.setdefault("stats", SpecStats())
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        print(
            f"Prompt: {response.prompt_tokens} tokens, "
            f"{response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        if stats.profile_seconds:
            print(
                f"Verify-cost profile: {stats.profile_seconds:.3f} s (measured once "
                "per machine, MLX version and model, then read from disk)"
            )
        if stats.verify_passes:
            print(stats.summary())
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
