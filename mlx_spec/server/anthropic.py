"""Anthropic's Messages API (``POST /v1/messages``): the request turned into
the same conversation the chat template sees, the response as a message or as
its stream of events.

Content blocks: ``text`` (and ``thinking``, sent back as reasoning), tool use
(``tool_use`` in an assistant turn, ``tool_result`` in a user turn) mapped to
the OpenAI-style messages chat templates expect; images are refused.
"""

import json
import uuid
from typing import Any, Dict, List, Optional

from .events import Finished, Segment, Started, Token, ToolCall
from .prompts import chat_prompt, check_text
from .requests import (
    RequestError,
    ServerContext,
    check_model,
    field,
    generation_params,
    logits_processing,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(message: str, status: int) -> dict:
    kinds = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        503: "overloaded_error",
    }
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_of(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise RequestError(f"{where} must be a string or a list of blocks")
    parts = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(b, dict):
            raise RequestError(f"{at} must be a content block object, got {b!r:.40}")
        if b.get("type") != "text":
            raise RequestError(
                f"{at}: only text blocks are supported here, got type "
                f"{b.get('type')!r:.40}"
            )
        parts.append(_string(b.get("text"), f"{at}.text"))
    return "".join(parts)


def _string(value, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {value!r:.40}")
    return value


def _message(i: int, m) -> List[Dict[str, Any]]:
    """One Anthropic message as OpenAI-style messages (tool results become
    ``tool`` messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise RequestError(f"{where} must have role 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks")
    text, thinking, calls, results = [], [], [], []
    for j, b in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(b, dict):
            raise RequestError(f"{at} must be a content block object, got {b!r:.40}")
        kind = b.get("type")
        if kind == "text":
            text.append(_string(b.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thinking.append(_string(b.get("thinking"), f"{at}.thinking"))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("input", {}), dict):
                raise RequestError(f"{at}.input must be an object")
            calls.append(
                {
                    "id": str(b.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": _string(b.get("name"), f"{at}.name"),
                        "arguments": b.get("input", {}),
                    },
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": str(b.get("tool_use_id", "")),
                    "content": _text_of(b.get("content", ""), f"{at}.content"),
                }
            )
        else:
            raise RequestError(f"{at}: block type {kind!r} is not supported here")
    out = list(results)
    if text or thinking or calls:
        msg: Dict[str, Any] = {"role": m["role"], "content": "".join(text)}
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(tools) -> Optional[List[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{i}] must be an object with a string 'name'")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
        )
    return out


def messages_request(body, ctx: ServerContext):
    """``(prompt, initial state, params)`` of a ``/v1/messages`` body."""
    check_text(body)
    check_model(body, ctx)
    if "max_tokens" not in body:
        raise RequestError("'max_tokens' is required")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list")
    messages = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(raw):
        messages += _message(i, m)
    field(body, "stop_sequences", "list")
    params = generation_params(body, ctx)
    params.logits = logits_processing(body, ctx)
    tools = _tools(body.get("tools"))
    params.tools = tools
    prompt, state, params.shared_prefix = chat_prompt(messages, tools, ctx)
    return prompt, state, params


class MessageResponse:
    """Turns engine events into an Anthropic message (or its events)."""

    def __init__(self, model_id: str):
        self.id = "msg_" + uuid.uuid4().hex
        self.model_id = model_id
        self.blocks: List[Dict[str, Any]] = []
        self.started: Optional[Started] = None
        self.finished: Optional[Finished] = None

    def _message(self, content, stop_reason=None, output_tokens=0) -> dict:
        # input_tokens: the prompt's tokens not read from a kept state
        prompt = self.started.prompt_tokens if self.started else 0
        cached = self.started.cached_tokens if self.started else 0
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": self.stop_sequence(),
            "usage": {
                "input_tokens": prompt - cached,
                "cache_read_input_tokens": cached,
                "output_tokens": output_tokens,
            },
        }

    def add(self, event) -> List[tuple]:
        """Record ``event``; returns the stream events ``(name, data)`` it makes."""
        if isinstance(event, Started):
            self.started = event
            return [
                (
                    "message_start",
                    {"type": "message_start", "message": self._message([])},
                )
            ]
        if isinstance(event, Token):
            return []
        if isinstance(event, Segment):
            kind = "thinking" if event.kind == "reasoning" else "text"
            events = []
            if not self.blocks or self.blocks[-1]["type"] != kind:
                block = {"type": kind, kind: ""}
                if kind == "thinking":  # no signature: the thinking is local
                    block["signature"] = ""
                events += self._close() + self._open(block)
            self.blocks[-1][kind] += event.text
            return events + self._delta({"type": f"{kind}_delta", kind: event.text})
        if isinstance(event, ToolCall):
            block = {
                "type": "tool_use",
                "id": "toolu_" + uuid.uuid4().hex[:24],
                "name": event.name,
                "input": event.arguments,
            }
            events = self._close() + self._open({**block, "input": {}})
            self.blocks[-1]["input"] = event.arguments
            partial = json.dumps(event.arguments)
            return events + self._delta(
                {"type": "input_json_delta", "partial_json": partial}
            )
        if isinstance(event, Finished):
            self.finished = event
            if event.reason == "cancelled":
                return [("error", self.cut_short(event))]
            delta = {
                "type": "message_delta",
                "delta": {
                    "stop_reason": self.stop_reason(),
                    "stop_sequence": self.stop_sequence(),
                },
                "usage": {"output_tokens": event.completion_tokens},
                "speculation": event.speculation,
            }
            return self._close() + [
                ("message_delta", delta),
                ("message_stop", {"type": "message_stop"}),
            ]
        raise TypeError(f"unexpected event {event!r}")

    @staticmethod
    def cut_short(event: Finished) -> dict:
        """The ``error`` event ending a stream the server cut short, in place
        of ``message_delta`` and ``message_stop`` (a client must not take it
        for a whole reply): ``overloaded_error`` for a server stopping (worth
        a retry), ``api_error`` otherwise; with the tokens and speculation
        counters so far."""
        cut = event.cut
        why = str(cut) if cut is not None else "the request was cancelled"
        status = cut.status if cut is not None else 500
        message = (
            f"{why}; the reply was cut short after {event.completion_tokens} tokens"
        )
        return {
            **error_body(message, status),
            "usage": {"output_tokens": event.completion_tokens},
            "speculation": event.speculation,
        }

    def stream(self, events: list) -> List[tuple]:
        """The stream events ``(name, data)`` of ``events`` handed over
        together (a pass's), a block's consecutive text deltas joined in one."""
        out: List[tuple] = []
        for name, data in (e for event in events for e in self.add(event)):
            if out and name == out[-1][0] == "content_block_delta":
                last, delta = out[-1][1], data["delta"]
                kind = delta["type"].removesuffix("_delta")
                same = (last["index"], last["delta"]["type"]) == (
                    data["index"],
                    delta["type"],
                )
                if same and kind in ("text", "thinking"):
                    joined = {**delta, kind: last["delta"][kind] + delta[kind]}
                    out[-1] = (name, {**last, "delta": joined})
                    continue
            out.append((name, data))
        return out

    def _delta(self, delta: dict) -> List[tuple]:
        index = len(self.blocks) - 1
        return [
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
        ]

    def _open(self, block) -> List[tuple]:
        self.blocks.append(dict(block))
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        return [("content_block_start", {**start, "content_block": block})]

    def _close(self) -> List[tuple]:
        if not self.blocks or self.blocks[-1].get("_closed"):
            return []
        self.blocks[-1]["_closed"] = True
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def stop_reason(self) -> str:
        if self.stop_sequence() is not None:
            return "stop_sequence"
        return STOP_REASONS.get(self.finished.reason, "end_turn")

    def stop_sequence(self) -> Optional[str]:
        """The stop sequence that ended the reply (None: none did, or not yet)."""
        if self.finished is None or self.finished.reason != "stop":
            return None
        return self.finished.stop_sequence

    def body(self) -> dict:
        content = [{k: v for k, v in b.items() if k != "_closed"} for b in self.blocks]
        out = self._message(
            content or [{"type": "text", "text": ""}],
            self.stop_reason(),
            self.finished.completion_tokens,
        )
        out["speculation"] = self.finished.speculation
        return out
