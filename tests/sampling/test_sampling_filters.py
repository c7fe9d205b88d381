"""Sampled speculative output follows plain sampling away from temperature 1,
with top-p and with min-p, for every drafter, one sequence at a time.

At temperature 1 a verifier that ignores the temperature is exact by luck,
and on these tiny models a top-p of 0.8 never removes anything from the top
k. So the samplers here are ones where each setting changes the
distribution: temperature 0.7 with a top-p that keeps about three tokens,
and temperature 1.5 with a min-p that keeps about five (both under a top-k
of 8, which bounds the supports the test enumerates). The negative controls
verify the drafts against a sampler without one of the settings (decoding
is otherwise unchanged) and require the same test to reject.
"""

import pytest

from mlx_spec import SpecStats
from mlx_spec.core.sampling import Sampler
from mlx_spec.testing.distributions import (
    FILTERED_CONTROL_RUNS,
    FILTERED_RUNS,
    FILTERED_SAMPLERS,
    discriminating_prompt,
    exact_first_tokens,
    rejects,
    sample_pvalues,
    speculative_first_tokens,
    verifying_with,
)

N_RUNS = FILTERED_RUNS
N_CONTROL_RUNS = FILTERED_CONTROL_RUNS
SAMPLERS = FILTERED_SAMPLERS
# Each control drops one setting from the sampler the verifier uses.
CONTROLS = {
    "temperature ignored": ("top_p", dict(temp=1.0, top_p=0.1, top_k=8)),
    "top_p ignored": ("top_p", dict(temp=0.5, top_k=8)),
    "min_p ignored": ("min_p", dict(temp=1.2, top_k=8)),
}


def model_for(drafter_name, models, predictive_model):
    """The n-gram drafter runs on a random model (its copies are uncertain
    there), the head's drafters on the predictive one."""
    return models["qwen3_next"][0] if drafter_name == "ngram" else predictive_model


def pvalues(model, settings, drafter_name, stats=None, n_runs=N_RUNS):
    """Chi-square p-values of the first tokens of ``n_runs`` speculative
    generations (first two, third) against plain sampling's exact ones, from
    a prompt where ``drafter_name``'s first draft is uncertain."""
    sampler = Sampler(**settings)
    first = "ngram" if drafter_name == "ngram" else "mtp"
    prompt = discriminating_prompt(model, sampler, first)
    pairs, third = exact_first_tokens(model, prompt, sampler)
    runs = speculative_first_tokens(
        model, prompt, sampler, drafter_name, n_runs, stats=stats
    )
    return sample_pvalues(pairs, third, runs)


@pytest.mark.parametrize("drafter_name", ["ngram", "mtp", "mtp+ngram"])
@pytest.mark.parametrize("name", list(SAMPLERS))
@pytest.mark.slow
def test_filtered_sampling_matches_plain_distribution(
    models, predictive_model, name, drafter_name
):
    model = model_for(drafter_name, models, predictive_model)
    stats = SpecStats()
    p_pairs, p_third = pvalues(model, SAMPLERS[name], drafter_name, stats)
    assert min(p_pairs, p_third) > 1e-3, (p_pairs, p_third)
    # drafts were both accepted and rejected: the verifier's every branch ran
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)


@pytest.mark.parametrize("drafter_name", ["ngram", "mtp"])
@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.slow
def test_a_verifier_ignoring_a_setting_is_caught(
    models, predictive_model, control, drafter_name, monkeypatch
):
    name, wrong = CONTROLS[control]
    model = model_for(drafter_name, models, predictive_model)
    verifying_with(monkeypatch, Sampler(**wrong))
    settings = SAMPLERS[name]
    assert rejects(lambda: pvalues(model, settings, drafter_name, None, N_CONTROL_RUNS))


@pytest.mark.parametrize("drafter_name", ["ngram", "mtp"])
@pytest.mark.slow
def test_a_verifier_sampling_p_after_a_rejection_is_caught(
    models, predictive_model, drafter_name, monkeypatch
):
    """Negative control: sampling from p instead of the residual after a
    rejection over-weights the rejected draft."""
    import mlx.core as mx

    import mlx_spec.core.verify as verify
    from mlx_spec.core.sampling import rejection_sample

    def biased(draft, p_logits, q_probs=None):
        n, tok = rejection_sample(draft, p_logits, q_probs).tolist()
        if n < draft.size:
            tok = mx.random.categorical(p_logits[n]).item()
        return mx.array([n, tok])

    monkeypatch.setattr(verify, "rejection_sample", biased)
    model = model_for(drafter_name, models, predictive_model)
    settings = SAMPLERS["top_p"]
    assert rejects(lambda: pvalues(model, settings, drafter_name, None, N_RUNS))
