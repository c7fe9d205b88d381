"""Rows of a batch sample as plain sampling does away from temperature 1,
with top-p and with min-p, every drafter beside rows with other samplers
(the settings, and why, as in test_sampling_filters.py)."""

import pytest

from mlx_spec.core.sampling import Sampler
from mlx_spec.testing.distributions import (
    FILTERED_CONTROL_RUNS,
    FILTERED_RUNS,
    FILTERED_SAMPLERS,
    batch_first_tokens,
    discriminating_prompt,
    exact_first_tokens,
    rejects,
    sample_pvalues,
    verifying_with,
)

N_RUNS = FILTERED_RUNS
N_CONTROL_RUNS = FILTERED_CONTROL_RUNS
SAMPLERS = FILTERED_SAMPLERS
HEAD_DRAFTERS = ("mtp", "mtp+ngram")


def sampled_rows(model, drafters, first_drafter, n_runs=N_RUNS):
    """One batch of a row per (sampler, drafter), ``n_runs`` times: per row,
    its name, a callable giving its p-values, and its (drafted, accepted)."""
    rows, names, exact = [], [], []
    for name, settings in SAMPLERS.items():
        sampler = Sampler(**settings)
        prompt = discriminating_prompt(model, sampler, first_drafter)
        exact.append(exact_first_tokens(model, prompt, sampler))
        for drafter_name in drafters:
            rows.append((prompt, sampler, drafter_name))
            names.append((name, drafter_name))
    runs, counts = batch_first_tokens(model, rows, n_runs)
    per_sampler = len(drafters)
    return [
        (
            names[i],
            lambda i=i: sample_pvalues(*exact[i // per_sampler], runs[i]),
            counts[i],
        )
        for i in range(len(rows))
    ]


def assert_rows_follow_plain_sampling(results):
    for name, pvalues, (drafted, accepted) in results:
        p_pairs, p_third = pvalues()
        assert min(p_pairs, p_third) > 1e-3, (name, p_pairs, p_third)
        assert 0 < accepted < drafted, (name, accepted, drafted)


@pytest.mark.slow
def test_head_rows_follow_plain_sampling(predictive_model):
    """mtp and mtp+ngram rows, each sampler: four rows in one batch."""
    results = sampled_rows(predictive_model, HEAD_DRAFTERS, "mtp")
    assert_rows_follow_plain_sampling(results)


@pytest.mark.slow
def test_ngram_rows_follow_plain_sampling(models):
    """n-gram rows on a random model (its copies are uncertain there)."""
    results = sampled_rows(models["qwen3_next"][0], ("ngram",), "ngram")
    assert_rows_follow_plain_sampling(results)


@pytest.mark.parametrize(
    "wrong", [dict(temp=1.0, top_p=0.1, top_k=8), dict(temp=0.5, top_k=8)]
)
@pytest.mark.slow
def test_batch_verifier_ignoring_a_setting_is_caught(
    predictive_model, wrong, monkeypatch
):
    """Negative control: the top-p rows verified without the temperature, or
    without the top-p, are rejected (the min-p rows are verified against a
    wrong sampler too)."""
    verifying_with(monkeypatch, Sampler(**wrong))
    results = sampled_rows(predictive_model, HEAD_DRAFTERS, "mtp", N_CONTROL_RUNS)
    assert all(rejects(pvalues) for _, pvalues, _ in results)
