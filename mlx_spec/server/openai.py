"""OpenAI's ``/v1/chat/completions`` and ``/v1/completions``: a request body
checked into a prompt and its parameters, and the response shapes: one JSON
object, or server-sent ``data:`` chunks ending with ``[DONE]``.

Responses carry the request's speculation counters in an extension field,
``speculation`` (drafter, tokens drafted and accepted, verify passes).
"""

import json
import math
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from .events import Finished, GenerationParams, Segment, Started, Token, ToolCall
from .prompts import chat_prompt, check_text, text_prompt
from .requests import (
    MAX_TOP_LOGPROBS,
    RequestError,
    ServerContext,
    check_model,
    check_unsupported,
    field,
    generation_params,
    logits_processing,
)


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


def _is_text(delta: Optional[dict]) -> bool:
    """Whether a streamed delta is content or reasoning text alone."""
    return delta is not None and list(delta) in (["content"], ["reasoning"])


def finite_or_none(value: Optional[float]) -> Optional[float]:
    """``value``, or None where it is no finite number: the logprob of a token
    a penalty or bias pushed to -inf has no JSON number."""
    if value is None or not math.isfinite(value):
        return None
    return value


def error_body(message: str, status: int, param: Optional[str] = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 404:
        kind = "not_found_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class OpenAIResponse:
    """Turns engine events into a response of one request."""

    def __init__(
        self,
        chat: bool,
        model_id: str,
        params: GenerationParams,
        tokenizer,
        echo: str = "",
    ):
        """``echo``: text the reply begins with (a completion's prompt)."""
        self.chat, self.model_id, self.params = chat, model_id, params
        self.echo = "" if chat else echo
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.content, self.reasoning = self.echo, ""
        self.tool_calls: List[dict] = []
        self.tokens: List[Token] = []
        self.usage: Dict[str, Any] = {}
        self.started: Optional[Started] = None
        self.finished: Optional[Finished] = None

    # -- accumulate ----------------------------------------------------------
    def add(self, event) -> Optional[dict]:
        """Record ``event``; returns the streaming delta it makes, if any."""
        if isinstance(event, Started):
            self.started = event
            if self.chat:
                return {"role": "assistant", "content": ""}
            return {"content": self.echo} if self.echo else None
        if isinstance(event, Token):
            self.tokens.append(event)
            return None
        if isinstance(event, Segment):
            if event.kind == "reasoning":
                self.reasoning += event.text
                return {"reasoning": event.text} if self.chat else None
            self.content += event.text
            return {"content": event.text}
        if isinstance(event, ToolCall):
            call = {
                "index": len(self.tool_calls),
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": event.name,
                    "arguments": json.dumps(event.arguments, ensure_ascii=False),
                },
            }
            self.tool_calls.append(call)
            return {"tool_calls": [call]} if self.chat else None
        if isinstance(event, Finished):
            self.finished = event
            return None
        raise TypeError(f"unexpected event {event!r}")

    # -- shapes --------------------------------------------------------------
    def _usage(self) -> dict:
        prompt = self.started.prompt_tokens if self.started else 0
        completion = self.finished.completion_tokens if self.finished else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": self.started.cached_tokens if self.started else 0
            },
        }

    def _logprobs(self, tokens: List[Token]):
        if not self.params.logprobs:
            return None
        decode = lambda t: self.tokenizer.decode([t])  # noqa: E731
        if self.chat:

            def entry(token, logprob):
                text = decode(token)
                return {
                    "token": text,
                    "logprob": finite_or_none(logprob),
                    "bytes": list(text.encode("utf-8")),
                }

            return {
                "content": [
                    {
                        **entry(t.token, t.logprob),
                        "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs],
                    }
                    for t in tokens
                ]
            }
        return {
            "tokens": [decode(t.token) for t in tokens],
            "token_logprobs": [finite_or_none(t.logprob) for t in tokens],
            "top_logprobs": [
                {decode(i): finite_or_none(lp) for i, lp in t.top_logprobs} or None
                for t in tokens
            ],
        }

    def _head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model_id}

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _finish_reason(self) -> str:
        return self.finished.reason if self.finished else "stop"

    def body(self) -> dict:
        """The whole (non-streaming) response."""
        choice: Dict[str, Any] = {"index": 0, "finish_reason": self._finish_reason()}
        if self.chat:
            message = {"role": "assistant", "content": self.content}
            if self.reasoning:
                message["reasoning"] = self.reasoning
            if self.tool_calls:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"}
                    for c in self.tool_calls
                ]
            choice["message"] = message
        else:
            choice["text"] = self.content
        choice["logprobs"] = self._logprobs(self.tokens)
        return {
            **self._head(),
            "object": self.object,
            "choices": [choice],
            "usage": self._usage(),
            "speculation": self.finished.speculation if self.finished else None,
        }

    def stream(self, events: list) -> List[dict]:
        """The chunks streamed for ``events`` handed over together (a pass's):
        consecutive text of one kind goes out as one chunk, with the logprobs
        of the tokens up to its last piece (later ones go with the next)."""
        chunks, text, upto = [], None, 0  # text: the delta not yet sent
        for event in events:
            delta, final = self.add(event), isinstance(event, Finished)
            if delta is None and not final:
                continue  # a token: it goes with the chunk of its text
            if _is_text(delta) and text is not None and delta.keys() == text.keys():
                ((key, piece),) = delta.items()
                text = {key: text[key] + piece}
            else:
                if text is not None:
                    chunks.append(self.chunk(text, upto=upto))
                text = delta if _is_text(delta) else None
                if text is None:
                    chunks.append(self.chunk(delta, final=final))
            upto = len(self.tokens)
        if text is not None:
            chunks.append(self.chunk(text, upto=upto))
        return chunks

    def chunk(
        self, delta: Optional[dict], final: bool = False, upto: Optional[int] = None
    ) -> dict:
        """One streamed chunk: ``delta`` (chat) or its text (completions),
        with the logprobs of the tokens since the last chunk (the first
        ``upto`` of them)."""
        upto = len(self.tokens) if upto is None else upto
        tokens, self.tokens = self.tokens[:upto], self.tokens[upto:]
        choice: Dict[str, Any] = {
            "index": 0,
            "finish_reason": self._finish_reason() if final else None,
            "logprobs": self._logprobs(tokens),
        }
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = (delta or {}).get("content", "")
        out = {**self._head(), "object": self._chunk_object(), "choices": [choice]}
        if final:
            out["speculation"] = self.finished.speculation if self.finished else None
        return out

    def usage_chunk(self) -> dict:
        return {
            **self._head(),
            "object": self._chunk_object(),
            "choices": [],
            "usage": self._usage(),
        }
