"""A pass as a plan: what each row drafted, and what the target forward
will compute.

The scheduler (:mod:`.scheduler`) makes one :class:`PassPlan` a pass; the
engine (:mod:`.batch`) runs the target over it and verifies each row's
:class:`Draft`. The plan is all the pass's decisions in values: nothing else
says what was drafted, where, or what it cost.
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..drafters.contract import NO_PROPOSAL, DraftSite, Proposal
from .draft_lengths import RowGroup
from .pass_cost import PassShape

Forward = Tuple[mx.array, Optional[mx.array]]  # logits [B, T, V], hidden [B, T, H]


@dataclass(frozen=True)
class Draft:
    """One row's part of a plan: its drafter's proposal, and the host
    seconds it took (0 for a draft made on the device: no host timer sees
    that work, which the verify pass evaluates)."""

    proposal: Proposal
    seconds: float = 0.0

    @property
    def tokens(self) -> mx.array:
        return self.proposal.tokens

    @property
    def on_device(self) -> bool:
        return len(self.proposal) > 0 and self.proposal.site is DraftSite.DEVICE

    def __len__(self) -> int:
        return len(self.proposal)


NO_DRAFT = Draft(NO_PROPOSAL)


@dataclass(frozen=True)
class PassPlan:
    """One pass: each active row's draft (row index in the batch -> its
    draft), and what the target forward computes over them."""

    drafts: Dict[int, Draft]
    rows: int  # rows the forward computes (every row of the batch)
    head_steps: int  # steps of the MTP head its drafts ran
    catch_up: int  # positions of the head's catch-up its drafts ran
    context: int  # tokens before the pass, averaged over the active rows
    queued: Optional[Forward] = None  # its forward, started by the pass before
    # The auto rows, each with the group whose length it drafted under.
    groups: Dict[int, RowGroup] = field(default_factory=dict)
    forwards: int = 0  # drafting rows whose draft ran a forward of its own

    @cached_property
    def T(self) -> int:
        """Positions per row: the pending token and the longest draft."""
        return 1 + max(len(d) for d in self.drafts.values())

    @property
    def lengths(self) -> List[int]:
        """Positions each row computes (0: a row that is not active)."""
        lengths = [0] * self.rows
        for b, draft in self.drafts.items():
            lengths[b] = 1 + len(draft)
        return lengths

    @property
    def padded(self) -> Optional[List[int]]:
        """The row lengths when some row is shorter than ``T`` (its end is
        padding), else None."""
        lengths = self.lengths
        return lengths if any(n < self.T for n in lengths) else None

    @property
    def drafting(self) -> int:
        """Rows that draft."""
        return sum(1 for d in self.drafts.values() if len(d))

    @property
    def shape(self) -> PassShape:
        """What the pass computes, as the cost model reads it."""
        return PassShape(
            self.rows,
            self.T,
            self.drafting,
            self.head_steps,
            self.catch_up,
            self.context,
            self.forwards,
        )

    def without_drafts(self) -> "PassPlan":
        """The same pass verifying no drafts (the head's work done for them
        stays in its shape: it ran; a lazy draft forward never runs)."""
        drafts = dict.fromkeys(self.drafts, NO_DRAFT)
        return PassPlan(
            drafts,
            self.rows,
            self.head_steps,
            self.catch_up,
            self.context,
            self.queued,
            self.groups,
            0,
        )
