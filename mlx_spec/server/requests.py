"""Request bodies checked and turned into a prompt and :class:`GenerationParams`.

Everything a client sends is checked here, before it reaches the model: a bad
value is a :class:`RequestError` naming the field (HTTP 400), never an
exception deeper down. Nothing in a request names a file or a model to load:
``model`` must be the served model's id (or omitted).
"""

import copy
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..drafters import draft_names
from ..drafters.base import MAX_DRAFT_TOKENS
from ..mlx_lm_compat import PENALTIES, server_message_helpers
from .events import GenerationParams
from ..states.memory import common_prefix

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


def check_length(prompt: List[int], ctx: ServerContext):
    if not prompt:
        raise RequestError("the prompt is empty")
    if ctx.context_length is not None and len(prompt) >= ctx.context_length:
        raise RequestError(
            f"the prompt has {len(prompt)} tokens; this model accepts at most "
            f"{ctx.context_length - 1} (context length {ctx.context_length})",
            param="messages",
        )


def chat_prompt(messages, tools, ctx: ServerContext, template_kwargs=None):
    """``(prompt tokens, initial text state, shared)`` of a conversation: the
    chat template as mlx_lm.server applies it (with the tools), or, for a
    tokenizer without one, mlx_lm.server's plain role-prefixed text.
    ``shared``: for a first turn (system messages, then one user message), the
    prompt's tokens before that message, which every new conversation with
    the same system prompt and tools begins with; else 0."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a string 'role'",
                param="messages",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of parts",
                param="messages",
            )
        for j, part in enumerate(content if isinstance(content, list) else ()):
            _check_text_part(part, f"messages[{i}].content[{j}]")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    prompt = _render(messages, tools, ctx, template_kwargs)
    check_length(prompt, ctx)
    shared = _system_prefix(messages, tools, ctx, template_kwargs, prompt)
    return prompt, initial_state(ctx.tokenizer, prompt), shared


def _check_text_part(part, where: str):
    """A content part: ``{"type": "text", "text": "..."}`` (the only kind a
    text model's chat template is given)."""
    if not isinstance(part, dict):
        raise RequestError(
            f"{where} must be an object with 'type' and 'text', got {part!r:.40}",
            param="messages",
        )
    if part.get("type") != "text":
        raise RequestError(
            f"{where}: only 'text' parts are supported, got type "
            f"{part.get('type')!r:.40}",
            param="messages",
        )
    if not isinstance(part.get("text"), str):
        raise RequestError(
            f"{where}.text must be a string, got {part.get('text')!r:.40}",
            param="messages",
        )


def check_text(body):
    """``RequestError`` naming the first string of ``body`` (a key or a value,
    at any depth) that is not Unicode text: JSON escapes such as ``\\ud800``
    decode to a lone surrogate, which no tokenizer can encode."""
    todo = [(body, "")]
    while todo:  # a loop, not recursion: nesting depth is the client's
        value, where = todo.pop()
        if isinstance(value, str):
            _check_string(value, where or "the body")
        elif isinstance(value, dict):
            for key, item in value.items():
                at = f"{where}.{key}" if where else str(key)
                _check_string(key, f"a key of {where or 'the body'}")
                todo.append((item, at))
        elif isinstance(value, list):
            todo += [(item, f"{where}[{i}]") for i, item in enumerate(value)]


def _check_string(text: str, where: str):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = where.split(".")[0].split("[")[0]
        raise RequestError(
            f"{where} is not valid Unicode text: a lone surrogate "
            f"{text[e.start]!r} at character {e.start}",
            param=param,
        ) from None


def _system_prefix(messages, tools, ctx, template_kwargs, prompt) -> int:
    """Where a first turn's user text starts in ``prompt``: renderings of the
    turn with other texts part there (0: not a first turn, or a template that
    refuses the other texts)."""
    *system, last = messages
    if last["role"] != "user" or any(m["role"] != "system" for m in system):
        return 0
    try:
        return min(
            common_prefix(
                prompt,
                _render(system + [{**last, "content": c}], tools, ctx, template_kwargs),
            )
            for c in ("a", "b")
        )
    except RequestError:
        return 0


def _render(messages, tools, ctx: ServerContext, template_kwargs) -> List[int]:
    convert_chat, process_message_content = server_message_helpers()
    messages = copy.deepcopy(messages)
    tok = ctx.tokenizer
    try:
        process_message_content(messages)
        if not tok.has_chat_template:
            return list(tok.encode(convert_chat(messages)))
        args = dict(ctx.chat_template_args or {}, **(template_kwargs or {}))
        return list(
            tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **args
            )
        )
    except (ValueError, TypeError, KeyError) as e:
        raise RequestError(f"cannot build the prompt: {e}", param="messages") from None
    except Exception as e:  # a chat template's own error (jinja)
        raise RequestError(f"the chat template failed: {e}", param="messages") from None


def text_prompt(prompt, ctx: ServerContext) -> List[int]:
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string", param="prompt")
    tokens = ctx.tokenizer.encode(prompt)
    check_length(tokens, ctx)
    return tokens


def initial_state(tokenizer, prompt: List[int]) -> str:
    """ "reasoning" when the prompt leaves the model inside a think block."""
    if tokenizer.response_initial_state:
        return tokenizer.response_initial_state
    if tokenizer.has_thinking:
        if tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
            return "reasoning"
    return "normal"


def openai_request(path: str, body, ctx: ServerContext) -> Tuple[List[int], str, Any]:
    """``(prompt, initial state, params)`` of a ``/v1/chat/completions`` or
    ``/v1/completions`` body; ``params`` also carries the response options."""
    check_text(body)
    check_model(body, ctx)
    check_unsupported(body)
    params = generation_params(body, ctx)
    params.logits = logits_processing(body, ctx)
    logprobs = body.get("logprobs")
    if path.endswith("chat/completions"):
        field(body, "logprobs", "bool")
        top = field(body, "top_logprobs", "int", 0, low=0, high=MAX_TOP_LOGPROBS)
        tools = body.get("tools")
        kwargs = field(body, "chat_template_kwargs", "dict")
        prompt, state, shared = chat_prompt(body.get("messages"), tools, ctx, kwargs)
        params.tools, params.shared_prefix = tools, shared
        params.logprobs = bool(logprobs)
        params.top_logprobs = top if logprobs else 0
    else:  # completions: logprobs is the number of alternatives
        top = field(body, "logprobs", "int", None, low=0, high=MAX_TOP_LOGPROBS)
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        prompt, state = text_prompt(body["prompt"], ctx), "normal"
        params.logprobs = top is not None
        params.top_logprobs = top or 0
    return prompt, state, params


def completion_echo(body) -> str:
    """The text a ``/v1/completions`` reply begins with: the prompt where
    ``echo`` is true, else nothing. ``best_of`` other than 1 and ``suffix``
    (fill-in-the-middle) are refused by name, as ``n`` is; so is ``echo`` with
    ``logprobs`` (the prompt's own logprobs are not computed)."""
    if field(body, "best_of", "int", 1) != 1:
        raise RequestError("only 'best_of': 1 is supported", param="best_of")
    if field(body, "suffix", "str"):
        raise RequestError(
            "'suffix' is not supported (no fill-in-the-middle)", param="suffix"
        )
    if not field(body, "echo", "bool", False):
        return ""
    if body.get("logprobs") is not None:
        raise RequestError(
            "'echo' together with 'logprobs' is not supported", param="echo"
        )
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""
