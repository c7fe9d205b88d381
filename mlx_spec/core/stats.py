"""Counters and phase timings of a speculative generation."""

import time
from dataclasses import dataclass, field
from typing import Dict, List

import mlx.core as mx


@dataclass
class SpecStats:
    """Counters of one speculative generation."""

    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)
    passes_by_tokens: Dict[int, int] = field(default_factory=dict)  # T -> passes
    phases: Dict[str, float] = field(default_factory=dict)  # seconds (timing on)
    phase_cpu: Dict[str, float] = field(default_factory=dict)  # host CPU seconds
    profile_seconds: float = 0.0  # measuring the verify-cost profile (auto)

    def record(self, n_drafted: int, n_accepted: int, n_emitted: int):
        self.verify_passes += 1
        T = n_drafted + 1
        self.passes_by_tokens[T] = self.passes_by_tokens.get(T, 0) + 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.generated += n_emitted
        grow = n_drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(n_drafted):
            self.drafted_at[i] += 1
        for i in range(min(n_accepted, n_drafted)):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.verify_passes if self.verify_passes else 0.0

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_position)
        return (
            f"Speculation: {self.verify_passes} verify passes, "
            f"{self.accepted}/{self.drafted} drafted tokens accepted "
            f"({self.acceptance_rate:.1%}), "
            f"{self.tokens_per_pass:.2f} tokens per pass\n"
            f"Acceptance per draft position: {per_pos or '-'}"
        )


class PhaseClock:
    """Attributes wall time to the phases of a verify step (``stats.phases``),
    and the host thread's CPU time (``stats.phase_cpu``: the host's own work
    in a phase, since a host waiting for MLX's evaluation uses no CPU).

    Disabled (the default), ``lap`` does nothing, so the decode loop keeps its
    single host synchronisation per step. Enabled, each ``lap`` evaluates the
    arrays the phase produced, so their cost lands in that phase.
    """

    def __init__(self, stats: SpecStats, enabled: bool = False):
        self.stats, self.enabled = stats, enabled
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()

    def lap(self, phase: str, *arrays):
        if not self.enabled:
            return
        arrays = [a for a in arrays if a is not None]
        if arrays:
            mx.eval(*arrays)
        now, cpu = time.perf_counter(), time.thread_time()
        for totals, spent in (
            (self.stats.phases, now - self.last),
            (self.stats.phase_cpu, cpu - self.last_cpu),
        ):
            totals[phase] = totals.get(phase, 0.0) + spent
        self.last, self.last_cpu = now, cpu
