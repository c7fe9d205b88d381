"""Rejection sampling preserves the target distribution."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec
from mlx_spec.core.sampling import (
    Sampler,
    Verification,
    make_draft_sampler,
    make_sampler,
    rejection_sample,
    verification_of,
)
from mlx_spec.drafters import make_drafter
from mlx_spec.session import DecodeOptions, Session
from mlx_spec.testing.distributions import (
    chi2_pvalue,
    discriminating_prompt,
)
from mlx_spec.testing.reference import prompts

V = 6


def _probs(*rows):
    return mx.array(np.array(rows, dtype=np.float32))


def _run(draft, p, q, n_samples=4000, seed=0):
    mx.random.seed(seed)
    logits = mx.log(p)
    out = [rejection_sample(mx.array(draft), logits, q) for _ in range(n_samples)]
    return np.array(mx.stack(out).tolist())  # [N, 2]: (accepted, token)


def test_identical_distributions_accept_everything():
    p = _probs([0.1, 0.2, 0.3, 0.4, 0, 0], [0.5, 0.5, 0, 0, 0, 0], [0.2] * 5 + [0])
    res = _run([3, 0], p, p[:2], n_samples=300)
    assert (res[:, 0] == 2).all()


def test_q_zero_always_rejects_and_samples_residual():
    p = _probs([0.25, 0.25, 0.25, 0.25, 0, 0], [1 / 6] * 6)
    q = _probs([0.0, 0.5, 0.5, 0, 0, 0])  # the draft 0 has q(x) = 0
    res = _run([0], p, q)
    assert (res[:, 0] == 0).all()
    residual = np.maximum(np.array(p[0]) - np.array(q[0]), 0)
    counts = np.bincount(res[:, 1], minlength=V)
    assert chi2_pvalue(counts, residual / residual.sum()) > 1e-3


def test_draft_outside_top_k_support_always_rejected():
    s = Sampler(temp=1.0, top_k=2)
    logprobs = mx.log(_probs([0.5, 0.3, 0.1, 0.05, 0.03, 0.02], [1 / 6] * 6))
    mx.random.seed(1)
    for _ in range(200):
        n, tok = rejection_sample(mx.array([2]), s.logits(logprobs), None).tolist()
        assert n == 0 and tok in (0, 1)


def test_full_acceptance_draws_bonus_from_last_distribution():
    last = [0.1, 0.6, 0.0, 0.3, 0.0, 0.0]
    p = _probs([0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0], last)
    res = _run([2, 4], p, None)
    assert (res[:, 0] == 2).all()
    assert chi2_pvalue(np.bincount(res[:, 1], minlength=V), last) > 1e-3


def test_one_hot_draft_accepts_with_probability_p_x():
    p = _probs([0.3, 0.5, 0.2, 0, 0, 0], [1 / 6] * 6)
    res = _run([1], p, None)
    assert abs((res[:, 0] == 1).mean() - 0.5) < 0.04
    # The emitted token (draft if accepted, else the residual sample) ~ p.
    first = np.where(res[:, 0] == 1, 1, res[:, 1])
    assert chi2_pvalue(np.bincount(first, minlength=V), np.array(p[0])) > 1e-3


def test_emitted_first_token_follows_p_for_sampled_drafts():
    p = _probs([0.1, 0.4, 0.1, 0.2, 0.2, 0.0], [0.3, 0.3, 0.4, 0, 0, 0])
    q = _probs([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    rng = np.random.default_rng(0)
    mx.random.seed(2)
    firsts = []
    for _ in range(4000):
        x = int(rng.choice(V, p=np.array(q[0])))
        n, tok = rejection_sample(mx.array([x]), mx.log(p), q).tolist()
        firsts.append(x if n else tok)
    assert chi2_pvalue(np.bincount(firsts, minlength=V), np.array(p[0])) > 1e-3


def test_make_sampler_matches_mlx_lm_sampling():
    from mlx_lm.sample_utils import make_sampler as mlx_make

    logprobs = mx.log(_probs([0.05, 0.5, 0.2, 0.15, 0.06, 0.04]))
    for kw in (dict(temp=0.7), dict(temp=1.0, top_k=3), dict(temp=0.9, top_p=0.8)):
        mine, theirs = make_sampler(**kw), mlx_make(**kw)
        mx.random.seed(5)
        a = [mine(logprobs).item() for _ in range(50)]
        mx.random.seed(5)
        b = [theirs(logprobs).item() for _ in range(50)]
        assert a == b, kw
    assert make_sampler(0.0)(logprobs).item() == 1
    xtc = make_sampler(1.0, xtc_probability=0.5)
    assert not isinstance(xtc, Sampler)  # opaque: verified by sample-and-match


# --------------------------------------------------------------------------
# End to end. Whether the first tokens of speculative sampling follow plain
# sampling (chi-square tests, every drafter, away from temperature 1, with
# top-p and min-p, and their negative controls): test_sampling_filters.py and
# test_batch_sampling_filters.py.

TOP_K = 6


@pytest.fixture
def copy_prompt(models):
    return discriminating_prompt(models["qwen3_next"][0], Sampler(1.0, top_k=TOP_K))


def test_sampled_mtp_drafts_are_accepted_with_their_q(predictive_model):
    """Sampled drafts carry q: acceptance is well above what one-hot q gives."""
    sampler = Sampler(temp=1.0, top_k=TOP_K)
    prompt = prompts("mixed")
    mx.random.seed(0)
    stats = mlx_spec.SpecStats()
    options = DecodeOptions(make_drafter("mtp", predictive_model), 3)
    session = Session(predictive_model, options, stats=stats)
    steps = session.generate(prompt, max_tokens=60, sampler=sampler)
    list(steps)
    assert stats.accepted > 0.2 * stats.drafted


def test_seeded_runs_reproduce(models, copy_prompt):
    model, tok = models["qwen3_5"]

    def run(seed):
        mx.random.seed(seed)
        return [
            r.token
            for r in mlx_spec.stream_generate(
                model,
                tok,
                copy_prompt,
                24,
                sampler=make_sampler(1.0),
                num_draft_tokens=3,
            )
        ]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_mtp_ngram_samples_its_mtp_drafts(predictive_model):
    """While sampling, mtp+ngram's MTP drafts are drawn from the head's q (not
    its argmax), and the verifier gets that q: not one-hot at temperature 1."""
    drafter = make_drafter("mtp+ngram", predictive_model)
    sampler = Sampler(temp=1.0, top_k=TOP_K)
    mx.random.seed(0)
    seen = []
    original = drafter.propose  # what the decode loop calls

    def propose(k):
        out = original(k)
        if len(out) and drafter.last_draft_source == "mtp":
            seen.append(out.probs)
        return out

    drafter.propose = propose
    session = Session(predictive_model, DecodeOptions(drafter, 3))
    steps = session.generate(prompts("random", seed=5), max_tokens=30, sampler=sampler)
    list(steps)
    assert seen and all(q is not None for q in seen)
    assert any(mx.max(q).item() < 0.99 for q in seen)  # a distribution, not one-hot


@pytest.mark.parametrize("xtc_probability", [0.0, 0.5])
def test_negative_temperature_is_refused(xtc_probability):
    with pytest.raises(ValueError, match="temp must be >= 0, got -0.5"):
        make_sampler(-0.5, xtc_probability=xtc_probability)


@pytest.mark.parametrize(
    "probability, threshold", [(1.5, 0.1), (0.5, 0.9), (0.5, -0.1)]
)
def test_xtc_settings_mlx_lm_refuses_are_refused_up_front(probability, threshold):
    """mlx-lm's XTC raises only when it samples (mid-generation, or for a
    whole server batch): the sampler is refused when it is made."""
    with pytest.raises(ValueError, match=f"got {probability!r} and {threshold!r}"):
        make_sampler(1.0, xtc_probability=probability, xtc_threshold=threshold)
    make_sampler(1.0, xtc_probability=0.5, xtc_threshold=0.5)  # the bounds are fine


def test_draft_sampler_processors_see_the_history_as_it_grows():
    """The history array is converted once per length, never left stale: the
    processors see the tokens appended since, then the drafts of this pass."""
    seen = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    history = [3, 4]
    sampler = make_sampler(0.7)
    choose = make_draft_sampler(sampler, [record], history, verification_of(sampler))
    logits = mx.zeros((8,))
    first, _ = choose(logits, [])
    choose(logits, [first])
    history += [5]
    choose(logits, [])
    assert seen == [[3, 4], [3, 4, first.item()], [3, 4, 5]]


def test_greedy_draft_sampler_takes_the_argmax_after_the_processors():
    """Greedy: no chooser without processors (the drafter's own argmax);
    with them, the argmax of the processed logits and no q (deterministic)."""
    assert make_draft_sampler(make_sampler(0.0), [], [1], Verification.MATCH) is None

    def ban_two(tokens, logits):
        return logits.at[:, 2].add(-10.0)

    choose = make_draft_sampler(make_sampler(0.0), [ban_two], [1], Verification.MATCH)
    token, q = choose(mx.array([0.0, 1.0, 3.0, 2.0]), [])
    assert token.item() == 3 and q is None
