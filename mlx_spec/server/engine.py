"""The generation worker: one request at a time, speculatively and losslessly.

HTTP threads hand a :class:`Job` to :meth:`Engine.submit` and read its events;
a single worker thread runs the jobs in arrival order (MLX evaluates on one
stream; batching several requests is a separate concern). Each job continues
the longest kept decoder state its prompt extends (see ``state_cache``), so
only the new tokens are prefilled, and leaves its own state behind.

A job's events: ``Started`` once (prompt and cached token counts), then
``Segment`` (text by kind: content or reasoning), ``ToolCall`` and
``Token`` events, then ``Finished``; or one exception. ``Job.cancel()`` (a
client that went away) ends the generation after the current verify pass,
and the state kept is exactly what was decoded.
"""

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx

from ..core.decode import SpeculativeDecoder
from ..core.policy import most_drafts
from ..core.sampling import make_sampler
from ..core.snapshot import capture, restore
from ..core.stats import SpecStats
from ..drafters import make_drafter
from ..generate import check_options, stream_generate
from ..mlx_lm_compat import TextStateMachine, make_text_state_machine
from .state_cache import StateCache

log = logging.getLogger("mlx_spec.server")


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False  # report each token's logprob (the engine always sends it)
    top_logprobs: int = 0  # alternatives per token (0: none)
    draft: Optional[str] = None  # None: the server's default
    num_draft_tokens: Union[int, str, None] = None
    tools: Optional[List[Dict[str, Any]]] = None


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Token:
    token: int
    logprob: float
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
class Finished:
    reason: str  # "stop", "length", "tool_calls", "cancelled"
    completion_tokens: int
    speculation: Dict[str, Any]


class Job:
    def __init__(self, prompt: List[int], params: GenerationParams, initial="normal"):
        self.prompt, self.params, self.initial_state = prompt, params, initial
        self.events: "queue.Queue" = queue.Queue()
        self._cancelled = threading.Event()

    def cancel(self):
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Engine:
    """Owns the model and the kept states; runs jobs on one worker thread."""

    def __init__(
        self,
        model,
        tokenizer,
        draft: str,
        num_draft_tokens: Union[int, str] = "auto",
        max_ngram: int = 3,
        rollback: str = "store",
        cache_bytes: int = 1 << 30,
        cache_entries: int = 10,
        prefill_step_size: int = 2048,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.draft, self.num_draft_tokens = draft, num_draft_tokens
        self.max_ngram, self.prefill_step_size = max_ngram, prefill_step_size
        self.rollback = rollback
        self.states = StateCache(cache_bytes, cache_entries)
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.running: Optional[Job] = None
        self._worker = threading.Thread(target=self._work, name="mlx_spec-engine")
        self._worker.daemon = True
        self._worker.start()

    # -- the HTTP side -----------------------------------------------------
    def submit(self, job: Job) -> Job:
        if not self._worker.is_alive():
            raise RuntimeError("the generation worker has stopped")
        self._jobs.put(job)
        return job

    def close(self):
        self._jobs.put(None)
        self._worker.join(timeout=60)

    @property
    def healthy(self) -> bool:
        return self._worker.is_alive()

    def status(self) -> dict:
        """For ``/health``: the queue and the kept states' history lengths."""
        return {
            "busy": self.running is not None,
            "queued": self._jobs.qsize(),
            "kept_states": self.states.histories(),
            "kept_bytes": self.states.nbytes,
        }

    # -- the worker ----------------------------------------------------------
    def _work(self):
        self._stream = mx.default_stream(mx.default_device())  # this thread's
        while (job := self._jobs.get()) is not None:
            if job.cancelled:
                continue
            self.running = job
            try:
                self._run(job)
            except Exception as e:  # reported to its client; the worker goes on
                log.exception("request failed")
                job.events.put(e)
            finally:
                self.running = None

    def _decoder(self, draft: str, num_draft_tokens, prompt: List[int]):
        """A decoder continuing the longest kept state ``prompt`` extends, and
        the tokens still to feed."""
        drafter = make_drafter(draft, self.model, max_ngram=self.max_ngram)
        decoder = SpeculativeDecoder(
            self.model,
            drafter,
            max_draft=max(most_drafts(num_draft_tokens), 1),
            rollback=self.rollback,
            prefill_step_size=self.prefill_step_size,
            stats=SpecStats(),
        )
        state = self.states.lookup(draft, prompt)
        if state is None:
            return decoder, prompt
        restore(decoder, state, copy_caches=True)
        return decoder, prompt[len(state.history) :]

    def _run(self, job: Job):
        p = job.params
        draft = p.draft or self.draft
        num_draft_tokens = (
            self.num_draft_tokens if p.num_draft_tokens is None else p.num_draft_tokens
        )
        if draft == "none":
            draft, num_draft_tokens = "none", 0
        check_options(p.max_tokens, draft, num_draft_tokens)
        decoder, new = self._decoder(draft, num_draft_tokens, job.prompt)
        job.events.put(Started(len(job.prompt), len(job.prompt) - len(new)))
        if len(new) > 1:
            # Keep the state before the prompt's last token: the next turn's
            # prompt extends it even when this reply is tokenized differently
            # there (or a client sends the same conversation again).
            decoder.feed(new[:-1])
            self.states.insert(capture(decoder, copy_caches=True))
            new = new[-1:]
        if p.seed is not None:
            mx.random.seed(p.seed)
        sampler = make_sampler(p.temperature, p.top_p, p.min_p, 1, top_k=p.top_k)
        text = _TextRouter(self.tokenizer, p, job.initial_state)
        tic, n, reason = time.perf_counter(), 0, "length"
        responses = stream_generate(
            self.model,
            self.tokenizer,
            new,
            p.max_tokens,
            decoder=decoder,
            num_draft_tokens=num_draft_tokens,
            sampler=sampler,
            stream=self._stream,
        )
        try:
            for r in responses:
                n += 1
                lp = r.logprobs
                job.events.put(Token(r.token, lp[r.token].item(), _top(lp, p)))
                eos = r.finish_reason == "stop"
                for event in text.feed(r.text, eos, r.finish_reason == "length"):
                    job.events.put(event)
                if eos or text.stopped:
                    reason = "stop"
                    break
                if job.cancelled:
                    reason = "cancelled"
                    break
        finally:
            responses.close()  # the decoder keeps exactly the tokens decoded
        if reason == "stop" and text.made_tool_call:
            reason = "tool_calls"
        self.states.insert(capture(decoder))
        stats = decoder.stats
        job.events.put(Finished(reason, n, _speculation(stats, draft, tic)))


def _top(logprobs: mx.array, p: GenerationParams) -> List[tuple]:
    if p.top_logprobs <= 0:
        return []
    ids = mx.argpartition(-logprobs, p.top_logprobs - 1)[: p.top_logprobs]
    values = logprobs[ids]
    order = mx.argsort(-values)
    return list(zip(ids[order].tolist(), values[order].tolist()))


def _speculation(stats: SpecStats, draft: str, tic: float) -> Dict[str, Any]:
    return {
        "draft": draft,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "verify_passes": stats.verify_passes,
        "seconds": round(time.perf_counter() - tic, 6),
    }


class _TextRouter:
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

    def _cut_at_stop(self, text: str) -> str:
        window = self.tail + text
        ends = [window.find(s) + len(s) for s in self.stops if s in window]
        if ends:  # an earlier match would have been found before: it ends here
            self.stopped = True
            text = text[: min(ends) - len(self.tail)]
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
