"""Shared fixtures: tiny raw checkpoints of every supported family, built by code."""

import os
import random

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import stream_generate as mlx_stream_generate

import mlx_spec
from mlx_spec.tiny_checkpoint import FAMILIES, write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Measured verify-cost profiles go to a folder of this test session (and
    of the commands it starts), never the user's cache."""
    from mlx_spec.adaptive import CACHE_DIR_ENV

    saved = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(tmp_path_factory.mktemp("mlx_spec_cache"))
    yield
    if saved is None:
        os.environ.pop(CACHE_DIR_ENV)
    else:
        os.environ[CACHE_DIR_ENV] = saved


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: write_tiny_checkpoint(root / f, f, seed=0) for f in FAMILIES}


# id(model loaded by mlx_spec) -> the same checkpoint loaded by mlx-lm alone
PLAIN_TWINS = {}


@pytest.fixture(scope="session")
def models(checkpoint_dirs, plain_models):
    """family -> (model, tokenizer), loaded once per session through mlx_spec.load."""
    loaded = {f: mlx_spec.load(p) for f, p in checkpoint_dirs.items()}
    for f, (model, _) in loaded.items():
        PLAIN_TWINS[id(model)] = plain_models[f][0]
    return loaded


@pytest.fixture(scope="session")
def plain_models(checkpoint_dirs):
    """family -> (model, tokenizer) loaded by mlx-lm alone: the references
    run exactly mlx-lm's code, never anything mlx_spec installs."""
    return {f: mlx_lm.load(str(p)) for f, p in checkpoint_dirs.items()}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def reference_tokens(model, tokenizer, prompt, max_tokens, **kwargs):
    """Greedy tokens of plain mlx-lm decoding (of the model's mlx-lm twin when
    it has one, so the reference never runs anything mlx_spec installs)."""
    model = PLAIN_TWINS.get(id(model), model)
    return [
        r.token
        for r in mlx_stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
        )
    ]


def spec_tokens(model, tokenizer, prompt, max_tokens, **kwargs):
    return [
        r.token
        for r in mlx_spec.stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
        )
    ]


class OracleDrafter:
    """Drafts a known continuation, corrupting each token with probability
    ``error``: exercises full, partial and zero acceptance on random models."""

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


def prompts(kind, n=24, seed=0):
    rng = random.Random(seed)
    if kind == "random":
        return [rng.randrange(256) for _ in range(n)]
    if kind == "repetitive":
        unit = [rng.randrange(256) for _ in range(5)]
        return (unit * n)[:n]
    unit = [rng.randrange(256) for _ in range(6)]
    return [rng.randrange(256) for _ in range(8)] + unit + [7, 8] + unit + unit[:3]
