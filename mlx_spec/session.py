"""One way to open a decoding session: :class:`Session`.

A session is one sequence being decoded speculatively: the drafter (named,
or a user's object), the :class:`~mlx_spec.core.sequence.SpeculativeDecoder`
that owns its caches and history, and, when it continues a kept conversation,
the state restored into it. Before each prompt is fed, the drafter is told
how the target will choose its tokens (:meth:`Session.set_sampling`): that
decides which of the prompt's rows it judges in hindsight, and under
``num_draft_tokens="auto"`` judging is turned on there, so the draft-length
policy starts from the prompt's evidence. ``stream_generate``, ``chat``, the
server's engine, ``bench`` and the doctor all open their sequences here, so a
request the server batches starts from the same evidence as a lone
generation of the same prompt.

The options are a :class:`DecodeOptions` value, checked when it is made:
a bad one is refused naming the value, before any state exists.
"""

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, List, Optional, Tuple, Union

import mlx.core as mx

from .core.batch import RowOptions
from .core.decode import LoopOptions, decode_steps
from .core.policy import most_drafts
from .core.policy_tuning import DEFAULT_TUNING, PolicyTuning
from .core.sampling import make_draft_sampler, make_sampler, verification_of
from .core.sequence import SpeculativeDecoder
from .core.state import ROLLBACK_STRATEGIES
from .core.stats import SpecStats
from .drafters import (
    NO_DRAFTER,
    calls,
    draft_names,
    make_drafter,
    max_draft_of,
)
from .drafters.base import MAX_DRAFT_TOKENS, is_drafter
from .loading import use_draft_model
from .mlx_lm_compat import DEFAULT_QUANTIZED_KV_START
from .states.snapshot import DecoderState, restore

__all__ = ["DecodeOptions", "KVQuantization", "Session", "check_max_tokens"]


@dataclass(frozen=True)
class KVQuantization:
    """The attention caches quantized as mlx-lm quantizes them (its
    ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``)."""

    bits: int
    group_size: int = 64
    start: int = DEFAULT_QUANTIZED_KV_START


@dataclass(frozen=True)
class DecodeOptions:
    """How a session decodes; every field is checked when the value is made
    (``ValueError`` naming the bad value).

    ``draft``: a drafter name (``none``, ``ngram``, ``mtp``, ``mtp+ngram``)
    or a drafter object (``reset``/``draft``/``accept``);
    ``num_draft_tokens``: ``"auto"`` or 0..16 (1..8 for the MTP drafters);
    ``max_ngram``: the longest n-gram the lookup drafter matches;
    ``rollback``: how Gated-DeltaNet layers are rolled back (``store``,
    ``replay``); ``prefill_step_size``: tokens per prefill chunk;
    ``kv``: the attention caches' quantization (None: full precision);
    ``tuning``: the constants of ``auto``.
    """

    draft: Union[str, Any]
    num_draft_tokens: Union[int, str] = "auto"
    max_ngram: int = 3
    rollback: str = "store"
    prefill_step_size: int = 2048
    kv: Optional[KVQuantization] = None
    tuning: PolicyTuning = DEFAULT_TUNING

    def __post_init__(self):
        if self.rollback not in ROLLBACK_STRATEGIES:
            raise ValueError(
                f"unknown rollback strategy {self.rollback!r}; use one of "
                f"{ROLLBACK_STRATEGIES}"
            )
        draft, k = self.draft, self.num_draft_tokens
        names = draft_names()
        if not (draft in names if isinstance(draft, str) else is_drafter(draft)):
            raise ValueError(
                f"unknown draft {draft!r}; choose one of {', '.join(names)} "
                "or pass an object with reset/draft/accept methods"
            )
        if k != "auto" and (not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS):
            raise ValueError(
                f"num_draft_tokens must be 'auto' or an integer in "
                f"0..{MAX_DRAFT_TOKENS}, got {k!r}"
            )
        most = max_draft_of(draft) if isinstance(draft, str) else MAX_DRAFT_TOKENS
        if k != "auto" and k > most:
            raise ValueError(
                f"draft {draft!r} drafts 1..{most} tokens per pass, got {k}"
            )
        if not isinstance(self.tuning, PolicyTuning):
            raise ValueError(
                f"tuning must be a PolicyTuning, got {type(self.tuning).__name__}"
            )
        step = self.prefill_step_size
        if not (is_integer(step) and step >= 1):
            raise ValueError(f"prefill_step_size must be an integer >= 1, got {step!r}")

    @property
    def speculates(self) -> bool:
        """Whether a pass may verify drafts (else: plain decoding)."""
        return self.draft != NO_DRAFTER and self.num_draft_tokens != 0

    @property
    def max_draft(self) -> int:
        """The most tokens a pass of this session drafts (at least one: the
        caches are sized for a draft)."""
        return max(most_drafts(self.num_draft_tokens), 1)


def is_integer(value) -> bool:
    """An integer (NumPy's too), not a bool: a token id, a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_max_tokens(max_tokens):
    """``ValueError`` unless ``max_tokens`` is a positive integer."""
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")


class Session:
    """One sequence opened for speculative decoding.

    Builds the drafter ``options.draft`` names (or takes the drafter object
    given), the decoder (``prompt_cache``: an mlx-lm prompt cache to decode
    in, updated in place; ``stats``: the counters to add to), and restores
    ``state`` into it (a conversation kept earlier; ``ValueError`` when it
    does not fit, before the session exists). A state the caller keeps
    using afterwards is passed as :func:`~mlx_spec.states.snapshot.shared`
    of it. :meth:`generate` continues the sequence by a prompt's tokens.
    ``draft_model``: a DFlash drafter for ``draft="dflash"`` (a path, a repo
    id or :func:`~mlx_spec.loading.load_drafter`'s result), attached to
    ``model`` for every later ``dflash`` session of it.
    """

    def __init__(
        self,
        model,
        options: DecodeOptions,
        *,
        prompt_cache: Optional[List[Any]] = None,
        state: Optional[DecoderState] = None,
        stats: Optional[SpecStats] = None,
        draft_model=None,
    ):
        draft = options.draft
        if draft_model is not None:
            if draft != "dflash":
                raise ValueError(
                    f"draft_model is read by draft='dflash', not {draft!r}"
                )
            use_draft_model(model, draft_model)
        if isinstance(draft, str):
            drafter = make_drafter(draft, model, max_ngram=options.max_ngram)
        else:
            drafter = draft
        most = getattr(drafter, "max_draft", None)  # a drafter's own bound
        k = options.num_draft_tokens
        if most is not None and k != "auto" and k > most:
            raise ValueError(
                f"draft {drafter.name!r} drafts 1..{most} tokens per pass, got {k}"
            )
        kv = options.kv
        quantized = {}
        if kv is not None:
            quantized = dict(
                kv_bits=kv.bits,
                kv_group_size=kv.group_size,
                quantized_kv_start=kv.start,
            )
        self.options = options
        max_draft = options.max_draft
        if k == "auto" and drafter is not None:  # as deep as its drafter says
            deepest = min(calls.max_auto_draft(drafter), MAX_DRAFT_TOKENS)
            max_draft = max(max_draft, deepest)
        self.decoder = SpeculativeDecoder(
            model,
            drafter,
            max_draft,
            rollback=options.rollback,
            prompt_cache=prompt_cache,
            prefill_step_size=options.prefill_step_size,
            stats=SpecStats() if stats is None else stats,
            **quantized,
        )
        if state is not None:
            self.restore(state)

    def restore(self, state: DecoderState):
        """Continue ``state`` (kept by a decoder of the same model and
        drafter kind), in this session before anything is fed;
        ``ValueError`` saying what does not fit (the session unchanged)."""
        if self.decoder.history:
            raise ValueError("a state is restored before anything is fed")
        restore(self.decoder, state)

    @property
    def stats(self) -> SpecStats:
        return self.decoder.stats

    @property
    def history(self) -> List[int]:
        """Every token of the sequence so far."""
        return self.decoder.history

    def set_sampling(
        self,
        sampler: Optional[Callable[[mx.array], mx.array]],
        logits_processors: Optional[List[Callable]],
        seen: List[int],
    ):
        """Tell the drafter how the target will choose the next tokens
        (``sampler``, None: greedy; ``logits_processors``, which see ``seen``
        and the tokens after it), before a prompt is fed: which of its rows
        the drafter judges in hindsight depends on it. Under ``auto`` judging
        is turned on here, so the policy learns from the prompt's rows."""
        drafter = self.decoder.drafter
        if drafter is None:
            return
        chosen_by = sampler or make_sampler(0.0)
        verification = verification_of(chosen_by)
        choose = make_draft_sampler(chosen_by, logits_processors, seen, verification)
        calls.set_sampling(drafter, choose)
        if self.options.num_draft_tokens == "auto":
            calls.judged(drafter)  # judging on from the prompt's rows

    def generate(
        self,
        prompt: Union[mx.array, List[int]],
        *,
        max_tokens: int = 256,
        sampler: Optional[Callable[[mx.array], mx.array]] = None,
        logits_processors: Optional[List[Callable]] = None,
        stop_tokens: Collection[int] = (),
        should_stop: Callable[[], bool] = lambda: False,
        prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
        verify_costs: Optional[List[float]] = None,
        timing: bool = False,
        flush: bool = False,
    ) -> Iterator[Tuple[int, mx.array, bool]]:
        """Feed ``prompt`` (token ids: a first prompt, or the next turn's
        tokens) and yield ``(token, logprobs [V], from_draft)`` as mlx-lm's
        ``generate_step`` does, until a ``stop_tokens`` token, ``max_tokens``
        tokens, or the pass during which ``should_stop()`` became true.
        Logits processors see this call's tokens and those it generates, as
        mlx-lm's do with a prompt cache. Afterwards the last token is
        pending (``flush``: processed too, as mlx-lm leaves a prompt cache);
        a caller that stops early keeps exactly the tokens it read.
        ``verify_costs``: the verify costs ``auto`` decides from (default:
        the measured profiles); ``timing``: fill ``stats.phases``."""
        tokens = (
            prompt.tolist()
            if isinstance(prompt, mx.array)
            else [int(t) for t in prompt]
        )
        self.set_sampling(sampler, logits_processors, tokens)
        row = RowOptions(
            max_tokens,
            sampler,
            self.options.num_draft_tokens,
            verify_costs,
            stop_tokens,
            logits_processors,
            seen=tokens,  # processors see this call's tokens, as mlx-lm's do
        )
        loop = LoopOptions(
            should_stop, prompt_progress_callback, flush, timing, self.options.tuning
        )
        yield from decode_steps(self.decoder, tokens, row, loop)
