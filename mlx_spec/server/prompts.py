"""A request's prompt: a conversation rendered by the chat template (its
messages and content parts checked first), or a completion's text; every
string of a body checked as Unicode text; the prompt's length checked against
the model's context. A bad value is a :class:`RequestError` naming the field.
"""

import copy
from typing import List

from ..mlx_lm_compat import server_message_helpers
from ..states.memory import common_prefix
from .requests import RequestError, ServerContext


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
