"""Samplers whose distribution is known, so drafts can be rejection-sampled.

``make_sampler`` takes the arguments of ``mlx_lm.sample_utils.make_sampler``
and returns a :class:`Sampler`: called on log-probabilities it samples exactly
as mlx-lm's sampler does (the same filters, in the same order, then
temperature), and ``logits(logprobs)`` exposes the logits of that sampling
distribution for verification. XTC draws a coin per step, so its distribution
is not a fixed function of the logits: with ``xtc_probability > 0`` mlx-lm's
own sampler is returned, and drafts are verified by sample-and-match (still
exact, fewer acceptances).

A ``top_k`` at least the vocabulary size keeps every token: the filter is
skipped, where mlx-lm's ``apply_top_k`` raises (see :func:`top_k_filter`).
"""

import math
import numbers
from enum import Enum
from typing import List, Optional

import mlx.core as mx

from ..mlx_lm_compat import apply_min_p, apply_top_k, apply_top_p
from ..mlx_lm_compat import mlx_lm_make_sampler as mlx_make_sampler


class Sampler:
    """Temperature / top-p / min-p / top-k sampling with an explicit distribution."""

    def __init__(
        self,
        temp: float = 0.0,
        top_p: float = 0.0,
        min_p: float = 0.0,
        min_tokens_to_keep: int = 1,
        top_k: int = 0,
    ):
        _check_temp(temp)
        self.temp = temp
        self.filters = []
        if 0 < top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, top_p))
        if min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, min_p, min_tokens_to_keep))
        if top_k > 0:
            self.filters.append(top_k_filter(top_k))

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def logits(self, logprobs: mx.array) -> mx.array:
        """Logits [..., V] whose softmax is the sampling distribution."""
        for f in self.filters:
            logprobs = f(logprobs)
        return logprobs * (1 / self.temp)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.logits(logprobs))


class Verification(Enum):
    """How a row's drafts are verified, decided once from its sampler."""

    # Each position sampled, drafts kept while they equal the samples: greedy
    # decoding, or a sampler whose distribution is not known (XTC, a user's
    # callable). Exact for deterministic drafts.
    MATCH = "match"
    # Leviathan rejection sampling against the sampler's known distribution
    # (a :class:`Sampler` at temperature > 0) and the draft's q.
    REJECTION = "rejection"


def verification_of(sampler) -> Verification:
    """How drafts are verified under ``sampler`` (None: greedy)."""
    if isinstance(sampler, Sampler) and not sampler.greedy:
        return Verification.REJECTION
    return Verification.MATCH


def top_k_filter(top_k: int):
    """The ``top_k`` filter of log-probabilities [..., V]: mlx-lm's
    ``apply_top_k`` when ``top_k < V``, else nothing (the top ``V`` of ``V``
    tokens are all of them; mlx-lm refuses such a ``top_k`` only once it
    samples, which would fail one request in the middle of a batch)."""

    def keep_top_k(logprobs: mx.array) -> mx.array:
        if top_k >= logprobs.shape[-1]:
            return logprobs
        return apply_top_k(logprobs, top_k)

    return keep_top_k


def _check_temp(temp: float):
    if not (isinstance(temp, numbers.Real) and math.isfinite(temp) and temp >= 0):
        raise ValueError(f"temp must be >= 0, got {temp!r}")


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[List[int]] = None,
):
    """Drop-in for ``mlx_lm.sample_utils.make_sampler`` (see module docstring).

    Raises ``ValueError`` for a negative temperature (whatever the sampler)
    and for XTC settings mlx-lm's sampler would refuse only when it samples."""
    if xtc_probability > 0.0:
        _check_temp(temp)
        if not (xtc_probability <= 1.0 and 0.0 <= xtc_threshold <= 0.5):
            raise ValueError(
                "xtc_probability must be in 0..1 and xtc_threshold in 0..0.5, got "
                f"{xtc_probability!r} and {xtc_threshold!r}"
            )
        options = dict(
            xtc_probability=xtc_probability,
            xtc_threshold=xtc_threshold,
            xtc_special_tokens=xtc_special_tokens,
        )
        sampler = mlx_make_sampler(temp, top_p, min_p, min_tokens_to_keep, **options)
        if top_k <= 0:
            return sampler
        with_top_k = mlx_make_sampler(
            temp, top_p, min_p, min_tokens_to_keep, top_k=top_k, **options
        )

        def xtc_sampler(logprobs: mx.array) -> mx.array:
            small = top_k < logprobs.shape[-1]  # else top-k keeps every token
            return (with_top_k if small else sampler)(logprobs)

        return xtc_sampler
    return Sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)


def xtc_special_tokens(tokenizer) -> List[int]:
    """The tokens XTC never removes: the newline and the EOS tokens (what
    mlx-lm's generate command and server pass)."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def rejection_sample(
    draft: mx.array, p_logits: mx.array, q_probs: Optional[mx.array] = None
) -> mx.array:
    """Leviathan et al. (2023) verification of ``k`` drafted tokens.

    draft: [k] token ids; p_logits: [k+1, V] target sampling logits, row i for
    the position of draft[i] (row k: after the last draft); q_probs: [k, V] the
    distributions the drafts were sampled from, or None for deterministic drafts
    (q one-hot at the draft). Draft i is accepted with probability
    min(1, p_i(x)/q_i(x)) (0 when q_i(x) = 0); the first rejection emits a
    sample of norm(max(0, p_i - q_i)); full acceptance emits a sample of p_k.
    Returns [2] (on device): the number accepted n and the emitted token.
    """
    k = draft.size
    p = mx.softmax(p_logits.astype(mx.float32), axis=-1)  # [k+1, V]
    rows = mx.arange(k)
    px = p[rows, draft]
    if q_probs is None:
        qx = mx.ones_like(px)
        residual = mx.put_along_axis(p[:k], draft[:, None], mx.array(0.0), axis=-1)
    else:
        q = q_probs.astype(mx.float32)
        qx = q[rows, draft]
        residual = mx.maximum(p[:k] - q, 0.0)
    ratio = mx.where(qx > 0, px / mx.where(qx > 0, qx, 1.0), 0.0)
    accepted = mx.random.uniform(shape=(k,)) < mx.minimum(ratio, 1.0)
    n = mx.cumprod(accepted.astype(mx.int32)).sum()

    # A residual with no mass (p == q up to rounding) falls back to p itself.
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual, p[:k])
    candidates = mx.concatenate([residual, p[k:]], axis=0)  # [k+1, V]
    # One sample per possible stopping row; keep row n. log(0) = -inf masks.
    tokens = mx.random.categorical(mx.log(candidates))
    return mx.stack([n, tokens[n].astype(n.dtype)])


def scored_logprobs(
    logits: mx.array, history: List[int], draft: List[int], processors
) -> mx.array:
    """Log-probabilities [T, V] of a verify pass's logits [T, V].

    Logits processors see, for position i, the history plus ``draft[:i]``:
    the same tokens plain decoding would have shown them.
    """
    if processors:
        rows, seen = [], mx.array(history, mx.int32)  # once: contexts run long
        for i in range(logits.shape[0]):
            tokens = mx.concatenate([seen, mx.array(draft[:i], seen.dtype)])
            row = logits[i : i + 1]
            for p in processors:
                row = p(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def make_draft_sampler(
    sampler, processors, history: List[int], verification: Verification
):
    """How a drafter turns its logits into a draft token, for a row verified
    as ``verification`` says under ``sampler``.

    Returns None for matched drafts without logits processors: drafts are
    then the argmax of the drafter's logits. Otherwise returns
    ``choose(logits [V], drafted) -> (token, q)``, which runs the logits
    through the target's processing (logits processors with ``history`` plus
    the tokens drafted so far): greedy, the token is the argmax of the result
    and q is None (a deterministic draft, verified against a one-hot q);
    sampling, q [V] is the distribution after the sampler's filters and
    temperature, and the token a sample of it. Everything stays lazy, so
    drafting needs no host synchronisation. ``history`` only grows (it is
    extended in place): it is converted to an array once per length, not at
    every draft step (contexts run long).
    """
    greedy = verification is Verification.MATCH
    if greedy and not processors:
        return None
    converted = [-1, None]  # the history's length and array when last converted

    def choose(logits: mx.array, drafted: List[mx.array]):
        row = logits[None]
        if processors:
            if converted[0] != len(history):
                converted[:] = len(history), mx.array(history, mx.uint32)
            tokens = mx.concatenate(
                [converted[1]] + [d.reshape(1).astype(mx.uint32) for d in drafted]
            )
            for p in processors:
                row = p(tokens, row)
        if greedy:  # what the target will choose if it agrees with the head
            return mx.argmax(row[0]), None
        logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
        q_logits = sampler.logits(logprobs)[0]
        return mx.random.categorical(q_logits), mx.softmax(q_logits, axis=-1)

    choose.samples = not greedy  # a greedy choice can be judged in hindsight
    return choose
