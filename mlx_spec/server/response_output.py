"""The Responses API's answer (``POST /v1/responses``): engine events turned
into output items, the response object, and the stream of typed events.

Output items, in the order the model wrote them: ``reasoning`` (its thinking,
as ``reasoning_text`` content), ``message`` (its text, one ``output_text``
part) and ``function_call`` (``call_id``, ``name``, JSON ``arguments``). A
stream sends ``response.created`` and ``response.in_progress``, then for each
item ``response.output_item.added``, its part opened, its text deltas, the
text and the part done, ``response.output_item.done`` (a call: its arguments'
delta and done), and last ``response.completed``, ``response.incomplete``
(the output token limit) or ``response.failed`` (the server cut the response
short, or the generation failed); each event has the next ``sequence_number``. A pass's
consecutive text of one item goes out as one delta, as on the other
endpoints. The response carries the request's ``speculation`` counters.
"""

import json
import time
import uuid
from typing import Any, Dict, List, Optional

from .events import Finished, Segment, Started, Token, ToolCall
from .kept_responses import KeptConversation
from .responses import ResponsesRequest

_DELTAS = ("response.output_text.delta", "response.reasoning_text.delta")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """One response being built from its request's engine events."""

    def __init__(self, model_id: str, request: ResponsesRequest):
        self.id, self.model_id, self.request = _new_id("resp"), model_id, request
        self.created_at = int(time.time())
        self.items: List[Dict[str, Any]] = []
        self.open: Optional[Dict[str, Any]] = None  # the item text goes to
        self.started: Optional[Started] = None
        self.finished: Optional[Finished] = None
        self.error: Optional[dict] = None
        self.reasoning_tokens = 0
        self._unplaced_tokens = 0  # tokens whose text has not come out yet
        self.sequence = 0

    # -- events --------------------------------------------------------------
    def add(self, event) -> List[dict]:
        """Record ``event``; returns the stream events it makes (unnumbered)."""
        if isinstance(event, Started):
            self.started = event
            return [self._lifecycle("response.created")] + [
                self._lifecycle("response.in_progress")
            ]
        if isinstance(event, Token):
            self._unplaced_tokens += 1
            return []
        if isinstance(event, Segment):
            kind = "reasoning" if event.kind == "reasoning" else "message"
            if kind == "reasoning":
                self.reasoning_tokens += self._unplaced_tokens
            self._unplaced_tokens = 0
            events = []
            if self.open is None or self.open["type"] != kind:
                events += self._close("completed") + self._open(kind)
            self.open["content"][0]["text"] += event.text
            return events + [self._delta(event.text)]
        if isinstance(event, ToolCall):
            self._unplaced_tokens = 0
            return self._close("completed") + self._call(event)
        if isinstance(event, Finished):
            self.finished = event
            if event.reason == "cancelled":  # the server cut it short
                why = str(event.cut) if event.cut is not None else ""
                return self.fail(why or "the server ended the response early")
            status = "incomplete" if event.reason == "length" else "completed"
            return self._close(status) + [self._lifecycle(f"response.{status}")]
        raise TypeError(f"unexpected event {event!r}")

    def stream(self, events: list) -> List[dict]:
        """The numbered stream events of ``events`` handed over together (a
        pass's): consecutive deltas of one item joined into one."""
        out: List[dict] = []
        for e in (e for event in events for e in self.add(event)):
            last = out[-1] if out else None
            if last and e["type"] in _DELTAS and last["type"] == e["type"]:
                if last["item_id"] == e["item_id"]:
                    last["delta"] += e["delta"]
                    continue
            out.append(e)
        return self._numbered(out)

    def fail(self, message: str) -> List[dict]:
        """The events ending a response that could not be finished."""
        self.error = {"code": "server_error", "message": message}
        return self._close("incomplete") + [self._lifecycle("response.failed")]

    def failed(self, message: str) -> List[dict]:
        """:meth:`fail`'s events, numbered (a stream's last)."""
        return self._numbered(self.fail(message))

    def _numbered(self, events: List[dict]) -> List[dict]:
        for e in events:
            e["sequence_number"] = self.sequence
            self.sequence += 1
        return events

    # -- items ---------------------------------------------------------------
    def _open(self, kind: str) -> List[dict]:
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant"}
            part = {
                "type": "output_text",
                "text": "",
                "annotations": [],
                "logprobs": [],
            }
        item.update(status="in_progress", content=[])
        self.items.append(item)
        added = self._item_event("response.output_item.added", item)
        item["content"].append(part)
        self.open = item
        return [added, self._part_event("response.content_part.added", item)]

    def _close(self, status: str) -> List[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        text = item["content"][0]["text"]
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", "text": text}
        else:
            done = {"type": "response.output_text.done", "text": text, "logprobs": []}
        done.update(self._where(item), content_index=0)
        return [
            done,
            self._part_event("response.content_part.done", item),
            self._item_event("response.output_item.done", item),
        ]

    def _call(self, call: ToolCall) -> List[dict]:
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        item = {
            "id": _new_id("fc"),
            "type": "function_call",
            "call_id": _new_id("call"),
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        added = self._item_event("response.output_item.added", item)
        item.update(arguments=arguments, status="completed")
        where = self._where(item)
        return [
            added,
            {"type": "response.function_call_arguments.delta", "delta": arguments}
            | where,
            {
                "type": "response.function_call_arguments.done",
                "name": call.name,  # older SDKs require it
                "arguments": arguments,
            }
            | where,
            self._item_event("response.output_item.done", item),
        ]

    def _delta(self, text: str) -> dict:
        kind = self.open["type"]
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        event = {"type": f"response.{name}.delta", "delta": text}
        event.update(self._where(self.open), content_index=0)
        if kind == "message":
            event["logprobs"] = []
        return event

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _item_event(self, name: str, item: dict) -> dict:
        snapshot = json.loads(json.dumps(item))  # as it is now, not as it ends
        return {"type": name, "output_index": self.items.index(item), "item": snapshot}

    def _part_event(self, name: str, item: dict) -> dict:
        part = dict(item["content"][0])
        if name.endswith(".added"):
            part["text"] = ""
        return {"type": name, **self._where(item), "content_index": 0, "part": part}

    # -- the response object -------------------------------------------------
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.finished is None:
            return "in_progress"
        return "incomplete" if self.finished.reason == "length" else "completed"

    def _usage(self) -> Optional[dict]:
        if self.finished is None:
            return None
        prompt = self.started.prompt_tokens if self.started else 0
        cached = self.started.cached_tokens if self.started else 0
        output = self.finished.completion_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": prompt + output,
        }

    def body(self) -> dict:
        """The response object as it stands (whole once finished)."""
        status = self.status()
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": self.error,
            "incomplete_details": incomplete,
            "model": self.model_id,
            "output": json.loads(json.dumps(self.items)),
            **self.request.echo,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": self._usage(),
        }
        if self.finished is not None:
            out["speculation"] = self.finished.speculation
        return out

    def _lifecycle(self, name: str) -> dict:
        return {"type": name, "response": self.body()}

    # -- what a stored response keeps ----------------------------------------
    def kept(self) -> Optional[KeptConversation]:
        """The conversation this response ended (its input's and its own
        reply as an assistant message), or None where nothing is kept: not
        stored, or not finished."""
        if not self.request.store or self.status() not in ("completed", "incomplete"):
            return None
        reply: Dict[str, Any] = {"role": "assistant", "content": ""}
        calls = []
        for item in self.items:
            if item["type"] == "reasoning":
                thinking = reply.get("reasoning_content", "")
                reply["reasoning_content"] = thinking + item["content"][0]["text"]
            elif item["type"] == "message":
                reply["content"] += item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                calls.append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        if calls:
            reply["tool_calls"] = calls
        return self.request.conversation.extended([reply], [c["id"] for c in calls])
