"""Exploration at ``k = 0`` for the auto draft length: when a policy that
drafts nothing drafts one token anyway.

A policy that found drafting does not pay verifies no drafts, so it learns
nothing more about acceptance; a workload that turns predictable (a copy, a
repeated answer) would go unnoticed. :class:`ProbeSchedule` decides when
such a policy drafts one token (a probe) and how long it waits after one,
keeping what probes cost a bounded share of the plain passes between them.
Each group of rows sharing a draft length keeps one
(:mod:`.draft_lengths`; a sequence alone is one row of one group). Constants:
:mod:`.policy_tuning`; the evidence: ``docs/auto_policy.md``.
"""

import math

from .policy_tuning import PolicyTuning


class ProbeSchedule:
    """Exploration at ``k = 0``: when a policy that drafts nothing drafts one
    token anyway (a probe), so a workload that turns predictable is noticed.

    A probe comes after ``every`` plain passes. A rejected one doubles the
    wait (up to ``tuning.max_probe_every``: a probe of the MTP head costs its
    catch-up over every deferred row); an accepted one is followed by another
    at once while the first position has little evidence, and the wait never
    lets probes cost more than ``tuning.probe_budget`` of the plain passes
    between them (:meth:`space`). A first draft judged without a verify pass
    counts as a probe (:meth:`restart`)."""

    def __init__(self, tuning: PolicyTuning):
        self.tuning = tuning
        self.every = tuning.probe_every  # plain passes before the next probe
        self.waited = 0  # plain passes since the last probe
        self.probing = False  # the last choice was a probe
        # The dearest probe since the last spacing (a streak's first probe
        # pays the head's resumption, the ones after it do not).
        self.dearest = 0.0

    def apply(self, best: int, limit: int) -> int:
        """``best``, or one draft where a probe is due (``best == 0``)."""
        self.probing = False
        if best == 0 and limit > 0:
            self.waited += 1
            if self.waited < self.every:
                return 0
            self.probing = True
        self.waited = 0
        return max(best, int(self.probing))  # MLX refuses a bool as a slice bound

    def due(self):
        """The next choice at ``k = 0`` probes: a draft was chosen for a
        pass that could not make it (it ran a forward queued ahead)."""
        self.waited = max(self.waited, self.every)

    def restart(self):
        """Evidence came without a probe: the next waits a full interval."""
        self.waited = 0

    def plain_next(self) -> bool:
        """Whether the next choice at ``k = 0`` will not probe."""
        return self.waited + 1 < self.every

    def probed(self, accepted: bool, evidence: float):
        """A probe's draft was verified; ``evidence``: the first position's
        decayed trials before it."""
        self.probing = False
        if accepted:
            streak = evidence + 1 < self.tuning.probe_streak_evidence
            self.every = 1 if streak else self.tuning.probe_every
        else:
            longer = max(2 * self.every, self.tuning.probe_every)
            self.every = min(longer, self.tuning.max_probe_every)

    def space(self, probe_seconds: float, plain_seconds: float):
        """A probe took ``probe_seconds``: wait long enough before the next
        for probes to cost at most ``tuning.probe_budget`` of the plain
        passes between them. Within a streak the wait is 1; its probes are
        remembered, and the streak's end is spaced by its dearest: the
        first probe after a rest resumes the drafter (the MTP head catches
        up on every kept row, 5-10 plain passes in a batch of 8), the
        cheap ones after it must not set the wait before the next rest's."""
        self.dearest = max(self.dearest, probe_seconds - plain_seconds)
        if self.every <= 1:
            return
        budget = self.tuning.probe_budget * plain_seconds
        wait = math.ceil(self.dearest / budget)
        self.every = min(max(self.every, wait), self.tuning.max_probe_every)
        self.dearest = 0.0


class _ProbeFields:
    """The schedule's fields under the names callers used before it was one
    object (``policy.probe_every``, ``.passes_at_zero``, ``.probing``)."""

    probes: ProbeSchedule

    probe_every = property(
        lambda self: self.probes.every,
        lambda self, v: setattr(self.probes, "every", v),
    )
    passes_at_zero = property(
        lambda self: self.probes.waited,
        lambda self, v: setattr(self.probes, "waited", v),
    )
    probing = property(
        lambda self: self.probes.probing,
        lambda self, v: setattr(self.probes, "probing", v),
    )
