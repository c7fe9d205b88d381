"""Sampled output through the plugin keeps mlx-lm's distribution: mlx-lm's
own ``stream_generate`` with mlx-lm's own sampler (temperature 0.4, top-k
8), called as a script calls it, its first three tokens chi-square tested
against the exact distribution of plain sampling (enumerated from the
model's logits under the same settings: what mlx-lm's decoding samples
from, ``test_make_sampler_matches_mlx_lm_sampling`` holds the samplers
equal).

The prompt is one where the n-gram drafter's first draft is uncertain, so
drafts are both accepted and rejected and the verifier's every branch
runs. The negative control has the verifier sample at temperature 1
instead of 0.4 (decoding otherwise unchanged; on this tiny model temperatures
nearer 1 barely move the distribution): the same test must reject it.
"""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from mlx_spec import plugin
from mlx_spec.core.sampling import Sampler
from mlx_spec.testing.distributions import (
    discriminating_prompt,
    exact_first_tokens,
    rejects,
    sample_pvalues,
    verifying_with,
)

SETTINGS = dict(temp=0.4, top_k=8)
N_RUNS = 400
N_CONTROL_RUNS = 150


@pytest.fixture(scope="module")
def target(checkpoint_dirs):
    """A qwen3_next loaded by mlx-lm, its tokenizer never ending a run
    early (no EOS), and a prompt where the first draft is uncertain."""
    model, tok = mlx_lm.load(str(checkpoint_dirs["qwen3_next"]))
    tok.eos_token_ids = set()
    prompt = discriminating_prompt(model, Sampler(**SETTINGS), "ngram")
    return model, tok, prompt


def plugin_first_tokens(model, tok, prompt, n_runs, seed=0):
    """The first three tokens [n_runs, 3] of ``n_runs`` calls of mlx-lm's
    ``stream_generate`` with mlx-lm's sampler, under the plugin."""
    mx.random.seed(seed)
    sampler = make_sampler(**SETTINGS)
    return np.array(
        [
            [
                r.token
                for r in mlx_lm.stream_generate(
                    model, tok, prompt, max_tokens=3, sampler=sampler
                )
            ]
            for _ in range(n_runs)
        ]
    )


@pytest.mark.slow
def test_sampled_tokens_keep_mlx_lms_distribution(target):
    model, tok, prompt = target
    state = plugin.enable(draft="ngram", num_draft_tokens=3)
    runs = plugin_first_tokens(model, tok, prompt, N_RUNS)
    assert state.decisions == {"covered": N_RUNS}
    # drafts were both accepted and rejected: the verifier's every branch ran
    assert 0 < state.total.accepted < state.total.drafted, state.total
    pairs, third = exact_first_tokens(model, prompt, Sampler(**SETTINGS))
    p_pairs, p_third = sample_pvalues(pairs, third, runs)
    assert min(p_pairs, p_third) > 1e-3, (p_pairs, p_third)


@pytest.mark.slow
def test_a_verifier_ignoring_the_temperature_is_caught(target, monkeypatch):
    model, tok, prompt = target
    verifying_with(monkeypatch, Sampler(temp=1.0, top_k=SETTINGS["top_k"]))
    plugin.enable(draft="ngram", num_draft_tokens=3)
    pairs, third = exact_first_tokens(model, prompt, Sampler(**SETTINGS))
    runs = plugin_first_tokens(model, tok, prompt, N_CONTROL_RUNS)
    assert rejects(lambda: sample_pvalues(pairs, third, runs))
