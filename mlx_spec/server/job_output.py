"""One admitted job's output side: its tokens detokenized and routed
(content, reasoning, tool calls, stops) into the job's events, each pass's
with the row's speculation counters, then its ``Finished``.
"""

import time
from typing import List

import mlx.core as mx

from ..core.stats import SpecStats
from .events import Finished, Job, Progress, TextRouter, Token


class JobOutput:
    """One admitted job's side: detokenizing, routing text, its finish.
    ``budget``: the most tokens it may emit (its ``max_tokens``, within the
    model's context)."""

    def __init__(self, job: Job, tokenizer, draft: str, budget: int, stats: SpecStats):
        self.job, self.draft, self.tokenizer = job, draft, tokenizer
        self.budget, self.stats = budget, stats
        self.detokenizer = tokenizer.detokenizer
        self.router = TextRouter(tokenizer, job.params, job.initial_state)
        self.n, self.reason, self.tic = 0, None, time.perf_counter()

    def emit(self, tokens: List[int], logprobs: mx.array):
        """Send the events of a pass's tokens, as one item, with the row's
        counters after the pass; sets ``reason`` once done."""
        p, events = self.job.params, []
        chosen = [None] * len(tokens)
        if p.logprobs:  # a sync: it would also wait for a pass queued ahead
            chosen = logprobs[mx.arange(len(tokens)), mx.array(tokens)].tolist()
        for i, token in enumerate(tokens):
            self.n += 1
            events.append(
                Token(token, chosen[i], top_logprobs(logprobs[i], p.top_logprobs))
            )
            eos = token in self.tokenizer.eos_token_ids
            if not eos:
                self.detokenizer.add_token(token)
            length = self.n >= self.budget
            if eos or length:
                self.detokenizer.finalize()
            events += self.router.feed(self.detokenizer.last_segment, eos, length)
            if eos or self.router.stopped:
                self.reason = "stop"
            elif length:
                self.reason = "length"
            if self.reason:
                break
        if self.job.cancelled and not self.reason:
            self.reason = "cancelled"
        self.job.put(*events, Progress(self.speculation()))

    def speculation(self) -> dict:
        return speculation_counters(
            self.draft, self.stats, time.perf_counter() - self.tic
        )

    def finish(self):
        reason = self.reason or "cancelled"
        if reason == "stop" and self.router.made_tool_call:
            reason = "tool_calls"
        stop_word = self.router.stop_word if reason == "stop" else None
        self.job.put(Finished(reason, self.n, self.speculation(), stop_word))


def speculation_counters(draft: str, stats: SpecStats, seconds: float) -> dict:
    """A reply's speculation counters, as responses carry them."""
    return {
        "draft": draft,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "verify_passes": stats.verify_passes,
        "seconds": round(seconds, 6),
    }


def top_logprobs(logprobs: mx.array, n: int) -> List[tuple]:
    """The ``n`` most likely tokens of ``logprobs``, as (id, logprob), best first."""
    if n <= 0:
        return []
    ids = mx.argpartition(-logprobs, n - 1)[:n]
    values = logprobs[ids]
    order = mx.argsort(-values)
    return list(zip(ids[order].tolist(), values[order].tolist()))
