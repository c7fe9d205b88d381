"""Sampled decoding with the dflash drafter follows plain sampling: the
block's drafts are sampled per position from the drafter's own processed
distribution, and that q is what rejection sampling divides by.

A random drafter almost never proposes what a random target samples, so
the drafter here (``dflash-near``, registered by this module) runs the
real block forward and then adds the target's own logits for the block's
positions to it: its q is near the target's p but not equal, so drafts are
both accepted and rejected, and the rejection branch's residual matters.
Everything between the logits and the verifier (the per-position choice
after the target's processing, the q handed over) is the drafter's own.
The samplers are those of test_sampling_filters (each setting changes the
distribution on these tiny models). The controls verify against a
sampler without one setting, and hand the verifier the q of the raw logits
(the processing forgotten), and require the same test to reject.
"""

import mlx.core as mx
import pytest

import mlx_spec
from mlx_spec import SpecStats
from mlx_spec.core.sampling import Sampler
from mlx_spec.drafters import make_drafter, register, unregister
from mlx_spec.drafters.dflash import DFlashDrafter, draft_model_of
from mlx_spec.models.dflash.capture import detach_tap
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.dflash_drafters import write_dflash_checkpoint
from mlx_spec.testing.distributions import (
    FILTERED_CONTROL_RUNS,
    FILTERED_RUNS,
    FILTERED_SAMPLERS,
    batch_first_tokens,
    exact_first_tokens,
    rejects,
    sample_pvalues,
    speculative_first_tokens,
    verifying_with,
)
from mlx_spec.testing.reference import fed_decoder, prompts

NEAR = "dflash-near"


class _NearTarget:
    """The drafter model, its logits moved near the target's: the block's
    real draft logits, halved, plus the target's logits at each block
    position given the history and its greedy continuation."""

    def __init__(self, draft_model, target, history):
        self.draft_model, self.target, self.history = draft_model, target, history

    def __getattr__(self, name):
        return getattr(self.draft_model, name)

    def __call__(self, block, features, cache):
        real = self.draft_model(block, features, cache)  # [1, B-1, V]
        tokens = list(self.history)
        for _ in range(real.shape[1] - 1):
            logits = self.target(mx.array([tokens]))[0, -1]
            tokens.append(int(mx.argmax(logits).item()))
        own = self.target(mx.array([tokens]))[:, len(self.history) - 1 :]
        return own + 0.5 * real


class NearDrafter(DFlashDrafter):
    name = NEAR

    def __init__(self, draft_model, target):
        super().__init__(draft_model)
        self.history = []
        self.model = _NearTarget(draft_model, target, self.history)

    def reset(self, prompt, hidden):
        super().reset(prompt, hidden)
        self.history[:] = list(prompt)

    def accept(self, tokens, hidden):
        super().accept(tokens, hidden)
        self.history += list(tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny qwen3_5 target of this module's own with a random drafter."""
    root = tmp_path_factory.mktemp("dflash_sampling")
    model = mlx_spec.load(write_tiny_checkpoint(root / "t", "qwen3_5"))[0]
    mlx_spec.loading.use_draft_model(
        model, str(write_dflash_checkpoint(root / "d", "qwen3_5"))
    )

    def make(target, options):
        make_drafter("dflash", target)  # the tap on the drafter's layers
        return NearDrafter(draft_model_of(target), target)

    register(NEAR, make, 3)
    yield model
    unregister(NEAR)
    detach_tap(model)


def dflash_prompt(model, sampler):
    """A repetitive prompt whose first greedy draft the target finds
    neither certain nor impossible under ``sampler``."""
    for seed in range(300):
        prompt = prompts("repetitive", n=10, seed=seed)
        decoder = fed_decoder(model, prompt, make_drafter(NEAR, model), 3)
        draft = decoder.drafter.draft(1)
        logits = model(mx.array([prompt]))[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = mx.softmax(sampler.logits(logprobs), axis=-1)[0]
        if draft and 0.2 < p[draft[0]].item() < 0.8:
            return prompt
    raise AssertionError("no discriminating prompt found")


def pvalues(model, settings, stats=None, n_runs=FILTERED_RUNS):
    sampler = Sampler(**settings)
    prompt = dflash_prompt(model, sampler)
    pairs, third = exact_first_tokens(model, prompt, sampler)
    runs = speculative_first_tokens(model, prompt, sampler, NEAR, n_runs, stats=stats)
    return sample_pvalues(pairs, third, runs)


@pytest.mark.parametrize("name", list(FILTERED_SAMPLERS))
@pytest.mark.slow
def test_sampled_dflash_matches_plain_distribution(model, name):
    stats = SpecStats()
    p_pairs, p_third = pvalues(model, FILTERED_SAMPLERS[name], stats)
    assert min(p_pairs, p_third) > 1e-3, (p_pairs, p_third)
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)


@pytest.mark.slow
def test_a_verifier_ignoring_the_temperature_is_caught(model, monkeypatch):
    verifying_with(monkeypatch, Sampler(temp=1.0, top_p=0.1, top_k=8))
    settings = FILTERED_SAMPLERS["top_p"]
    assert rejects(lambda: pvalues(model, settings, None, FILTERED_CONTROL_RUNS))


@pytest.mark.slow
def test_a_q_before_the_processing_is_caught(model, monkeypatch):
    """Negative control: the drafts are sampled after the target's
    processing, but the q handed over is the softmax of the raw logits
    (the processing forgotten), so the acceptance ratio is wrong."""
    real = DFlashDrafter.propose

    def raw_q(self, k):
        proposal = real(self, k)
        if proposal.probs is None:
            return proposal
        q = mx.softmax(self.last_draft_logits[: len(proposal)], axis=-1)
        return type(proposal)(proposal.tokens, q, proposal.site)

    monkeypatch.setattr(DFlashDrafter, "propose", raw_q)
    settings = FILTERED_SAMPLERS["top_p"]
    assert rejects(lambda: pvalues(model, settings, None, FILTERED_RUNS))


@pytest.mark.slow
def test_batched_dflash_rows_follow_plain_sampling(model):
    """A dflash row per sampler beside an n-gram row of the same prompt and
    sampler, four rows in one batch, each row's own distribution."""
    rows, exact = [], []
    for settings in FILTERED_SAMPLERS.values():
        sampler = Sampler(**settings)
        prompt = dflash_prompt(model, sampler)
        exact.append(exact_first_tokens(model, prompt, sampler))
        rows += [(prompt, sampler, NEAR), (prompt, sampler, "ngram")]
    runs, counts = batch_first_tokens(model, rows, FILTERED_RUNS)
    for i, (run, (drafted, accepted)) in enumerate(zip(runs, counts)):
        p_pairs, p_third = sample_pvalues(*exact[i // 2], run)
        assert min(p_pairs, p_third) > 1e-3, (rows[i][2], p_pairs, p_third)
        if rows[i][2] == NEAR:
            assert 0 < accepted < drafted, (accepted, drafted)
