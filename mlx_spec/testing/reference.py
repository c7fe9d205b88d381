"""What lossless tests compare against: mlx-lm's own decoding, prompts that
exercise every acceptance pattern, and every array a cache holds."""

import random
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..core.batch import BatchDecoder, RowOptions
from ..core.sequence import SpeculativeDecoder
from ..drafters import make_drafter
from ..drafters.base import OneDraftWalk
from ..generate import stream_generate
from ..mlx_lm_compat import ArraysCache, plain_stream_generate
from ..server.events import Token

# id(model loaded by mlx_spec) -> the same checkpoint loaded by mlx-lm alone
_plain_twins = {}


def register_twin(model, plain_model):
    """Let :func:`reference_tokens` decode ``model``'s prompts with
    ``plain_model``, the same checkpoint loaded by ``mlx_lm.load``, so that a
    reference never runs anything mlx_spec installs on its own models."""
    _plain_twins[id(model)] = plain_model


def stream_tokens(
    generate_fn: Callable,
    model,
    tokenizer,
    prompt: Sequence[int],
    max_tokens: int,
    stop_after: Optional[int] = None,
    **kwargs,
) -> List[int]:
    """The token ids ``generate_fn`` (mlx-lm's or mlx_spec's
    ``stream_generate``) yields; the caller stops after ``stop_after``."""
    tokens = []
    for r in generate_fn(
        model, tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
    ):
        tokens.append(r.token)
        if stop_after is not None and len(tokens) == stop_after:
            break
    return tokens


def reference_tokens(
    model, tokenizer, prompt, max_tokens, stop_after=None, **kwargs
) -> List[int]:
    """Tokens of plain mlx-lm decoding (through the model's mlx-lm twin when
    it has one)."""
    model = _plain_twins.get(id(model), model)
    return stream_tokens(
        plain_stream_generate,
        model,
        tokenizer,
        prompt,
        max_tokens,
        stop_after,
        **kwargs,
    )


def spec_tokens(
    model, tokenizer, prompt, max_tokens, stop_after=None, **kwargs
) -> List[int]:
    """Tokens of ``mlx_spec.stream_generate``."""
    return stream_tokens(
        stream_generate, model, tokenizer, prompt, max_tokens, stop_after, **kwargs
    )


class OracleDrafter:
    """Drafts a known continuation, corrupting each token with probability
    ``error``: full, partial and zero acceptance on random-weight models.

    Written as a user's own drafter would be (no base class): the decode loop
    adapts it.
    """

    def __init__(self, sequence, error=0.0, vocab=256, seed=0):
        self.sequence, self.error, self.vocab = list(sequence), error, vocab
        self.rng = random.Random(seed)

    def reset(self, prompt, hidden=None):
        self.pos = len(prompt)

    def accept(self, tokens, hidden=None):
        self.pos += len(tokens)

    def draft(self, k):
        out = self.sequence[self.pos : self.pos + k]
        return [
            t if self.rng.random() >= self.error else (t + 1) % self.vocab for t in out
        ]


def drafter_for(kind: str, model, prompt: Sequence[int], ref: Sequence[int]):
    """A drafter by name; "oracle": an :class:`OracleDrafter` of ``prompt``'s
    reference continuation ``ref`` that errs 30% of the time."""
    if kind == "oracle":
        return OracleDrafter(list(prompt) + list(ref), error=0.3, seed=len(prompt))
    return make_drafter(kind, model)


def tokens_of(events) -> List[int]:
    """The token ids of a server job's ``Token`` events."""
    return [e.token for e in events if isinstance(e, Token)]


def prompts(kind: str, n: int = 24, seed: int = 0) -> List[int]:
    """Token ids below 256: ``random``, ``repetitive`` (a 5-token unit
    repeated) or ``mixed`` (random with a repeated 6-token run)."""
    rng = random.Random(seed)
    if kind == "random":
        return [rng.randrange(256) for _ in range(n)]
    if kind == "repetitive":
        unit = [rng.randrange(256) for _ in range(5)]
        return (unit * n)[:n]
    unit = [rng.randrange(256) for _ in range(6)]
    return [rng.randrange(256) for _ in range(8)] + unit + [7, 8] + unit + unit[:3]


def _leaves(tree) -> Iterator[mx.array]:
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _leaves(item)


def cache_arrays(caches) -> List[mx.array]:
    """Every array a prompt cache holds: the conv and recurrent states of
    GDN layers, the key/value rows (quantised or not) up to each offset."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [x[..., : c.offset, :] for x in _leaves([c.keys, c.values])]
    return out


def cache_offsets(caches) -> List[int]:
    """The offsets of the attention caches."""
    return [c.offset for c in caches if not isinstance(c, ArraysCache)]


def cache_nbytes(caches) -> int:
    """Bytes of the attention caches' key/value buffers (they grow by design)."""
    return sum(
        a.nbytes
        for c in caches
        if not isinstance(c, ArraysCache)
        for a in _leaves([c.keys, c.values])
    )


def fed_decoder(model, prompt: Sequence[int], drafter, max_draft: int = 4):
    """A single-sequence decoder fed ``prompt``: ready to join a batch."""
    decoder = SpeculativeDecoder(model, drafter, max_draft=max_draft)
    decoder.feed(prompt)
    return decoder


def run_batch(batch, rows: dict, max_steps: int = 500):
    """Step ``batch`` until every row is done; ``rows``: id -> list that
    collects the row's tokens."""
    for _ in range(max_steps):
        if not batch.active:
            return
        for b, (tokens, _) in batch.step().items():
            rows[b] += tokens
    raise AssertionError("the batch did not finish")


def decode_alone(
    decoder, num_draft_tokens, max_tokens: int, sampler=None, max_passes=None
) -> List[int]:
    """``decoder`` (fed) decoded alone with a fixed draft length for up to
    ``max_tokens`` tokens (or ``max_passes`` passes): the tokens emitted.
    Nothing is queued ahead, so the decoder is left with its last token
    pending, ready for more."""
    engine = BatchDecoder.alone(decoder)
    row = engine.add(decoder, RowOptions(max_tokens, sampler, num_draft_tokens))
    out = []
    for _ in range(max_passes or max_tokens):
        if row not in engine.active:
            break
        out += engine.step(queue_ahead=False)[row][0]
    engine.take(row)
    return out


def walked(hits: Sequence[bool], starts: Optional[Sequence[bool]] = None):
    """(hits, trials) a fresh :class:`OneDraftWalk` counts over ``hits``
    (``starts``: which positions began a pass; None: all)."""
    walk = OneDraftWalk()
    for i, hit in enumerate(hits):
        walk.see(hit, starts is None or starts[i])
    return walk.take()
