"""DFlash block drafting: a small drafter proposes a whole block in one forward.

The drafter model (``models.dflash``) reads, for every committed position,
the target's outputs at a few chosen layers. Attaching it to a target
attaches a tap to those layers (``models.dflash.capture``); the target hands
each forward's recording over beside the post-norm state, and the sequence
gives this drafter the recording as its ``hidden`` (``core.target.rows_for``:
it ``reads_features``), so that the features follow the contract's rows:

- ``reset(prompt, hidden)``: rows for ``prompt[:-1]``; all become context.
- ``accept(tokens, hidden)``: rows for the pass's inputs that produced
  ``tokens`` (the pending token and the accepted drafts): exactly the
  positions now committed before the new pending token ``tokens[-1]``.
  The context grows by accepted positions only, so a rejected draft leaves
  nothing here to roll back. The rows are held, not taken in: the context
  is extended over all rows held in one forward when it is next read (a
  draft, a saved state) or when :data:`HOLD_POSITIONS` are held, so a
  stretch of plain passes costs one extend per that many positions, not
  one a pass.
- ``propose(k)``: the block ``[pending, mask x (B-1)]`` over the context,
  one forward (lazy, on the device); its first ``k`` positions are the draft.

Sampled decoding: the drafts of one block are conditionally independent
given the context, so position ``i`` is chosen from its own logits by the
engine's chooser (the target's processing of the logits, then a sample and
its q, or the processed argmax), which is the distribution rejection
sampling needs as q.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from ..errors import InputError
from ..models.dflash.capture import attach_tap, tap_of
from ..models.dflash.model import DFlashDraftModel
from .contract import NO_PROPOSAL, DraftForwardCost, DraftSite, Proposal
from .dflash_cost import block_forward_cost, feature_width

__all__ = [
    "DFlashDrafter",
    "attach_draft_model",
    "attached_draft_model",
    "draft_model_of",
]

_ATTRIBUTE = "dflash_draft_model"  # where a target keeps its drafter model

# Accepted positions whose feature rows are held before they enter the
# context in one extend: bounds the rows held (len(target_layer_ids) * H
# floats a position) while a stretch of plain passes is batched.
HOLD_POSITIONS = 64


def attach_draft_model(model, draft_model: DFlashDraftModel) -> DFlashDraftModel:
    """Make ``draft_model`` (bound to ``model``) the one ``draft="dflash"``
    uses with ``model``: a plain attribute, outside the module tree, as the
    MTP head is (the drafter's weights never become the target's)."""
    if not isinstance(draft_model, DFlashDraftModel):
        raise InputError(
            "draft_model must be a DFlash drafter (mlx_spec.load_drafter), "
            f"got {type(draft_model).__name__}"
        )
    if draft_model.target is not model:
        raise InputError("draft_model was loaded for another target model")
    object.__setattr__(model, _ATTRIBUTE, draft_model)
    _tap(model, draft_model)
    return draft_model


def _tap(model, draft_model: DFlashDraftModel):
    """The tap on the layers ``draft_model`` reads, on demand (the decoder's
    forwards alone are recorded). Attached with the drafter model, before
    any session of the model, so that every hidden row the target hands
    over, to any drafter, has the same width."""
    layer_ids = tuple(draft_model.config.target_layer_ids)
    tap = tap_of(model)
    if tap is None or tap.layer_ids != layer_ids or not tap.on_demand:
        attach_tap(model, layer_ids, on_demand=True)


def attached_draft_model(model) -> Optional[DFlashDraftModel]:
    """The drafter model attached to ``model``, or None."""
    return getattr(model, "__dict__", {}).get(_ATTRIBUTE)


def draft_model_of(model) -> DFlashDraftModel:
    """The drafter model attached to ``model``; a one-line error without one."""
    draft_model = attached_draft_model(model)
    if draft_model is None:
        raise InputError(
            "draft 'dflash' needs a drafter model: draft_model= (a path, a "
            "repo id or mlx_spec.load_drafter's result), or --draft-model "
            "PATH_OR_REPO"
        )
    return draft_model


def make_dflash_drafter(model, options=None) -> "DFlashDrafter":
    """The registered factory: the drafter model attached to ``model`` (its
    tap on the target layers it reads is one per model, shared by every
    dflash row; the target takes what it records after every forward)."""
    draft_model = draft_model_of(model)
    _tap(model, draft_model)  # detached since, or replaced: as attached
    return DFlashDrafter(draft_model)


class DFlashDrafter:
    """Drafting with a :class:`~mlx_spec.models.dflash.model.DFlashDraftModel`.

    Contracts (:mod:`.contract`): the core :class:`~.contract.Drafter`,
    :class:`~.contract.SamplesDrafts`, :class:`~.contract.KnowsEmpty`,
    :class:`~.contract.KeepsArrays` (its context caches),
    :class:`~.contract.ReadsFeatures`,
    :class:`~.contract.TakesPromptInPieces` (context taken in any chunks is
    the context taken in one), :class:`~.contract.DraftsLong` (``auto``
    may draft the whole block but its first token) and
    :class:`~.contract.ForwardsToDraft` (one block forward a drafting pass).
    ``last_draft_logits`` [m, V]: the logits each drafted token came from.

    ``hold``: how many accepted positions' feature rows are held before
    they are taken into the context (1: every pass's at once).
    ``held_positions``: how many are held now (fewer than ``hold``
    between calls).
    """

    name = "dflash"
    needs_hidden = True
    reads_features = True  # the tap's features, not the post-norm state
    takes_prompt_in_pieces = True  # a chunked prompt's features are not held

    def __init__(self, draft_model: DFlashDraftModel, hold: int = HOLD_POSITIONS):
        if not isinstance(hold, int) or hold < 1:
            raise ValueError(f"hold must be an integer >= 1, got {hold!r}")
        self.model = draft_model
        self.hold = hold
        self.block_size = draft_model.config.block_size
        self.max_draft = self.block_size - 1
        self.cache = draft_model.make_cache()
        self.choose = None  # logits, drafted -> (token, q); None: the argmax
        self.last_draft_logits: Optional[mx.array] = None
        self._pending: Optional[int] = None  # the block's first token
        self._held: List[mx.array] = []  # feature rows [n, F] not taken in yet
        self.held_positions = 0

    @property
    def max_auto_draft(self) -> int:
        """``auto`` may choose any draft the block holds: its positions cost
        one forward together, whatever ``k``."""
        return self.max_draft

    def draft_forward_cost(self) -> DraftForwardCost:
        """What its block forward costs (measured once per drafter model)."""
        return block_forward_cost(self.model)

    @property
    def context_length(self) -> int:
        """Context positions taken in or held (every committed position)."""
        taken = self.cache[0].offset if self.cache else 0
        return taken + self.held_positions

    def set_sampling(self, choose):
        """Choose drafts with ``choose`` (``sampling.make_draft_sampler``);
        None: the argmax of the drafter's logits."""
        self.choose = choose

    def can_draft(self) -> bool:
        """False before any context: a block over nothing is not a draft
        the drafter was trained to make."""
        return self._pending is not None and self.context_length > 0

    def reset(self, prompt: Sequence[int], hidden: Optional[mx.array]):
        """prompt [N]; hidden [N-1, F]: the target's features of
        ``prompt[:-1]`` (None when N == 1)."""
        self.cache = self.model.make_cache()
        self._held, self.held_positions = [], 0
        self.last_draft_logits = None
        self._pending = int(prompt[-1])
        self._hold(hidden, len(prompt) - 1, "reset")
        self.take_in_held()  # a prompt's rows are many: taken in at once

    def accept(self, tokens: Sequence[int], hidden: Optional[mx.array]):
        """tokens: the accepted drafts and the target's own token; hidden
        [len(tokens), F]: the features of the inputs that produced them,
        held until the context is read or ``hold`` positions are held."""
        self._hold(hidden, len(tokens), "accept")
        self._pending = int(tokens[-1])
        if self.held_positions >= self.hold:
            self.take_in_held()
            # evaluated now, so the rows held and the extend's graph go
            mx.async_eval([a for c in self.cache for a in c.fetch() if a is not None])

    def take_in_held(self):
        """Every held row into the context, in one extend (lazy): what reads
        the context (a draft, a saved state) calls it first."""
        if not self._held:
            return
        rows = self._held[0] if len(self._held) == 1 else mx.concatenate(self._held)
        self._held, self.held_positions = [], 0
        self.model.extend(rows[None], self.cache)

    def _hold(self, hidden: Optional[mx.array], n: int, where: str):
        """Hold the feature rows ``hidden`` [n, F] (checked now, so a bad
        row is refused by the call that brought it)."""
        if n == 0:
            return
        if hidden is None:
            raise ValueError(
                "DFlash drafting needs the target's layer features; this "
                "target's forward does not record them"
            )
        if hidden.shape[0] != n:
            raise ValueError(f"{where}: {hidden.shape[0]} feature rows for {n}")
        width = feature_width(self.model)
        if hidden.shape[-1] != width:
            raise ValueError(
                f"{where}: feature rows of width {hidden.shape[-1]}, the "
                f"drafter reads {width} (is its tap attached to the target?)"
            )
        self._held.append(hidden)
        self.held_positions += n

    # -- a kept state: each layer's kept context keys and values ---------------
    def saved_arrays(self) -> List[mx.array]:
        """Per layer its kept keys and values, then ``[start of each layer,
        offset]`` (int32): all a restore needs beside the history (the held
        rows taken in first)."""
        self.take_in_held()
        arrays = []
        for c in self.cache:
            keys, values = c.fetch()
            if keys is None:  # nothing kept: an empty slice of the right rank
                keys = values = mx.zeros((1, 0, 0, 0), mx.float32)
            arrays += [keys, values]
        starts = [c.start for c in self.cache]
        return arrays + [mx.array(starts + [self.context_length], mx.int32)]

    def check_state(self, arrays, deferred):
        """``ValueError`` unless ``arrays`` are what :meth:`saved_arrays`
        of a drafter of this model gives (and nothing is deferred)."""
        layers = len(self.model.layers)
        if deferred:
            raise ValueError("a dflash drafter defers no work, the state has")
        if len(arrays) != 2 * layers + 1:
            raise ValueError(
                f"state holds {len(arrays)} drafter arrays, a dflash drafter "
                f"of {layers} layers keeps {2 * layers + 1}"
            )
        meta = arrays[-1]
        if meta.ndim != 1 or meta.size != layers + 1:
            raise ValueError(f"state's context positions have shape {meta.shape}")
        *starts, offset = meta.tolist()
        for i, (start, layer) in enumerate(zip(starts, self.model.layers)):
            keys, values = arrays[2 * i], arrays[2 * i + 1]
            attn = layer.self_attn
            kept = offset - start
            want = (1, attn.n_kv_heads, kept, attn.head_dim)
            if not 0 <= start <= offset or (
                kept and (keys.shape != want or values.shape != want)
            ):
                raise ValueError(
                    f"state's context of draft layer {i} has shape {keys.shape}, "
                    f"positions {start}..{offset}"
                )

    def restore(self, history: Sequence[int], arrays: Sequence[mx.array]):
        """Rebuild from :meth:`saved_arrays` (checked) and the history: the
        context holds every position before the last token's."""
        *starts, offset = arrays[-1].tolist()
        if offset != len(history) - 1:
            raise ValueError(
                f"state's drafter context holds {offset} positions, its history "
                f"{len(history)} tokens"
            )
        self.cache = self.model.make_cache()
        self._held, self.held_positions = [], 0
        for i, (c, start) in enumerate(zip(self.cache, starts)):
            c.offset = c.start = start
            if offset > start:  # copied in: the state's arrays stay as they are
                c.append(arrays[2 * i], arrays[2 * i + 1])
            c.offset = offset
        self._pending = int(history[-1])
        self.last_draft_logits = None

    def draft(self, k: int) -> List[int]:
        """Up to ``k`` tokens after the pending token, on the host."""
        proposal = self.propose(k)
        mx.eval(proposal.tokens, proposal.probs)
        return proposal.tokens.tolist()

    def propose(self, k: int) -> Proposal:
        """Up to ``min(k, block_size - 1)`` tokens from one block forward,
        lazy (the verify pass evaluates them with its own outputs)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"a draft has at least one token, got k={k!r}")
        if not self.can_draft():
            self.last_draft_logits = None
            return NO_PROPOSAL
        m = min(k, self.max_draft)
        self.take_in_held()
        # The whole block always: its positions attend to each other, so a
        # shorter block would draft differently from the one trained.
        block = self.model.block(mx.array([self._pending], mx.uint32))
        logits = self.model(block, None, self.cache)[0, :m]  # [m, V]
        self.last_draft_logits = logits
        if self.choose is None:
            return Proposal(
                mx.argmax(logits, axis=-1).astype(mx.uint32), None, DraftSite.DEVICE
            )
        tokens, probs = [], []
        for i in range(m):
            token, q = self.choose(logits[i], tokens)
            tokens.append(token)
            if q is not None:  # a sample: rejection sampling needs q
                probs.append(q)
        q = mx.stack(probs) if probs else None
        return Proposal(mx.stack(tokens).astype(mx.uint32), q, DraftSite.DEVICE)
