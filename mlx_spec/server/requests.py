"""Request bodies checked and turned into :class:`GenerationParams` (their
prompts: :mod:`mlx_spec.server.prompts`).

Everything a client sends is checked here, before it reaches the model: a bad
value is a :class:`RequestError` naming the field (HTTP 400), never an
exception deeper down. Nothing in a request names a file or a model to load:
``model`` must be the served model's id (or omitted).
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..drafters import draft_names
from ..drafters.base import MAX_DRAFT_TOKENS
from ..mlx_lm_compat import PENALTIES
from .events import GenerationParams

MAX_TOP_LOGPROBS = 20
MAX_TOKENS_LIMIT = 32768  # the default ceiling on a reply's tokens


class RequestError(Exception):
    """Bad input: reported to the client with ``status`` and the message."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class ServerContext:
    """What request parsing needs to know about the server."""

    tokenizer: Any
    model_id: str
    defaults: Dict[str, Any]  # temperature, top_p, top_k, min_p, max_tokens
    context_length: Optional[int] = None
    max_tokens_limit: int = MAX_TOKENS_LIMIT  # no reply is longer
    vocab_size: Optional[int] = None  # the model's logits (token ids below it)
    chat_template_args: Optional[Dict[str, Any]] = None


def _number(value) -> bool:
    """A finite JSON number (Python's json module also reads NaN, Infinity).
    An integer of any size is one: it is compared with bounds exactly, never
    converted to a float (which a large one would overflow)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)


_KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": _number,
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}


def field(body, name, kind, default=None, low=None, high=None):
    """``body[name]`` checked: ``kind`` is "int", "number", "bool", "str",
    "list" or "dict"; ``low``/``high`` bound numbers (inclusive)."""
    value = body.get(name, default)
    if value is None:
        return default
    if not _KINDS[kind](value):
        raise RequestError(
            f"'{name}' must be of type {kind}, got {value!r:.40}", param=name
        )
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise RequestError(f"'{name}' must be {bounds}, got {value!r:.40}", param=name)
    return value


def check_unsupported(body):
    if field(body, "n", "int", 1) != 1:
        raise RequestError("only 'n': 1 is supported", param="n")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(
            "only the 'text' response_format is supported", param="response_format"
        )


def check_model(body, ctx: ServerContext):
    model = field(body, "model", "str")
    if model not in (None, ctx.model_id, "default_model"):
        raise RequestError(
            f"model {model!r} is not served here; this server serves {ctx.model_id!r}",
            status=404,
            param="model",
        )


def generation_params(body, ctx: ServerContext, max_tokens_field="max_tokens"):
    """The sampling, stopping and drafting fields common to every endpoint."""
    d = ctx.defaults
    return GenerationParams(
        max_tokens=max_tokens(body, ctx, max_tokens_field),
        temperature=temperature(body, d["temperature"]),
        top_p=field(body, "top_p", "number", d["top_p"], low=0, high=1),
        top_k=top_k(body, ctx),
        min_p=field(body, "min_p", "number", d["min_p"], low=0, high=1),
        xtc_probability=field(body, "xtc_probability", "number", 0.0, low=0, high=1),
        xtc_threshold=field(body, "xtc_threshold", "number", 0.1, low=0, high=0.5),
        seed=field(body, "seed", "int", low=0, high=MAX_SEED),
        stop=stop_words(body),
        draft=draft(body),
        num_draft_tokens=num_draft_tokens(body),
    )


def max_tokens(body, ctx: ServerContext, name: str = "max_tokens") -> int:
    """The reply's budget: ``max_completion_tokens`` or ``name`` (an integer
    >= 1), capped at the server's ``max_tokens_limit``, never refused for
    being large (clients send their model's largest). The engine caps it
    again at what the prompt leaves of the model's context."""
    value = field(body, "max_completion_tokens", "int", None, low=1)
    if value is None:
        value = field(body, name, "int", ctx.defaults["max_tokens"], low=1)
    return min(value, ctx.max_tokens_limit)


MIN_TEMPERATURE = 1e-8  # below it, 1 / temperature leaves float32's range
MAX_TEMPERATURE = 100.0


def temperature(body, default: float) -> float:
    """0 (greedy), or a temperature whose inverse scales logits within
    float32 (a positive one too small overflows them to inf: not greedy
    but noise)."""
    value = field(body, "temperature", "number", default, low=0, high=MAX_TEMPERATURE)
    if 0 < value < MIN_TEMPERATURE:
        raise RequestError(
            f"'temperature' must be 0 (greedy) or in {MIN_TEMPERATURE:g}.."
            f"{MAX_TEMPERATURE:g}, got {value!r:.40}",
            param="temperature",
        )
    return value


def stop_words(body) -> List[str]:
    stop = body.get("stop", body.get("stop_sequences"))
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError("'stop' must be a string or a list of non-empty strings")
    return list(stop or [])


def draft(body) -> Optional[str]:
    value = field(body, "draft", "str")
    if value is not None and value not in draft_names():
        raise RequestError(
            f"'draft' must be one of {', '.join(draft_names())}, got {value!r:.40}",
            param="draft",
        )
    return value


def num_draft_tokens(body):
    value = body.get("num_draft_tokens")
    if value is not None and value != "auto":
        field(body, "num_draft_tokens", "int", low=0, high=MAX_DRAFT_TOKENS)
    return value


def top_k(body, ctx: ServerContext) -> int:
    """``top_k`` for the engine: 0 (every token) for 0, -1 (vLLM's "off")
    and any value not below the vocabulary size, where keeping the top k
    tokens keeps them all (vLLM clamps it so too; mlx-lm's sampler would
    refuse it in the middle of a batch). Without a known vocabulary size, at
    most ``MAX_TOP_K``."""
    high = MAX_TOP_K if ctx.vocab_size is None else None
    value = field(body, "top_k", "int", ctx.defaults["top_k"], low=-1, high=high)
    if value == -1 or ctx.vocab_size is not None and value >= ctx.vocab_size:
        return 0
    return value


MAX_BIAS = 100  # OpenAI's bound on a logit_bias value
MAX_SEED = 2**64 - 1  # MLX's random seed is an unsigned 64-bit integer
MAX_CONTEXT_SIZE = 2**31 - 1  # a penalty's window, in tokens
MAX_TOP_K = 2**31 - 1  # MLX indexes with 32-bit integers
# each penalty's range: (lowest, highest, lowest but 0 where 0 is "off")
PENALTY_RANGES = {
    # a factor dividing (or multiplying) seen tokens' logits; 0 is off
    "repetition_penalty": (0, 10, 0.01),
    # subtracted from seen tokens' logits: OpenAI's documented range
    "presence_penalty": (-2, 2, None),
    "frequency_penalty": (-2, 2, None),
}


def logits_processing(body, ctx: ServerContext) -> Dict[str, Any]:
    """The penalties and ``logit_bias`` of a request, as keyword arguments
    of mlx-lm's ``make_logits_processors`` (empty: none)."""
    args = {}
    for name, _, context in PENALTIES:
        low, high, least = PENALTY_RANGES[name]
        value = field(body, name, "number", low=low, high=high)
        if value and least is not None and value < least:
            raise RequestError(
                f"'{name}' must be 0 (off) or in {least}..{high}, got {value!r:.40}",
                param=name,
            )
        size = field(body, context, "int", low=1, high=MAX_CONTEXT_SIZE)
        if value:  # 0 is off, as in mlx_lm.server
            args[name] = value
            if size is not None:
                args[context] = size
    bias = field(body, "logit_bias", "dict")
    if bias:
        args["logit_bias"] = {}
        for key, value in bias.items():
            token = _bias_token(key, ctx.vocab_size)
            if not _number(value) or abs(value) > MAX_BIAS:
                raise RequestError(
                    f"'logit_bias' values must be numbers in -{MAX_BIAS}..{MAX_BIAS}"
                    f", got {value!r} for token {key}",
                    param="logit_bias",
                )
            args["logit_bias"][token] = float(value)
    return args


def _bias_token(key, vocab_size: Optional[int]) -> int:
    """A ``logit_bias`` key (a token id as a string) as an id of the model's."""
    if vocab_size is None:
        raise RequestError(
            "'logit_bias' is not available: the model's config gives no vocab_size",
            param="logit_bias",
        )
    if isinstance(key, str) and key.isdecimal() and len(key) <= 12:
        if int(key) < vocab_size:
            return int(key)
    raise RequestError(
        f"'logit_bias' keys must be token ids below {vocab_size}, got {key!r:.40}",
        param="logit_bias",
    )
