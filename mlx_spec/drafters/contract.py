"""What the decode engine asks of a drafter: one core contract, and optional
ones a drafter implements when it has what they describe.

A drafter proposes tokens after the pending token; the target verifies them
in one pass and the drafter is told what was kept.

- :class:`Drafter` (the core): a name, whether it reads the target's hidden
  states, ``reset`` with a prompt, ``propose`` up to ``k`` tokens as a
  :class:`Proposal`, ``accept`` the tokens a pass kept. Every drafter the
  engine holds is typed as this; ``drafters.register`` makes one available
  by name, and nothing in ``core/`` names a drafter.
- Optional contracts, each a ``runtime_checkable`` protocol the engine asks
  about (:func:`judged` and the functions after it hold the defaults for a
  drafter without them, in one place):

  - :class:`SamplesDrafts`: it chooses draft tokens from logits, so the
    target's sampler and logits processors decide how (rejection sampling
    then needs its q).
  - :class:`KnowsEmpty`: it can tell, without running anything, that the
    next draft would be empty.
  - :class:`ReadsPromptRows`: of a prompt's hidden states it reads only the
    last few (the others need not be computed).
  - :class:`SelfJudging`: it names the source of its next draft and judges
    first drafts in hindsight (``auto`` learns from them, a policy a
    source).
  - :class:`DefersWork`: it defers work on accepted tokens (the MTP head's
    rows) until a draft needs it, and hands that work over with a kept
    state.
  - :class:`Suspends`: its upkeep on accepted tokens (the MTP head's
    forwards, its judging) stops while ``auto`` drafts nothing from a
    source for a while, and resumes before that source drafts or probes.
  - :class:`KeepsArrays`: it keeps arrays a saved state must carry (a
    drafter without them is rebuilt from the token history).
  - :class:`HeadBased`: it drafts with the model's MTP head, so a batch can
    run its rows' heads as one forward.
  - :class:`ReadsFeatures`: its hidden states are the outputs of target
    layers a tap on the model records, not the post-norm state.
  - :class:`TakesPromptInPieces`: it reads every row of a prompt and takes
    a prompt fed in chunks chunk by chunk, with the same result as in one
    piece (the sequence then holds no chunk's rows for it).
  - :class:`DraftsLong`: its drafts are worth trying past
    :data:`MAX_AUTO_DRAFT_TOKENS` under ``auto`` (a block drafter's block).
  - :class:`ForwardsToDraft`: a draft runs a forward of its own, once a pass
    whatever its length (a block forward); ``auto`` prices it.

The engine's values have one type each: a draft is a :class:`Proposal`
(tokens ``mx.array`` [m] uint32, m <= k, lazy when made on the device; its
q when sampled), hidden states are ``mx.array`` [rows, H] or None.
"""

from dataclasses import dataclass
from enum import Enum
from typing import (
    Dict,
    List,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    runtime_checkable,
)

import mlx.core as mx

Hindsight = Dict[Optional[str], Tuple[int, int]]  # source -> (hits, trials)
DeferredPass = Tuple[mx.array, mx.array]  # tokens [n], hidden [n, H] of one pass
HEAD_SOURCE = "mtp"  # the source name of drafts a head-based drafter's head makes
MAX_AUTO_DRAFT_TOKENS = 8  # "auto"'s ceiling unless a drafter declares its own


@dataclass(frozen=True)
class DraftForwardCost:
    """What a drafter's own draft forward adds to a pass in which it drafts:
    seconds after a short context, and their growth per 1,000 tokens of
    context (the drafter attends to every committed position)."""

    seconds: float
    per_kilotoken: float = 0.0


NO_DRAFT_FORWARD = DraftForwardCost(0.0)  # drafts made without a forward


class DraftSite(Enum):
    """Where a draft was made: its host time is its cost, or it is lazy and
    computed on the device with the verify pass (no host timer sees it)."""

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True)
class Proposal:
    """A drafter's draft for the next pass."""

    tokens: mx.array  # [m] uint32, m <= k; lazy when made on the device
    probs: Optional[mx.array] = None  # [m, V] q of a sampled draft; None: deterministic
    site: DraftSite = DraftSite.HOST

    def __len__(self) -> int:
        return self.tokens.size


NO_PROPOSAL = Proposal(mx.array([], mx.uint32))  # a pass that drafts nothing


def host_proposal(tokens: Sequence[int]) -> Proposal:
    """A deterministic draft made on the host (a list of ints)."""
    return Proposal(mx.array([int(t) for t in tokens], mx.uint32))


class DraftChooser(Protocol):
    """How a drafter chooses each draft token from its logits when the
    target samples or processes its logits (``sampling.make_draft_sampler``)."""

    samples: bool  # True: a sample (q given); False: a processed argmax

    def __call__(
        self, logits: mx.array, drafted: List[mx.array]
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """logits [V], the tokens drafted so far -> (token, q [V] or None)."""


class Drafter(Protocol):
    """The core contract: what every drafter the engine holds does."""

    name: str  # how it is asked for (``draft=``) and named in saved states
    needs_hidden: bool  # reset/accept need the target's hidden states

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]) -> None:
        """A new history. hidden: [N-1, H] post-norm target states of
        ``prompt[:-1]`` when ``needs_hidden``, else None."""

    def propose(self, k: int) -> Proposal:
        """Up to ``k`` (>= 1) tokens after the pending token."""

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]) -> None:
        """The tokens a verify pass kept (accepted drafts and the target's
        own next token); hidden: [len(tokens), H] for the inputs that
        produced them (``needs_hidden``), else None."""


@runtime_checkable
class UserDrafter(Protocol):
    """The least a user's own drafter object needs (host lists of ints);
    ``as_drafter`` adapts one to :class:`Drafter`."""

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]) -> None: ...

    def draft(self, k: int) -> Sequence[int]: ...

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]) -> None: ...


@runtime_checkable
class SamplesDrafts(Protocol):
    """A drafter whose tokens are chosen from logits (it may sample)."""

    def set_sampling(self, choose: Optional[DraftChooser]) -> None:
        """Choose drafts with ``choose`` (None: the drafter's own argmax)."""


@runtime_checkable
class KnowsEmpty(Protocol):
    def can_draft(self) -> bool:
        """False when the next draft is known to be empty without running
        anything; a batch counts such a row as one token."""


@runtime_checkable
class ReadsPromptRows(Protocol):
    def rows_read(self, n: int) -> int:
        """Of the hidden states of ``n`` rows given at once (a prompt), how
        many, the last ones, it reads; the others may be anything."""


@runtime_checkable
class SelfJudging(Protocol):
    """A drafter with named sources that judges first drafts in hindsight."""

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """The source that drafts ``k`` tokens next (``HEAD_SOURCE``, or
        another name; None: its one unnamed source, or nothing to draft).
        ``look``: it may run deferred work to answer exactly."""

    def hindsight(self) -> Hindsight:
        """Per source, (hits, trials) of first drafts judged without being
        verified since the last call, counted where passes drafting one
        token would have started (``OneDraftWalk``). The first call turns
        judging on."""

    def set_source_paying(self, source: str, paying: bool) -> None:
        """``auto`` says whether drafting from ``source`` pays now, so that
        the drafter need not run that source just to choose between them."""


@runtime_checkable
class DefersWork(Protocol):
    """A drafter that defers work on accepted tokens (the MTP head's rows)."""

    def catch_up(self) -> None:
        """Deferred work done now, so that timing the next draft measures
        drafting alone."""

    def take_deferred(self) -> List[DeferredPass]:
        """The deferred work handed over (no longer held here)."""

    def put_deferred(self, rows: List[DeferredPass]) -> None:
        """Hold ``rows`` (from :meth:`take_deferred`) as deferred work again."""


@runtime_checkable
class Suspends(Protocol):
    """A drafter whose upkeep on accepted tokens (the MTP head's forwards
    over its rows, its judging in hindsight) can stop while a source's
    drafts do not pay, so that carrying it costs nothing then."""

    def suspend(self, source: str) -> None:
        """``auto`` has drafted nothing from ``source`` for a while and will
        not probe it at the next pass: its upkeep stops (no forward, no
        judging), and it keeps at most a bounded tail of what resuming
        needs."""

    def resume(self, source: str) -> None:
        """``source`` may draft or probe at the next pass: its state is made
        current when it next drafts (without a target forward)."""


@runtime_checkable
class KeepsArrays(Protocol):
    """A drafter whose state is more than its token history."""

    def saved_arrays(self) -> List[mx.array]:
        """Arrays to save with a state (deferred work run first)."""

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]) -> None:
        """Rebuild from :meth:`saved_arrays`'s arrays and the token history."""

    def check_state(
        self, arrays: Sequence[mx.array], deferred: List[DeferredPass]
    ) -> None:
        """``ValueError`` unless ``arrays`` and ``deferred`` (read from a
        file) are what :meth:`saved_arrays` and ``take_deferred`` could
        have given: a state is checked before it is restored."""


@runtime_checkable
class HeadBased(Protocol):
    """A drafter whose drafts may come from the model's MTP head; a batch
    runs every such row's head steps as one forward (``core.batch_mtp``)."""

    @property
    def head_drafter(self):  # -> drafters.mtp.MTPDrafter (mtp imports this module)
        """The head's drafting part (the drafter itself, or one it holds)."""

    def needs_head_state(self, k: int) -> bool:
        """Whether drafting ``k`` tokens looks at the head's state (runs
        its deferred rows)."""

    def drafts_with_head(self, k: int) -> bool:
        """Whether drafting ``k`` tokens runs the head."""


@runtime_checkable
class ReadsFeatures(Protocol):
    """A drafter whose ``hidden`` rows are what the model's feature tap
    records (``core.target.feature_tap``), not the post-norm state."""

    reads_features: bool


@runtime_checkable
class TakesPromptInPieces(Protocol):
    """A drafter that reads every row of a prompt and takes the chunks of a
    prompt fed in chunks (``feed(..., more=True)``) one by one, as they are
    computed, with the same result as from one piece (the dflash drafter's
    context). The sequence hands it each chunk at once and evaluates its
    arrays, so that a long prompt's rows are never all held."""

    takes_prompt_in_pieces: bool


@runtime_checkable
class DraftsLong(Protocol):
    """A drafter whose drafts ``auto`` considers up to its own ceiling (a
    block drafter drafts its whole block in one forward, so its deep
    positions cost the verify pass only)."""

    max_auto_draft: int  # the longest draft ``auto`` may choose for it


@runtime_checkable
class ForwardsToDraft(Protocol):
    """A drafter whose draft runs a forward of its own, once in a pass it
    drafts in whatever the draft's length, none in a plain pass, dearer as
    its context grows (a block forward)."""

    def draft_forward_cost(self) -> DraftForwardCost:
        """Its draft forward's measured cost (the prior ``auto`` refines
        from the passes it times)."""
