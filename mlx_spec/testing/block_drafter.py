"""A drafter that tells ``auto`` what a block drafter tells it, and nothing
more: its own ceiling on ``auto`` drafts, and a draft forward of a given
cost. Tests of the choice of draft lengths read these contracts alone."""

from ..drafters.base import HostDrafter
from ..drafters.contract import DraftForwardCost


class PricedBlockDrafter(HostDrafter):
    """Declares ``max_auto_draft = ceiling`` and a draft forward costing
    ``cost``; it never drafts (the tests choose lengths, not tokens)."""

    name = "priced-block"

    def __init__(self, ceiling: int, cost: DraftForwardCost):
        self.max_auto_draft, self.cost = ceiling, cost

    def draft_forward_cost(self) -> DraftForwardCost:
        return self.cost
