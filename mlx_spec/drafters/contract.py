"""What the decode engine asks of a drafter, as ``typing.Protocol``s.

A drafter proposes tokens after the pending token; the target verifies them
in one pass and the drafter is told what was kept. Three contracts:

- :class:`CoreDrafter`: what every drafter the engine holds does (the base
  class :class:`~mlx_spec.drafters.base.Drafter` gives the defaults, and
  ``as_drafter`` adapts a user's :class:`UserDrafter`).
- :class:`SelfJudging`: a drafter that names the source of its next draft
  and judges first drafts it did not make (``auto`` learns from them and
  keeps a draft-length policy per source).
- :class:`HeadBased`: a drafter that drafts with the model's MTP head, so a
  batch can run its rows' heads as one forward.

The engine's values have one type each: a draft is an ``mx.array`` [m]
(uint32, m <= k; possibly lazy, evaluated with the verify pass), hidden
states are ``mx.array`` [rows, H] or None.
"""

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


class DraftChooser(Protocol):
    """How a drafter chooses each draft token from its logits when the
    target samples or processes its logits (``sampling.make_draft_sampler``)."""

    samples: bool  # True: a sample (q given); False: a processed argmax

    def __call__(
        self, logits: mx.array, drafted: List[mx.array]
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """logits [V], the tokens drafted so far -> (token, q [V] or None)."""


@runtime_checkable
class UserDrafter(Protocol):
    """The least a user's own drafter object needs (host lists of ints)."""

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]) -> None: ...

    def draft(self, k: int) -> Sequence[int]: ...

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]) -> None: ...


class CoreDrafter(Protocol):
    """What the decode engine calls on every drafter. (Not checked with
    ``isinstance``: that would read ``state``, which runs deferred work.)"""

    name: str
    needs_hidden: bool  # reset/accept need the target's hidden states
    # [m, V] the distributions the last draft was sampled from (rejection
    # sampling needs them); None for a deterministic draft.
    draft_probs: Optional[mx.array]
    # Whether the last draft was computed on the device (lazy): the host's
    # time spent drafting is then no measure of its cost.
    drafted_on_device: bool

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]) -> None:
        """A new history. hidden: [N-1, H] post-norm target states of
        ``prompt[:-1]`` when ``needs_hidden``, else None."""

    def draft_tokens(self, k: int) -> mx.array:
        """Up to ``k`` tokens after the pending token: [m] uint32, m <= k."""

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]) -> None:
        """The tokens a verify pass kept (accepted drafts and the target's
        own next token); hidden: [len(tokens), H] for the inputs that
        produced them (``needs_hidden``), else None."""

    def set_sampling(self, choose: Optional[DraftChooser]) -> None:
        """Choose drafts with ``choose`` (None: the drafter's own argmax)."""

    def can_draft(self) -> bool:
        """False when the next draft is known to be empty without running
        anything; a batch counts such a row as one token."""

    def rows_read(self, n: int) -> int:
        """Of the hidden states of ``n`` rows given at once (a prompt), how
        many, the last ones, it reads; the others may be anything."""

    def catch_up(self) -> None:
        """Deferred work done now, so that timing the next draft measures
        drafting alone."""

    @property
    def state(self) -> List[mx.array]:
        """Arrays saved with a chat session (deferred work run first)."""

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]) -> None:
        """Rebuild from ``state``'s arrays and the token history."""

    def check_state(
        self, arrays: Sequence[mx.array], deferred: List[DeferredPass]
    ) -> None:
        """``ValueError`` unless ``arrays`` and ``deferred`` (read from a
        file) are what this drafter's ``state`` and ``take_deferred`` could
        have given: a state is checked before it is restored."""

    def take_deferred(self) -> List[DeferredPass]:
        """The deferred work handed over (no longer held here)."""

    def put_deferred(self, rows: List[DeferredPass]) -> None:
        """Hold ``rows`` (from :meth:`take_deferred`) as deferred work again."""


@runtime_checkable
class SelfJudging(Protocol):
    """A drafter with named sources that judges first drafts in hindsight."""

    def draft_source(self, k: int, look: bool = True) -> Optional[str]:
        """The source that drafts ``k`` tokens next (``"mtp"``, ``"ngram"``;
        None: nothing to draft). ``look``: it may run deferred work to
        answer exactly."""

    def hindsight(self) -> Hindsight:
        """Per source, (hits, trials) of first drafts judged without being
        verified since the last call, counted where passes drafting one
        token would have started (``OneDraftWalk``). The first call turns
        judging on."""

    def set_source_paying(self, source: str, paying: bool) -> None:
        """``auto`` says whether drafting from ``source`` pays now, so that
        the drafter need not run that source just to choose between them."""


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
