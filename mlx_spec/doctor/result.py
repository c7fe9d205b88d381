"""What every part of ``mlx_spec doctor`` returns: a status, a reason, facts
and the checks behind the status.

A part's status is ``fail`` when one of its checks failed, else ``pass`` when
one passed, else ``skip``; a part may also set its status itself (a part that
could not run at all). :func:`run_part` turns anything a part raises into a
failed part, so one broken part never stops the others.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional

PASS, FAIL, SKIP = "pass", "fail", "skip"
STATUSES = (PASS, FAIL, SKIP)


@dataclass
class Check:
    """One verdict inside a part, e.g. one kernel or one drafter."""

    name: str
    status: str
    reason: str

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r} is not one of {STATUSES}")


@dataclass
class Part:
    """One of the report's parts."""

    name: str
    status: str = SKIP
    reason: str = ""
    facts: Dict[str, Any] = field(default_factory=dict)
    checks: List[Check] = field(default_factory=list)

    def check(self, name: str, status: str, reason: str) -> Check:
        c = Check(name, status, reason)
        self.checks.append(c)
        return c

    def settle(self, reason: str) -> "Part":
        """Set the status from the checks (see the module), with ``reason``
        unless a failed check's reason says more."""
        statuses = {c.status for c in self.checks}
        if FAIL in statuses:
            self.status = FAIL
            failed = [c for c in self.checks if c.status == FAIL]
            self.reason = f"{failed[0].name}: {failed[0].reason}"
            if len(failed) > 1:
                self.reason += f" (and {len(failed) - 1} more)"
        else:
            self.status = PASS if PASS in statuses else SKIP
            self.reason = reason
        return self

    def to_json(self) -> dict:
        return asdict(self)


def one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def run_part(name: str, body: Callable[[Part], Optional[Part]]) -> Part:
    """Run ``body(part)``; an exception becomes a failed part naming it."""
    part = Part(name)
    try:
        body(part)
    except Exception as e:  # one broken part must not stop the others
        part.status, part.reason = FAIL, f"the check itself failed: {one_line(e)}"
    return part


def skipped(name: str, reason: str) -> Part:
    return Part(name, SKIP, reason)
