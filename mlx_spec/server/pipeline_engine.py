"""The engine of one rank of a pipeline (a target split over
``mx.distributed`` ranks): every rank decodes the same jobs in the same order,
as rank 0 decides them.
"""

import pickle
from dataclasses import asdict
from typing import List

from ..models.pipeline import broadcast_bytes
from .engine import Engine
from .events import GenerationParams, Job


class _Discard:
    def put(self, item):
        pass


class PipelineEngine(Engine):
    """The engine of one rank of a pipeline: every rank decodes the same jobs
    in the same order. Rank 0 (the HTTP side) decides what each iteration
    admits and cancels and sends that to the others; the rest of the engine
    is deterministic, so the ranks stay in lock-step."""

    def __init__(self, *args, group, **kwargs):
        self.group = group
        super().__init__(*args, **kwargs)

    def _incoming(self, free: int) -> List[Job]:
        if self.group.rank() == 0:
            jobs = super()._incoming(free)
            plan = {
                "jobs": [(j.prompt, asdict(j.params), j.initial_state) for j in jobs],
                "cancel": [i for i, o in self._live.items() if o.job.cancelled],
                "close": self._closing,
            }
            broadcast_bytes(self.group, pickle.dumps(plan))
            return jobs
        plan = pickle.loads(broadcast_bytes(self.group, None))
        for i in plan["cancel"]:
            self._live[i].job.cancel()
        self._closing = plan["close"]
        jobs = [Job(p, GenerationParams(**params), s) for p, params, s in plan["jobs"]]
        for job in jobs:
            job.events = _Discard()  # rank 0 answers the client
        return jobs
