"""The MTP heads of a batch's rows, run as one batch.

Each row of a :class:`~mlx_spec.core.batch.BatchDecoder` that drafts with the
model's MTP head (``mtp``, or ``mtp+ngram``'s head) keeps its own
:class:`~mlx_spec.drafters.mtp.MTPDrafter`: its token history, sampler, the
head's last row (hm, logits) and its deferred accepted rows. What moves into
the :class:`MTPBatch` while the row is in the batch is the head's KV cache:
one :class:`~mlx_spec.core.ragged_cache.RaggedKVCache` per head layer holds
every member's rows, at their own offsets. Then:

- :meth:`MTPBatch.catch_up`: the members' deferred rows (``L_b`` each) run as
  one ``[B, max L_b]`` forward, right-padded; each row keeps its ``L_b``
  positions, and its last real row gives its next hm and logits.
- :meth:`MTPBatch.draft`: step 1 of every draft comes from the stored logits;
  step ``j > 1`` is one ``[B, 1]`` forward for all members (a row drafting
  fewer steps, or not drafting, rides along and its position is dropped).
  The draft-time rows are dropped right after drafting (nothing reads them),
  and each drafter is offered its tokens (lazy: they are the verify pass's
  input), logits and q, which its ``propose(k)`` then returns.
- :meth:`MTPBatch.draft_rows`: both, for the rows of a pass that draft from
  their head's state. The host waits for neither: the verify pass is built
  on top, and its one synchronisation evaluates the drafts too.

Every row sees only its own positions (per-row rope offsets and masks), so
its tokens are those its own drafter computes alone; bit for bit wherever
the matmuls give a row the same result whatever the batch (MLX's CPU BLAS).
A member leaves (:meth:`MTPBatch.leave`) with its rows in its own cache again.
"""

import math
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..drafters.calls import implements
from ..drafters.contract import DraftSite, HeadBased, Proposal
from ..drafters.mtp import MTPDrafter
from ..drafters.mtp_rows import PENDING_ROWS
from .ragged_cache import RaggedKVCache

# A member's accepted rows deferred at most before the batch runs them anyway
# (it runs them before the member's next head draft in any case). Higher than
# one sequence's PENDING_ROWS: in a batch most rows often draft copies, and a
# request that ends keeps its last rows unrun in its state (the server); the
# hidden states held stay bounded.
DEFERRED_ROWS = 512


def head_drafter(drafter) -> Optional[MTPDrafter]:
    """The :class:`MTPDrafter` of a head-based ``drafter`` (itself, or
    ``mtp+ngram``'s); None for one that drafts without the head."""
    return drafter.head_drafter if implements(drafter, HeadBased) else None


class MTPBatch:
    """The head caches of the member drafters, in member order."""

    def __init__(self, head):
        self.head = head
        self.members: List[MTPDrafter] = []
        self.caches: List[RaggedKVCache] = []
        self._own: Dict[int, list] = {}  # id(member) -> its cache objects

    def __contains__(self, mtp) -> bool:
        return any(m is mtp for m in self.members)

    def join(self, mtp: MTPDrafter):
        """Move ``mtp``'s head cache in; the batch now runs its head."""
        rows = mtp.rows  # the head's cache and rows, which the batch now runs
        if not self.caches:
            self.caches = [RaggedKVCache(c.dtype, c.window) for c in rows.cache]
        for mine, theirs in zip(self.caches, rows.cache):
            mine.append_row(theirs)
        self._own[id(mtp)], rows.cache = rows.cache, None  # misuse fails loudly
        rows.pending_limit = math.inf  # catch_up bounds the deferred rows
        self.members.append(mtp)

    def leave(self, mtp: MTPDrafter):
        """``mtp`` gets its rows back in its own cache and drafts alone again."""
        b = next(i for i, m in enumerate(self.members) if m is mtp)
        own = self._own.pop(id(mtp))
        for mine, theirs in zip(self.caches, own):
            mine.take_row(b, theirs)
        self.members.pop(b)
        mtp.rows.cache, mtp.rows.pending_limit = own, PENDING_ROWS

    def _rows(self, wanted: Dict[int, tuple], L: int):
        """Run each member's rows (``wanted``: index -> (tokens [L_b], hidden
        [L_b, H])) as one [B, L] forward; the others ride along with padding.
        Returns hm [B, L, H]; each member keeps its own L_b positions."""
        H, dtype = self.head.hidden_size, next(iter(wanted.values()))[1].dtype
        none = (mx.zeros((0,), mx.uint32), mx.zeros((0, H), dtype))
        tokens, hidden, lengths = [], [], []
        for b in range(len(self.members)):
            t, h = wanted.get(b, none)
            lengths.append(t.size)
            tokens.append(mx.pad(t.astype(mx.uint32), (0, L - t.size)))
            hidden.append(mx.pad(h, ((0, L - t.size), (0, 0))))
        hm = self.head.head_hidden(mx.stack(tokens), mx.stack(hidden), self.caches)
        for c in self.caches:
            c.trim_rows([L - n for n in lengths])
        return hm

    def catch_up(self, mtps: List[MTPDrafter]) -> int:
        """Run the deferred rows of ``mtps`` (members) in one forward, started
        on the device at once (the host does not wait: the drafts and the
        verify pass are built on top); the positions it computed (0: nothing
        ran). A member with ``DEFERRED_ROWS`` deferred rows joins in anyway,
        which bounds what a member holds; so does any member with no more
        rows than the forward's length (its positions are computed anyway)."""
        needed = [
            b
            for b, m in enumerate(self.members)
            if m.rows.pending_rows
            and (any(m is x for x in mtps) or m.rows.pending_rows >= DEFERRED_ROWS)
        ]
        if not needed:
            return 0
        L = max(self.members[b].rows.pending_rows for b in needed)
        # A suspended member's rows ride along only when it drafts (its
        # upkeep stopped: a resumed one is not suspended).
        wanted = {
            b: m.rows.take_pending()
            for b, m in enumerate(self.members)
            if 0 < m.rows.pending_rows <= L and (b in needed or not m.rows.suspended)
        }
        self._restart([b for b in wanted if self.members[b].rows.gap])
        lengths = {b: t.size for b, (t, _) in wanted.items()}
        hm = self._rows(wanted, max(lengths.values()))  # [B, L, H]
        index = [lengths.get(b, 1) - 1 for b in range(len(self.members))]
        last = hm[mx.arange(hm.shape[0]), mx.array(index)][:, None]  # [B, 1, H]
        logits = self.head.logits(last)  # [B, 1, V]
        for b, n in lengths.items():
            self.members[b].rows.set_last_row(last[b : b + 1], logits[b, 0], n)
        mx.async_eval(logits, last, [(c.keys, c.values) for c in self.caches])
        return hm.shape[0] * hm.shape[1]

    def _restart(self, gaps: List[int]):
        """Empty the rows of the members ``gaps`` (rows were dropped while
        they were suspended): their kept rows start a new window."""
        if not gaps:
            return
        for c in self.caches:
            c.trim_rows(
                [c.offsets[b] if b in gaps else 0 for b in range(len(c.offsets))]
            )
        for b in gaps:
            rows = self.members[b].rows
            rows.verified, rows.gap = 0, False

    def draft_rows(self, drafting: List[Tuple[object, int]]) -> Tuple[int, int]:
        """Catch up and draft at once every row of ``drafting`` (a batch
        row's drafter and its draft length) whose draft comes from the
        state of a member head; their ``propose(k)`` then return these
        drafts, lazily. Returns the head steps run and the positions of the
        catch-up."""
        index = {id(m): i for i, m in enumerate(self.members)}
        rows = {}  # member index -> (its row's drafter, k)
        for drafter, k in drafting:
            mtp = head_drafter(drafter)
            if k > 0 and id(mtp) in index and drafter.needs_head_state(k):
                rows[index[id(mtp)]] = (drafter, k)
        catch_up = self.catch_up([self.members[i] for i in rows])
        wants = {i: k for i, (d, k) in rows.items() if d.drafts_with_head(k)}
        if wants:
            self.draft(wants)
        return max(wants.values(), default=0), catch_up

    def draft(self, wants: Dict[int, int]):
        """Draft ``k`` tokens for each member index -> k in ``wants`` (caught
        up, with a head row) and offer them to the members; the head's steps
        run once per step for all members. Greedy rows take one argmax over
        [B, V] per step; a row with a ``choose`` (sampling, or logits
        processors) chooses from its own row. The drafts stay lazy: the verify
        pass takes them as input, so the host builds it while the device still
        drafts, and waits once, for the verdicts."""
        B, K = len(self.members), max(wants.values())
        states = {b: self.members[b].rows.head_state for b in wants}
        hm, logits = next(iter(states.values()))
        rides = (mx.zeros_like(hm), mx.zeros_like(logits))  # rows not drafting
        states = [states.get(b, rides) for b in range(B)]
        hm = mx.concatenate([s[0] for s in states])  # [B, 1, H]
        logits = mx.stack([s[1] for s in states])  # [B, V]
        choosing = {b: [] for b in wants if self.members[b].choose is not None}
        probs = {b: [] for b in choosing}
        steps, ids = [], None  # per step: logits [B, V], tokens [B]
        for step in range(K):
            if step:
                hm = self.head.head_hidden(ids[:, None], hm, self.caches)
                logits = self.head.logits(hm)[:, 0]
            ids = mx.argmax(logits, axis=-1).astype(mx.uint32)
            if choosing:
                ids = self._choose(logits, ids, step, wants, choosing, probs)
            steps.append((logits, ids))
        for c in self.caches:  # nothing reads the draft-time rows again
            c.trim_rows([K - 1] * B)
        tokens = mx.stack([i for _, i in steps], axis=1)  # [B, K]
        logits = mx.stack([l for l, _ in steps], axis=1)  # [B, K, V]
        q = {b: mx.stack(p) for b, p in probs.items() if p}  # sampled rows
        mx.async_eval(tokens, logits, q)  # started now; the verify pass waits
        for b, k in wants.items():
            proposal = Proposal(tokens[b][:k], q.get(b), DraftSite.DEVICE)
            self.members[b].offer(k, proposal, logits[b, :k])

    def _choose(self, logits, ids, step, wants, choosing, probs) -> mx.array:
        """``ids`` [B] with each choosing row's token (its drafter's
        ``choose``, which sees the row's tokens so far) in place of the argmax."""
        ids = [ids[b] for b in range(ids.size)]
        for b, drafted in choosing.items():
            if step < wants[b]:
                token, q = self.members[b].choose(logits[b], drafted)
                drafted.append(token)
                if q is not None:  # sampled, not a processed argmax
                    probs[b].append(q)
                ids[b] = token.astype(mx.uint32)
        return mx.stack(ids)
