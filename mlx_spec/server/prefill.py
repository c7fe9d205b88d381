"""The prompts joining the server's batch: prefilled in chunks, in arrival
order, and shared where they begin alike.

A Gated-DeltaNet state cannot be trimmed back to a shorter prefix, so a kept
state serves only prompts that continue all of it. Prompts that arrive
together often begin alike (the same system prompt and tools, the same
conversation sent again, several completions of one prompt). A prompt that
shares at least ``SHARED_MIN`` more tokens with a prompt being prefilled than
any kept state covers waits for that prefill to reach the end of the common
part, where a state is kept (its last token pending); it then continues from
that state and prefills only the rest. Waiting costs it nothing: prompts are
prefilled in arrival order, so it would have waited for the earlier one anyway.

A first turn's system prompt and tools (``GenerationParams.shared_prefix``)
get a state kept where they end, whatever arrives with them: every new
conversation with the same system prompt then begins from it.
"""

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Set, Tuple, Union

from ..core.sequence import SpeculativeDecoder
from ..states.snapshot import capture
from .events import Job
from ..states.memory import StateCache, common_prefix

log = logging.getLogger("mlx_spec.server")

SHARED_MIN = 32  # tokens in common worth keeping a state for


@dataclass
class Joining:
    """A job whose prompt is being prefilled, chunk by chunk."""

    job: Job
    draft: str
    num_draft_tokens: Union[int, str]
    decoder: SpeculativeDecoder
    todo: List[int]  # prompt tokens still to feed; the last one stays pending
    keep: bool  # keep the state at the end of the prompt
    marks: Set[int] = field(default_factory=set)  # keep a state at these lengths
    # how its tokens are chosen once it decodes (mlx-lm's; None: greedy, none)
    sampler: Optional[Callable] = None
    logits_processors: Optional[List[Callable]] = None

    @property
    def fed(self) -> int:
        """Prompt tokens fed so far (the last of them pending)."""
        return len(self.decoder.history)

    @property
    def prompt(self) -> List[int]:
        return self.decoder.history + self.todo


class PrefillQueue:
    """The joining prompts in arrival order, and the jobs waiting for one of
    them to reach the prefix they share."""

    def __init__(self, states: StateCache, chunk: int):
        self.states, self.chunk = states, chunk
        self.joining: "deque[Joining]" = deque()
        self.waiting: List[Tuple[Job, Joining, int]] = []  # (job, its prefill, length)

    def __len__(self) -> int:
        return len(self.joining) + len(self.waiting)

    def join(self, j: Joining, shared_prefix: int = 0):
        """Queue ``j``, to keep a state after its first ``shared_prefix``
        tokens too (those other requests likely begin with) when that covers
        at least ``SHARED_MIN`` more than the state it continues."""
        if j.fed + SHARED_MIN <= shared_prefix < len(j.prompt):
            j.marks.add(shared_prefix)
        self.joining.append(j)

    def keep(self, j: Joining):
        """Keep ``j``'s state as fed so far, its last token pending."""
        self.states.insert(capture(j.decoder, copy_caches=True, flush=False))

    def wait_to_share(self, job: Job, draft: str, covered: int) -> bool:
        """Whether ``job`` waits for a joining prompt to reach a prefix they
        share (``covered``: the tokens of it a kept state already holds);
        where one is there already, its state is kept now instead."""
        best, length = None, covered + SHARED_MIN - 1
        for j in self.joining:
            n = common_prefix(j.prompt, job.prompt)
            if j.draft == draft and n > length and j.fed <= n:
                best, length = j, n
        if best is None:
            return False
        if best.fed == length:  # there already
            self.keep(best)
            return False
        if length == len(best.prompt):
            best.keep = True  # kept when it joins the batch
        else:
            best.marks.add(length)
        self.waiting.append((job, best, length))
        return True

    def admits_next(self, budget: int) -> bool:
        """Whether feeding ``budget`` tokens now would admit a prompt."""
        return bool(self.joining) and len(self.joining[0].todo) <= budget

    def feed(self, budget: int, admit: Callable[[Joining], None]) -> List[Job]:
        """Feed the joining prompts ``budget`` tokens, stopping at each length
        where a state is to be kept; ``admit`` each prompt fed whole; drop
        one whose job was cancelled (between chunks). Returns the waiting jobs
        whose prefix is now kept (or whose prefill ended), to start again."""
        released = []
        while self.joining:
            j = self.joining[0]
            if j.job.cancelled:  # its client left: the rest is not prefilled
                released += self._release(j, True)
                self.joining.popleft()
                continue
            stop = min((m for m in j.marks if m > j.fed), default=len(j.prompt))
            n = min(self.chunk, budget, stop - j.fed)
            if j.todo and n == 0:
                break  # the budget is spent
            try:
                if n:  # the drafter sees the tokens up to ``stop`` at once
                    j.decoder.feed(j.todo[:n], more=j.fed + n < stop)
                    j.todo, budget = j.todo[n:], budget - n
                if j.fed in j.marks:
                    j.marks.discard(j.fed)
                    self.keep(j)
                done = not j.todo
                if done:
                    if j.keep:
                        self.keep(j)
                    admit(j)
            except Exception as e:  # reported to its client; the others go on
                done = True
                log.exception("request failed")
                j.job.put(e)
            released += self._release(j, done)
            if done:
                self.joining.popleft()
        return released

    def _release(self, j: Joining, done: bool) -> List[Job]:
        ready = [w for w in self.waiting if w[1] is j and (done or w[2] <= j.fed)]
        self.waiting = [w for w in self.waiting if all(w is not r for r in ready)]
        return [job for job, _, _ in ready]
