"""The verify-cost profile as ``auto`` uses it, corrected by the passes it times.

A profile is measured once per machine and kept on disk (see
:mod:`~mlx_spec.core.verify_profile`). One measured while the machine was
busy would otherwise price every later run: a one-token pass at twice its
quiet cost and nine tokens at 3.7 times that made ``auto`` draft 1.4-1.9
tokens a pass where a fresh profile drafted 2.1-5.3. So every fairly timed
pass is compared with what the profile says its verify forward costs, and
where the last few passes of one length keep disagreeing, the profile moves
to what they show (and is written back).

The profile is the fastest each forward has been seen to run here: the
minimum of a few measured rounds, lowered where a timed pass ran faster. A
pass takes its verify forward *plus* drafting and host work, so the second
fastest of the last ``heal_window`` passes of ``T`` tokens (one mis-timed
pass cannot move it) bounds the forward over ``T`` tokens from above,
whatever the pass drafted; a profile dearer than that by more than
``heal_down`` is lowered to it. A pass dearer than the profile
is not attributed to its forward (host work, head steps, a busy moment): the
policy's online fit prices that, per generation. A length that was never
timed moves with the nearest lengths that were (a busy moment slows every
length), so a profile that made drafting look dear lets drafting start, and
the lengths it then drafts are corrected in turn.
"""

import threading
from collections import deque
from typing import Callable, Dict, List, Optional, Tuple

from .policy_tuning import DEFAULT_TUNING, PolicyTuning

SHORT_CONTEXT = 32  # tokens of context the short profile is measured after


class CostProfile:
    """Seconds of a target forward over ``T = 1..n`` tokens (index 0 is
    ``T = 1``) after ``SHORT_CONTEXT`` tokens, and optionally after a longer
    context (``long``: (its length, its costs)), interpolated linearly in the
    context between the two.

    ``store``: called with (short, long) after a correction, to keep it
    (None: kept for this object only). ``version`` counts corrections, so a
    fit over residuals from the old costs knows to start again. One profile
    is shared by every generation of a model in a process; each pass says
    under which tuning it corrects it (``heal_window``, ``heal_down``)."""

    def __init__(
        self,
        short: List[float],
        long: Optional[Tuple[int, List[float]]] = None,
        store: Optional[Callable] = None,
    ):
        self.short = short  # shared with the process's cache: corrected in place
        self.long = long
        self._store = store
        self._measured = [list(short), list(long[1]) if long else None]
        self._scale = [1.0] * len(short)  # corrected / measured, per T
        self._healed: set = set()  # T - 1 of lengths corrected from passes
        self._recent: Dict[int, deque] = {}  # T - 1 -> recent pass / profile ratios
        self.version = 0
        self._lock = threading.Lock()  # generations in threads share one profile
        self.shape_checked = False  # its shape was checked (check_shape)

    def __len__(self) -> int:
        return len(self.short)

    def extend(self, short: List[float], long: Optional[List[float]] = None):
        """Costs of the lengths after the last (``T = n + 1, ...``), measured
        now (``long``: after the long context): appended as measured, not
        scaled by corrections of shorter lengths measured another time (a
        length never timed must not look cheaper than it was measured),
        and the profile kept rising in T and stored."""
        with self._lock:
            self._measured[0] += list(short)
            self._scale += [1.0] * len(short)
            self.short[:] = _rising(
                [c * s for c, s in zip(self._measured[0], self._scale)]
            )
            if self.long is not None:
                self._measured[1] += list(long)
                scaled = [c * s for c, s in zip(self._measured[1], self._scale)]
                self.long[1][:] = _rising(scaled)
            self.version += 1
            if self._store is not None:
                self._store(self.short, self.long)

    def verify_cost(self, k: int, context: int = SHORT_CONTEXT) -> float:
        """Seconds of a verify forward over ``1 + k`` tokens after ``context``."""
        base = self.short[k]
        if self.long is None:
            return base
        c1, long = self.long
        slope = max(long[k] - base, 0.0) / (c1 - SHORT_CONTEXT)
        return base + slope * max(context - SHORT_CONTEXT, 0)

    def observe(
        self,
        k: int,
        context: int,
        seconds: float,
        tuning: PolicyTuning = DEFAULT_TUNING,
    ) -> bool:
        """A fairly timed pass with ``k`` drafts after ``context`` tokens took
        ``seconds``; True when it corrected the profile (as ``tuning`` says)."""
        with self._lock:
            return self._observe(k, context, seconds, tuning)

    def _observe(self, k: int, context: int, seconds: float, tuning) -> bool:
        window = tuning.heal_window
        if window <= 0 or not 0 <= k < len(self.short):
            return False
        recent = self._recent.setdefault(k, deque(maxlen=window))
        if recent.maxlen != window:  # a pass under another tuning
            recent = self._recent[k] = deque(recent, maxlen=window)
        recent.append(seconds / self.verify_cost(k, context))
        if len(recent) < window:
            return False
        fast = sorted(recent)[min(1, window - 1)]  # one mis-timed pass is not news
        if fast >= 1 - tuning.heal_down:
            return False
        self._correct(k, fast)
        return True

    def _correct(self, k: int, ratio: float):
        """Scale length ``k``'s costs by ``ratio``; lengths never corrected
        take the scale of the corrected lengths around them."""
        before = self._scale[:]
        self._scale[k] *= ratio
        self._healed.add(k)
        healed = sorted(self._healed)
        for j in range(len(self._scale)):
            if j in self._healed:
                continue
            below = [h for h in healed if h < j]
            above = [h for h in healed if h > j]
            if below and above:
                lo, hi = below[-1], above[0]
                w = (j - lo) / (hi - lo)
                self._scale[j] = (1 - w) * self._scale[lo] + w * self._scale[hi]
            else:
                self._scale[j] = self._scale[(below or above)[-1 if below else 0]]
        self.short[:] = _rising([c * s for c, s in zip(self._measured[0], self._scale)])
        if self.long is not None:
            long = [c * s for c, s in zip(self._measured[1], self._scale)]
            self.long[1][:] = _rising(long)
        for j, recent in self._recent.items():  # ratios to the new costs
            rescaled = [r * before[j] / self._scale[j] for r in recent]
            recent.clear()
            if j != k:  # the corrected length's window starts again
                recent.extend(rescaled)
        self.version += 1
        if self._store is not None:
            self._store(self.short, self.long)

    def check_shape(self, measure: Callable[[int], List[float]], tuning) -> bool:
        """Once per profile: where its shape is implausible
        (:func:`implausible_lengths` by ``tuning.implausible_ratio``, short
        or long), measure it again (``measure(context)``: seconds for T =
        1..n after ``context`` tokens) and keep and store that instead; True
        when it did. A length ``auto`` never tries is never timed, so a
        busy measurement of it would otherwise price it forever."""
        with self._lock:
            if self.shape_checked:
                return False
            self.shape_checked = True
            ratio = tuning.implausible_ratio
            shapes = [self.short] + ([self.long[1]] if self.long else [])
            if not any(implausible_lengths(costs, ratio) for costs in shapes):
                return False
            self.short[:] = _rising(measure(SHORT_CONTEXT)[: len(self.short)])
            if self.long is not None:
                self.long[1][:] = _rising(measure(self.long[0])[: len(self.short)])
            self._measured = [
                list(self.short),
                list(self.long[1]) if self.long else None,
            ]
            self._scale = [1.0] * len(self.short)
            self._healed.clear()
            self._recent.clear()
            self.version += 1
            if self._store is not None:
                self._store(self.short, self.long)
            return True


def implausible_lengths(costs: List[float], ratio: float) -> List[int]:
    """Indices ``k`` (T = k + 1 >= 3 tokens) of ``costs`` (T = 1..n) whose
    forward costs more than ``ratio`` times the cheapest pair of shorter
    forwards covering its tokens: one forward over a + b tokens computes what
    two over a and b do, in fewer steps, so such a cost was measured while
    the machine was busy (a profile flat at three times T = 2 from T = 3 on)."""
    found = []
    for k in range(2, len(costs)):
        T = k + 1
        pair = min(costs[a - 1] + costs[T - a - 1] for a in range(1, T // 2 + 1))
        if costs[k] > ratio * pair:
            found.append(k)
    return found


def _rising(costs: List[float]) -> List[float]:
    """``costs`` made non-decreasing in T (a longer forward never costs less)."""
    out: List[float] = []
    for c in costs:
        out.append(max(c, out[-1] if out else 0.0))
    return out


def as_cost_profile(costs, long: Optional[Tuple[int, List[float]]] = None):
    """``costs`` as a :class:`CostProfile`: itself, or a list of seconds
    (with ``long``) kept for the new object only."""
    if isinstance(costs, CostProfile):
        return costs
    return CostProfile(list(costs), (long[0], list(long[1])) if long else None)
