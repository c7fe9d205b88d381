"""What flows between the HTTP side and the engine: the request's parameters,
the job and its events, and the text router that turns decoded text into
content, reasoning and tool calls."""

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from ..mlx_lm_compat import TextStateMachine, make_text_state_machine

log = logging.getLogger("mlx_spec.server")


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False  # report each token's logprob
    top_logprobs: int = 0  # alternatives per token (0: none)
    draft: Optional[str] = None  # None: the server's default
    num_draft_tokens: Union[int, str, None] = None
    tools: Optional[List[Dict[str, Any]]] = None
    # keyword arguments of mlx-lm's make_logits_processors (empty: none)
    logits: Dict[str, Any] = field(default_factory=dict)
    # prompt tokens other requests likely begin with (a first turn's system
    # prompt and tools): the prefill keeps a state there
    shared_prefix: int = 0


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Token:
    token: int
    logprob: Optional[float]  # None unless the request asked for logprobs
    top_logprobs: List[tuple]  # [(token, logprob)], most likely first


@dataclass
class Segment:
    kind: str  # "content" or "reasoning"
    text: str


@dataclass
class ToolCall:
    name: str
    arguments: Dict[str, Any]


@dataclass
class Progress:
    """A row's speculation counters after its latest pass (drafter, drafted,
    accepted, verify passes, seconds): what a reply the server cuts short
    reports, since its ``Finished`` is not the engine's."""

    speculation: Dict[str, Any]


class CutShort(Exception):
    """Why the server ended a reply before its finish: said to the client
    (``status``: the HTTP status of the error it is in the API's terms,
    e.g. 503 for a server stopping)."""

    status = 500


@dataclass
class Finished:
    reason: str  # "stop", "length", "tool_calls", "cancelled"
    completion_tokens: int
    speculation: Dict[str, Any]
    stop_sequence: Optional[str] = None  # the stop word that ended the reply
    # a "cancelled" reply the server cut short: why (None: the engine's own
    # cancel, e.g. a client gone)
    cut: Optional[CutShort] = None


class Job:
    """A request as the engine sees it. Its events reach the HTTP side in
    lists (:meth:`put`, :meth:`get`): a pass's tokens and text as one item,
    so the thread streaming them wakes once a pass, not once a token."""

    def __init__(self, prompt: List[int], params: GenerationParams, initial="normal"):
        self.prompt, self.params, self.initial_state = prompt, params, initial
        self.events: "queue.Queue" = queue.Queue()
        self._cancelled = threading.Event()

    def put(self, *events):
        """Hand over ``events`` (an exception: the job failed) as one item."""
        self.events.put(list(events))

    def get(self, timeout: float) -> list:
        """The next events handed over; ``queue.Empty`` after ``timeout`` seconds."""
        return self.events.get(timeout=timeout)

    def cancel(self):
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class TextRouter:
    """Decoded text split by mlx-lm's text state machine into content,
    reasoning and tool calls (parsed by the tokenizer's own tool parser).

    A stop word ends the reply where its text appears, however it was
    tokenized; the machine holds back text that may begin one and strips it.
    """

    def __init__(self, tokenizer, p: GenerationParams, initial: str):
        self.tokenizer, self.tools, self.stops = tokenizer, p.tools, p.stop
        self.state = make_text_state_machine(tokenizer, p.stop).make_state(initial)
        self.previous = initial
        self.tail = ""  # the last raw characters, to find stop words across chunks
        self.tool_text, self.made_tool_call, self.stopped = "", False, False
        self.stop_word: Optional[str] = None  # the one that ended the reply

    def _cut_at_stop(self, text: str) -> str:
        window = self.tail + text
        ends = [(window.find(s) + len(s), s) for s in self.stops if s in window]
        if ends:  # an earlier match would have been found before: it ends here
            end, self.stop_word = min(ends)
            self.stopped = True
            text = text[: end - len(self.tail)]
        keep = max(map(len, self.stops)) - 1
        self.tail = (self.tail + text)[-keep:] if keep else ""
        return text

    def feed(self, text: str, stop: bool, length: bool):
        if self.stops:
            text = self._cut_at_stop(text)
            stop = stop or self.stopped
        self.state, segments = TextStateMachine.split(self.state, text)
        if stop:  # text held back as a possible control sequence is dropped
            self.state, _ = TextStateMachine.discard(self.state)
        elif length:
            self.state, rest, current = TextStateMachine.flush(self.state)
            segments.append((current, rest))
        for kind, piece in segments:
            if kind == "tool":
                self.tool_text += piece
            else:
                if self.previous == "tool":
                    yield from self._tool_calls()
                if piece:
                    yield Segment(
                        "reasoning" if kind == "reasoning" else "content", piece
                    )
            self.previous = kind
        if (stop or length or self.stopped) and self.tool_text:
            yield from self._tool_calls()

    def _tool_calls(self):
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.tokenizer.tool_parser(text, self.tools)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("unparsable tool call (%s): %r", e, text[:200])
            return
        self.made_tool_call = True
        for call in parsed if isinstance(parsed, list) else [parsed]:
            yield ToolCall(call["name"], call.get("arguments") or {})
