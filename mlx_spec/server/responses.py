"""OpenAI's Responses API (``POST /v1/responses``): the request checked and
turned into the conversation the chat template sees.

``input`` is a string (one user message) or a list of items: messages (text
parts ``input_text`` / ``output_text``, or plain string content),
``function_call`` items (the model's earlier calls, with their ``call_id``
and JSON ``arguments``), ``function_call_output`` items (a call's result)
and ``reasoning`` items (earlier thinking). They become the messages a chat
completions client would send for the same conversation: the assistant-side
items of one turn (reasoning, text, calls) one assistant message with
``reasoning_content`` and ``tool_calls``, a call's output a ``tool``
message, ``developer`` a system message, ``instructions`` a first system
message. So a conversation gets the same prompt tokens, hence the same
reply, on either endpoint. The shapes of the answer: :mod:`.response_output`.
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .events import GenerationParams
from .kept_responses import KeptConversation, KeptResponses
from .prompts import chat_prompt, check_text
from .requests import (
    RequestError,
    ServerContext,
    check_model,
    field,
    generation_params,
    logits_processing,
)

TEXT_PARTS = ("input_text", "output_text")
INCLUDABLE = ("reasoning.encrypted_content",)  # nothing to add: reasoning is text
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _error(message: str, param: str) -> RequestError:
    return RequestError(message, param=param)


@dataclass
class ResponsesRequest:
    """A checked ``/v1/responses`` body: the prompt and the generation's
    parameters, the conversation a stored response keeps, and the fields the
    response object repeats."""

    prompt: List[int]
    initial_state: str
    params: GenerationParams
    stream: bool
    store: bool
    conversation: KeptConversation  # the earlier turns and this input
    echo: Dict[str, Any]


def responses_request(body, ctx: ServerContext, kept: KeptResponses):
    """The :class:`ResponsesRequest` of ``body``; a :class:`RequestError`
    naming the field for anything it cannot serve as asked."""
    check_text(body)
    check_model(body, ctx)
    _check_unsupported(body)
    stream = field(body, "stream", "bool", False)
    store = field(body, "store", "bool", True)
    instructions = field(body, "instructions", "str")
    previous_id = field(body, "previous_response_id", "str")
    earlier = KeptConversation.empty()
    if previous_id is not None:
        earlier = kept.get(previous_id)
        if earlier is None:
            raise _error(
                f"no stored response has the id {previous_id!r:.80} (responses are "
                "kept in this server's memory, a bounded number, when 'store' is "
                "not false)",
                "previous_response_id",
            )
    tools = _tools(body)
    tool_choice = _tool_choice(body)
    messages, calls = _input(body.get("input"), earlier.call_ids)
    conversation = earlier.extended(messages, calls)
    params = generation_params(body, ctx, max_tokens_field="max_output_tokens")
    params.logits = logits_processing(body, ctx)
    kwargs = field(body, "chat_template_kwargs", "dict")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat_tools = None if tool_choice == "none" or not tools else _chat_tools(tools)
    try:
        prompt, state, shared = chat_prompt(
            system + list(conversation.messages), chat_tools, ctx, kwargs
        )
    except RequestError as e:  # the prompt's messages come from 'input'
        raise RequestError(str(e), e.status, "input") from None
    params.tools, params.shared_prefix = chat_tools, shared
    echo = {
        "instructions": instructions,
        "metadata": _metadata(body),
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": field(body, "parallel_tool_calls", "bool", True),
        "previous_response_id": previous_id,
        "reasoning": field(body, "reasoning", "dict"),
        "max_output_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "store": store,
    }
    return ResponsesRequest(prompt, state, params, stream, store, conversation, echo)


def _check_unsupported(body):
    """Fields whose meaning this server cannot honour, refused by name
    rather than silently ignored."""
    if field(body, "background", "bool", False):
        raise _error("'background' responses are not supported", "background")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise _error(
                f"'{name}' is not supported: send the conversation as 'input' "
                "(or continue a stored response with 'previous_response_id')",
                name,
            )
    if field(body, "truncation", "str", "disabled") != "disabled":
        raise _error(
            "only 'truncation': 'disabled' is supported (a prompt longer than "
            "the model's context is refused)",
            "truncation",
        )
    if field(body, "max_tool_calls", "int") is not None:
        raise _error("'max_tool_calls' is not supported", "max_tool_calls")
    if field(body, "top_logprobs", "int", 0):
        raise _error("'top_logprobs' is not supported on /v1/responses", "top_logprobs")
    for i, value in enumerate(field(body, "include", "list", [])):
        if value not in INCLUDABLE:
            raise _error(
                f"include[{i}]: {value!r:.80} is not supported (accepted: "
                f"{', '.join(INCLUDABLE)})",
                "include",
            )
    text = field(body, "text", "dict", {})
    fmt = text.get("format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _error("only the 'text' format is supported in 'text.format'", "text")


def _metadata(body) -> Dict[str, str]:
    metadata = field(body, "metadata", "dict", {})
    if len(metadata) > METADATA_KEYS:
        raise _error(f"'metadata' holds at most {METADATA_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise _error(
                f"'metadata' keys are at most {METADATA_KEY_CHARS} characters, "
                f"got {key!r:.80}",
                "metadata",
            )
        if not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            raise _error(
                f"metadata[{key!r}] must be a string of at most "
                f"{METADATA_VALUE_CHARS} characters, got {value!r:.40}",
                "metadata",
            )
    return metadata


def _tools(body) -> List[dict]:
    """The function tools, in the response's shape; any other kind of tool
    (a hosted one: web search, file search, a computer, MCP ...) is refused."""
    out = []
    for i, tool in enumerate(field(body, "tools", "list", [])):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _error(f"{at} must be an object, got {tool!r:.40}", "tools")
        kind = tool.get("type")
        if kind != "function":
            raise _error(
                f"{at}: tools of type {kind!r:.40} are not supported; only "
                "'function' tools are",
                "tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _error(f"{at}.name must be a non-empty string", "tools")
        entry = {"type": "function", "name": name}
        for key, kind in (("description", str), ("parameters", dict)):
            value = tool.get(key)
            if value is not None and not isinstance(value, kind):
                raise _error(
                    f"{at}.{key} must be {'a string' if kind is str else 'an object'}"
                    f", got {value!r:.40}",
                    "tools",
                )
            entry[key] = value
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _error(f"{at}.strict must be a boolean, got {strict!r:.40}", "tools")
        entry["strict"] = strict
        out.append(entry)
    return out


def _chat_tools(tools: List[dict]) -> List[dict]:
    """The tools as a chat completions client sends them (the chat template's
    shape)."""
    out = []
    for tool in tools:
        function = {"name": tool["name"]}
        for key in ("description", "parameters"):
            if tool[key] is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body) -> str:
    """``auto`` (the default) or ``none`` (the tools are left out of the
    prompt). Forcing a call needs decoding constrained to one, which this
    server does not do, so ``required`` and a named function are refused."""
    choice = body.get("tool_choice", "auto")
    if choice is None:
        return "auto"
    if choice in ("auto", "none"):
        return choice
    raise _error(
        f"'tool_choice' {choice!r:.80} is not supported: only 'auto' and 'none' "
        "are (a call cannot be forced without constrained decoding)",
        "tool_choice",
    )


class _Conversation:
    """Input items collected into chat messages: the assistant-side items of
    one turn go into one assistant message."""

    def __init__(self, call_ids: frozenset):
        self.messages: List[dict] = []
        self.turn: Optional[dict] = None  # the assistant message being built
        self.known_calls = set(call_ids)
        self.new_calls: List[str] = []

    def assistant(self, starts_turn) -> dict:
        """The assistant message an item joins; a new one where
        ``starts_turn(message)`` says the item begins another turn."""
        if self.turn is None or starts_turn(self.turn):
            self.flush()
            self.turn = {"role": "assistant", "content": ""}
        return self.turn

    def flush(self):
        if self.turn is not None:
            self.messages.append(self.turn)
            self.turn = None

    def add(self, message: dict):
        self.flush()
        self.messages.append(message)


def _input(raw, call_ids: frozenset):
    """``(messages, call ids)`` of ``input``: its chat messages and the
    function calls it holds."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], []
    if not isinstance(raw, list) or not raw:
        raise _error("'input' must be a string or a non-empty list of items", "input")
    conversation = _Conversation(call_ids)
    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _error(f"{at} must be an object, got {item!r:.40}", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _message(conversation, item, at)
        elif kind == "function_call":
            _function_call(conversation, item, at)
        elif kind == "function_call_output":
            _function_call_output(conversation, item, at)
        elif kind == "reasoning":
            _reasoning(conversation, item, at)
        else:
            raise _error(
                f"{at}: items of type {kind!r:.40} are not supported (accepted: "
                "message, function_call, function_call_output, reasoning)",
                "input",
            )
    conversation.flush()
    return conversation.messages, conversation.new_calls


def _string(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _error(f"{at}.{key} must be a string, got {value!r:.40}", "input")
    return value


def _text(content, at: str, parts=TEXT_PARTS) -> str:
    """The text of message content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _error(
            f"{at} must be a string or a list of content parts, got {content!r:.40}",
            "input",
        )
    texts = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in parts:
            kind = part.get("type") if isinstance(part, dict) else part
            raise _error(
                f"{where}: only text parts ({', '.join(parts)}) are supported, "
                f"got {kind!r:.40}",
                "input",
            )
        texts.append(_string(part, "text", where))
    return "".join(texts)


def _message(conversation: _Conversation, item: dict, at: str):
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _error(
            f"{at}.role must be one of user, assistant, system, developer, "
            f"got {role!r:.40}",
            "input",
        )
    text = _text(item.get("content"), f"{at}.content")
    if role == "assistant":
        turn = conversation.assistant(lambda m: m["content"] or "tool_calls" in m)
        turn["content"] = text
    else:
        role = "system" if role == "developer" else role
        conversation.add({"role": role, "content": text})


def _function_call(conversation: _Conversation, item: dict, at: str):
    call_id, name = _string(item, "call_id", at), _string(item, "name", at)
    arguments = _string(item, "arguments", at)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise _error(
            f"{at}.arguments must be a JSON object, got {arguments!r:.60}", "input"
        )
    turn = conversation.assistant(lambda m: False)
    call = {"name": name, "arguments": arguments}
    turn.setdefault("tool_calls", []).append(
        {"id": call_id, "type": "function", "function": call}
    )
    conversation.known_calls.add(call_id)
    conversation.new_calls.append(call_id)


def _function_call_output(conversation: _Conversation, item: dict, at: str):
    call_id = _string(item, "call_id", at)
    if call_id not in conversation.known_calls:
        raise _error(
            f"{at}: no function_call before it has the call_id {call_id!r:.80}",
            "input",
        )
    output = _text(item.get("output"), f"{at}.output", ("input_text",))
    conversation.add({"role": "tool", "tool_call_id": call_id, "content": output})


def _reasoning(conversation: _Conversation, item: dict, at: str):
    """Earlier thinking: its ``content`` text (``reasoning_text`` parts), or
    its summary where it has none; it begins an assistant turn."""
    content, summary = item.get("content"), item.get("summary", [])
    if content:
        text = _text(content, f"{at}.content", ("reasoning_text",))
    else:
        text = _text(summary or "", f"{at}.summary", ("summary_text",))
    if text:  # one with nothing readable (encrypted only) adds nothing
        turn = conversation.assistant(lambda m: len(m) > 2 or m["content"])
        turn["reasoning_content"] = text
