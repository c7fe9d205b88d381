"""The speculative decode loop: draft, verify once, keep the agreed prefix."""

import time
from typing import Any, Callable, Generator, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, maybe_quantize_kv_cache

from .state import SpeculativeCache
from .target import Target
from .adaptive import MAX_AUTO_DRAFT, DraftLengthPolicy, verify_cost_profile
from .sampling import make_sampler
from .stats import PhaseClock, SpecStats
from .verify import verify_draft

MAX_DRAFT_TOKENS = 16


def _score(
    logits: mx.array, history: List[int], draft: List[int], processors
) -> mx.array:
    """Log-probabilities [T, V] for each verified position.

    Logits processors see, for position i, the history plus ``draft[:i]``:
    the same tokens plain decoding would have shown them.
    """
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            tokens = mx.array(history + draft[:i])
            row = logits[i : i + 1]
            for p in processors:
                row = p(tokens, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def speculative_generate_step(
    prompt: mx.array,
    model,
    drafter,
    *,
    num_draft_tokens: Union[int, str] = 3,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    rollback: str = "store",
    stats: Optional[SpecStats] = None,
    timing: bool = False,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, logprobs [V], from_draft)`` like mlx-lm's ``generate_step``.

    prompt: [N] token ids. Each iteration drafts up to ``num_draft_tokens``
    tokens (``"auto"``: chosen per pass by :class:`DraftLengthPolicy`),
    verifies ``[last, *draft]`` in one target pass, keeps the longest prefix
    the target agrees with plus the target's own next token, and rolls every
    cache back to that prefix. ``timing`` fills ``stats.phases`` (at the cost
    of extra synchronisations).
    """
    policy = None
    if num_draft_tokens == "auto":
        policy = DraftLengthPolicy(verify_cost_profile(model))
        num_draft_tokens = MAX_AUTO_DRAFT
    sampler = sampler or make_sampler(0.0)
    stats = SpecStats() if stats is None else stats
    progress = prompt_progress_callback or (lambda *_: None)
    cache = SpeculativeCache(model, num_draft_tokens, rollback, caches=prompt_cache)
    target = Target(model, cache)

    history = prompt.tolist()
    total = len(history)
    progress(0, total)
    quantize = lambda: maybe_quantize_kv_cache(  # noqa: E731
        cache.caches, quantized_kv_start, kv_group_size, kv_bits
    )
    hidden = target.prefill(
        prompt[:-1],
        prefill_step_size,
        lambda n: progress(n, total),
        quantize,
        keep_hidden=getattr(drafter, "needs_hidden", False),
    )
    if drafter is not None:
        drafter.reset(history, hidden)

    clock = PhaseClock(stats, timing)
    produced = 0
    while max_tokens < 0 or produced < max_tokens:
        clock.lap("host")
        room = num_draft_tokens if max_tokens < 0 else max_tokens - produced - 1
        if kv_bits is not None:
            room = min(room, cache.tokens_before(quantized_kv_start) - 1)
        k = policy.choose(room) if policy else min(num_draft_tokens, room)
        tic = time.perf_counter()
        draft = drafter.draft(k) if drafter is not None and k > 0 else []
        draft_seconds = time.perf_counter() - tic
        clock.lap("draft")

        cache.begin(1 + len(draft))
        logits, hidden = target.forward(mx.array(history[-1:] + draft))
        clock.lap("verify", logits, hidden)
        logprobs = _score(logits, history, draft, logits_processors)
        q = getattr(drafter, "draft_probs", None) if draft else None
        n, token = verify_draft(draft, logprobs, sampler, q)  # the one host sync
        emitted = draft[:n] + [token]
        clock.lap("sampling")
        cache.commit(n + 1)
        quantize()
        clock.lap("commit", [c.state for c in cache.caches])

        stats.record(len(draft), n, len(emitted))
        if policy:
            policy.update(len(draft), n, draft_seconds)
        if drafter is not None:
            drafter.accept(emitted, None if hidden is None else hidden[: n + 1])
        if produced == 0:
            progress(total, total)
        for i, token in enumerate(emitted):
            yield token, logprobs[i], i < n
        history += emitted
        produced += len(emitted)
