"""The generation worker: every request decoded speculatively and losslessly,
the requests in flight verified together in one target pass per step.

HTTP handlers hand a :class:`Job` to :meth:`Engine.submit` and read its
events. One worker thread owns the model: between passes it takes waiting jobs
while the batch has room (each continuing the longest kept decoder state its
prompt extends, so only new tokens are prefilled), prefills them in chunks of
``prefill_chunk`` tokens, one chunk between two passes while requests decode
(so a long prompt joining never stalls the others for its whole prefill),
back to back while nothing decodes; a prompt prefilled joins the batch. Then
it runs one :class:`BatchDecoder` step for every decoding job and lets
finished or cancelled ones leave, keeping their state for a later turn.

States are kept with their last token pending (the prompt's when it joins, the
last one emitted when it leaves): keeping one costs no forward, and a later
prompt that continues it processes that token in its own prefill. A prompt
that begins like one being prefilled waits for it to reach the end of the
common part and continues from the state kept there (:mod:`.prefill`).
With a disk tier (:mod:`mlx_spec.states.store`), states leaving memory, and
all of them when the engine closes, are written in the background; a prompt
that continues a longer state on disk than in memory loads it.

A job's events: ``Started`` once (prompt and cached token counts), then
``Token``, ``Segment`` (content or reasoning) and ``ToolCall`` events, each
pass's with a ``Progress`` (the row's speculation counters so far), then
``Finished``; or one exception (a request whose own sampler or logits
processors raise gets theirs and leaves the batch; the others go on, see
:mod:`~mlx_spec.core.row_guard`). ``Job.cancel()`` (a client that went away)
ends its generation after the current pass.
"""

import logging
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx

from ..core.batch import BatchDecoder, RowOptions
from ..core.sampling import make_sampler, xtc_special_tokens
from ..drafters.base import MAX_DRAFT_TOKENS
from ..mlx_lm_compat import make_logits_processors
from ..session import DecodeOptions, Session, check_max_tokens
from ..states.snapshot import capture, shared
from ..states.store import StateStore
from .events import GenerationParams, Job, Progress, Started
from .job_output import JobOutput, speculation_counters
from .prefill import Joining, PrefillQueue
from ..states.memory import StateCache

log = logging.getLogger("mlx_spec.server")


class Engine:
    """Owns the model and the kept states; decodes on one worker thread."""

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
        batch_size: int = 4,
        prefill_chunk: int = 256,
        start: bool = True,
        state_store: Optional[StateStore] = None,
        context_length: Optional[int] = None,
    ):
        """``context_length``: the model's context (its
        ``max_position_embeddings``); no reply runs past it (None: unknown)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk, self.context_length = prefill_chunk, context_length
        self.model, self.tokenizer = model, tokenizer
        self.draft, self.num_draft_tokens = draft, num_draft_tokens
        self.max_ngram, self.prefill_step_size = max_ngram, prefill_step_size
        self.rollback, self.batch_size = rollback, batch_size
        self.store = state_store  # the disk tier under ``states``, if any
        spill = None if state_store is None else state_store.put
        self.states = StateCache(cache_bytes, cache_entries, evicted=spill)
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._live: Dict[int, JobOutput] = {}
        self.prefills = PrefillQueue(self.states, prefill_chunk)
        self._closing = False
        self.peak_decoding = 0  # most requests verified in one pass so far
        # the worker's time so far: prefilling joining prompts, and passes
        self.work = {"prefill_s": 0.0, "passes_s": 0.0, "passes": 0, "rows": 0}
        self._worker = threading.Thread(target=self._work, name="mlx_spec-engine")
        self._worker.daemon = True
        if start:
            self.start()

    def start(self):
        self._worker.start()

    # -- the HTTP side -----------------------------------------------------
    def submit(self, job: Job) -> Job:
        if self._worker.ident is not None and not self._worker.is_alive():
            raise RuntimeError("the generation worker has stopped")
        self._jobs.put(job)
        return job

    def close(self):
        """Stop the worker once the requests in flight end; the states kept
        in memory are then written to the disk tier (waited for)."""
        self._jobs.put(None)
        self.join(timeout=60)
        if self.store is not None:
            self.store.close()

    def join(self, timeout=None):
        """Wait for the worker to end (after :meth:`close`, or rank 0's)."""
        self._worker.join(timeout=timeout)

    @property
    def healthy(self) -> bool:
        return self._worker.is_alive()

    def status(self) -> dict:
        """For ``/health``: requests decoding and queued, the kept states, and
        the worker's time so far (prefilling prompts, running passes)."""
        return {
            "busy": bool(self._live),
            "decoding": len(self._live),
            "prefilling": len(self.prefills),
            "peak_decoding": self.peak_decoding,
            "worker": {
                "prefill_s": round(self.work["prefill_s"], 6),
                "passes_s": round(self.work["passes_s"], 6),
                "passes": self.work["passes"],
                "rows_per_pass": self.work["rows"] / max(self.work["passes"], 1),
            },
            "queued": self._jobs.qsize(),
            "kept_states": self.states.histories(),
            "kept_bytes": self.states.nbytes,
            **({} if self.store is None else {"disk": self.store.status()}),
        }

    # -- the worker ----------------------------------------------------------
    def _new_batch(self) -> BatchDecoder:
        return BatchDecoder(
            self.model, self.batch_size, MAX_DRAFT_TOKENS, self.rollback
        )

    def _incoming(self, free: int) -> List[Job]:
        """The jobs to start before the next pass (at most ``free``); waits
        for one only when nothing is decoding or prefilling. Sees the
        closing request."""
        jobs = []
        while len(jobs) < free and not self._closing:
            try:
                busy = self._live or self.prefills or jobs
                job = self._jobs.get(block=not busy)
            except queue.Empty:
                break
            if job is None:
                self._closing = True
            elif not job.cancelled:
                jobs.append(job)
        return jobs

    def _work(self):
        batch = self._new_batch()
        while not (self._closing and not self._live and not self.prefills):
            for job in self._incoming(batch.free - len(self.prefills)):
                self._start(job)
            tic = time.perf_counter()
            self._prefill(batch)
            self.work["prefill_s"] += time.perf_counter() - tic
            if self._live:
                try:
                    self._step(batch)
                except Exception as e:  # every request in the batch fails, cleanly
                    log.exception("verify pass failed")
                    for output in self._live.values():
                        output.job.put(e)
                    self._live.clear()
                    batch = self._new_batch()
        if self.store is not None:  # the server stops: its states outlive it
            for state in self.states.take_all():
                self.store.put(state)

    def _kept(self, draft: str, prompt: List[int]):
        """The kept state with the longest history ``prompt`` continues: in
        memory, or on disk when a longer one is there (then kept in memory
        too)."""
        state = self.states.lookup(draft, prompt)
        if self.store is None:
            return state
        covered = 0 if state is None else len(state.history)
        found = self.store.lookup(draft, prompt, longer_than=covered)
        if found is None:
            return state
        self.states.insert(found)
        return found

    def _start(self, job: Job):
        """The job's decoder, from the longest kept state its prompt extends;
        it joins the prefilling jobs, or waits for one that will keep a
        longer state its prompt extends (a job cancelled meanwhile is dropped)."""
        if job.cancelled:
            return
        try:
            p = job.params
            draft = p.draft or self.draft
            num_draft_tokens = (
                self.num_draft_tokens
                if p.num_draft_tokens is None
                else p.num_draft_tokens
            )
            if draft == "none":
                num_draft_tokens = 0
            check_max_tokens(p.max_tokens)
            options = DecodeOptions(
                draft=draft,
                num_draft_tokens=num_draft_tokens,
                max_ngram=self.max_ngram,
                rollback=self.rollback,
                prefill_step_size=self.prefill_step_size,
            )
            self._budget(job)  # a prompt that fills the context fails here
            state = self._kept(draft, job.prompt)
            covered = 0 if state is None else len(state.history)
            if self.prefills.wait_to_share(job, draft, covered):
                return
            fresh = self.states.lookup(draft, job.prompt)  # one kept just now?
            if fresh is not None and len(fresh.history) > covered:
                state = fresh
            kept = None if state is None else shared(state)  # it stays kept
            session = Session(self.model, options, state=kept)
            sampler, processors = self._sampling(p)
            # as for a lone generation: said before any of the prompt is fed
            session.set_sampling(sampler, processors, job.prompt)
            new, cached = job.prompt, 0
            if state is not None:
                new = job.prompt[len(state.history) :]
                cached = len(state.history) - state.pending
            counters = speculation_counters(draft, session.stats, 0.0)
            job.put(Started(len(job.prompt), cached), Progress(counters))
            j = Joining(
                job,
                draft,
                num_draft_tokens,
                session.decoder,
                new,
                len(new) > 1,
                sampler=sampler,
                logits_processors=processors,
            )
            self.prefills.join(j, p.shared_prefix)
        except Exception as e:  # reported to its client; the others go on
            log.exception("request failed")
            job.put(e)

    def _budget(self, job: Job) -> int:
        """The most tokens ``job`` may emit: its ``max_tokens``, and no more
        than its prompt leaves of the model's context (so neither the
        target's passes nor the drafts verified with them run past it)."""
        if self.context_length is None:
            return job.params.max_tokens
        room = self.context_length - len(job.prompt)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(job.prompt)} tokens; the model's context "
                f"holds {self.context_length}, leaving no room for a reply"
            )
        return min(job.params.max_tokens, room)

    def _prefill(self, batch: BatchDecoder):
        """Feed the joining prompts: ``prefill_chunk`` tokens in all while
        requests decode, else the first prompt whole (in chunks); a prompt
        fed joins the batch, a job that waited for a shared prefix starts."""
        joining = self.prefills.joining
        if not joining:
            return
        budget = self.prefill_chunk if self._live else len(joining[0].todo)
        for job in self.prefills.feed(budget, lambda j: self._admit(batch, j)):
            self._start(job)

    def _sampling(self, p: GenerationParams) -> Tuple[Callable, List[Callable]]:
        """The sampler and logits processors a request's fields ask for."""
        sampler = make_sampler(
            p.temperature,
            p.top_p,
            p.min_p,
            1,
            top_k=p.top_k,
            xtc_probability=p.xtc_probability,
            xtc_threshold=p.xtc_threshold,
            xtc_special_tokens=xtc_special_tokens(self.tokenizer),
        )
        return sampler, make_logits_processors(**p.logits)

    def _admit(self, batch: BatchDecoder, j: Joining):
        """A prompt fed (its last token pending; its state kept, so that the
        next turn's prompt extends it even when this reply is tokenized
        differently there) joins the batch."""
        p = j.job.params
        if p.seed is not None:
            mx.random.seed(p.seed)
        budget = self._budget(j.job)
        output = JobOutput(j.job, self.tokenizer, j.draft, budget, j.decoder.stats)
        id = batch.add(
            j.decoder,
            RowOptions(
                budget,
                j.sampler,
                j.num_draft_tokens,
                stop_tokens=self.tokenizer.eos_token_ids,
                logits_processors=j.logits_processors,
            ),
        )
        self._live[id] = output

    def _step(self, batch: BatchDecoder):
        rows = len(batch.active)
        self.peak_decoding = max(self.peak_decoding, rows)
        # a prompt about to join would roll back a pass queued ahead of it
        joins = self.prefills.admits_next(self.prefill_chunk)
        tic = time.perf_counter()
        for id, (tokens, logprobs) in batch.step(queue_ahead=not joins).items():
            self._live[id].emit(tokens, logprobs)
        self.work["passes_s"] += time.perf_counter() - tic
        self.work["passes"] += 1
        self.work["rows"] += rows
        active = set(batch.active)
        for id, output in list(self._live.items()):
            error = batch.error(id)
            if error is not None:  # its own sampling raised: it alone ends
                batch.take(id)  # its state, drafted but not verified, is dropped
                del self._live[id]
                log.warning("request failed in its sampling: %r", error)
                output.job.put(error)
                continue
            if output.job.cancelled and output.reason is None:
                output.reason = "cancelled"
            if output.reason is None and id in active:
                continue
            decoder = batch.take(id)
            del self._live[id]
            self.states.insert(capture(decoder, flush=False))
            output.finish()
