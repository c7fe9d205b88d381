"""Adaptive draft length (``num_draft_tokens="auto"``)."""

import math
import random
import statistics

import pytest

import mlx_spec
import mlx_spec.core.policy as policy
from dataclasses import replace

from mlx_spec.core.policy_tuning import DEFAULT_TUNING as TUNING
import mlx_spec.core.verify_profile as verify_profile
from mlx_spec.core.draft_lengths import DraftLengths
from mlx_spec.testing.one_row import OneRow
from mlx_spec.drafters.contract import MAX_AUTO_DRAFT_TOKENS
from mlx_spec.testing.reference import (
    OracleDrafter,
    prompts,
    reference_tokens,
    spec_tokens,
)


def test_a_first_drafts_cost_is_not_charged_to_every_draft():
    """A pass that drafts takes 5 ms more (the drafter catching up on the last
    pass's tokens) plus 1 ms per draft, a plain one 10 ms; each draft is
    accepted with probability 0.7: five drafts pay best (2.9 tokens in 20 ms),
    though a line through k = 0 and k = 1 (6 ms a draft) would stop at one.
    The fit takes a first draft's extra cost as mostly fixed, so longer drafts
    are tried, timed and kept."""
    rng = random.Random(0)
    p = OneRow([10e-3] * 9)
    choices = []
    for _ in range(300):
        k = p.choose(8)
        choices.append(k)
        n = next((i for i in range(k) if rng.random() >= 0.7), k)
        p.update(k, n)
        p.observe_pass(k, 10e-3 + (5e-3 + 1e-3 * k if k else 0.0))
    assert statistics.median(choices[100:]) >= 4, choices


def test_next_is_plain_predicts_the_next_choice():
    """A plain pass is queued only when the next choice will be k = 0: the
    prediction must agree with ``choose`` on every pass, probes included."""
    p = OneRow([1 + 0.5 * t for t in range(9)])
    for _ in range(10):
        p.update(1, 0)
    p.choose(8)
    for _ in range(300):
        predicted = p.next_is_plain()
        k = p.choose(8)
        assert predicted == (k == 0)
        p.update(k, 0)
    # Cheap drafts: a source drafts on its prior until its drafts fail.
    sources = OneRow([1 + 0.05 * t for t in range(9)])
    assert sources.choose(8, 32, "mtp") > 0 and not sources.next_is_plain()
    for _ in range(50):  # drafts never accepted
        sources.update(sources.choose(8, 32, "mtp"), 0)
        if sources.next_is_plain():
            break
    assert sources.next_is_plain()
    sources.choose(8, 32, "ngram")  # the next pass may draft from a copy
    assert not sources.next_is_plain()


def test_always_accepted_drafts_use_the_longest_useful_draft():
    policy = OneRow([1.0] * 9)  # a verify costs the same for any T
    for _ in range(20):
        policy.update(policy.choose(8), policy.last_choice)
    assert policy.choose(8) == 8
    assert policy.choose(3) == 3  # the limit (tokens left) is respected


def test_costly_verify_needs_high_acceptance():
    costs = [float(t) for t in range(1, 10)]  # a T-token verify costs T steps
    policy = OneRow(costs)
    for _ in range(40):
        k = max(policy.choose(8), 1)
        policy.update(k, k - 1)  # most but not all drafts accepted
    # E(k) < 1 + k whenever some draft fails, so nothing beats plain decoding.
    assert policy.choose(8) == 0


def test_what_passes_really_take_enters_the_choice():
    """A profile where a 2-token verify costs twice a 1-token one: at 60%
    acceptance one draft does not pay. Passes that really take 10 ms more
    (host work the profile does not see) make the verify's share small: it pays."""
    costs = [1e-3 * (1 + t) for t in range(9)]
    policy = OneRow(costs)
    for _ in range(40):
        for n in (1, 1, 1, 0, 0):
            policy.update(1, n)
    assert policy.choose(1) == 0  # 1.6 tokens for 2x the cost
    policy.observe_pass(0, 11e-3)  # a warm-up pass: not counted
    assert policy.cost.weight == 0
    for _ in range(40):
        policy.observe_pass(0, 11e-3)
        policy.observe_pass(1, 12e-3)
    assert policy.cost.fitted()["extra"] == pytest.approx(10e-3, rel=1e-4)
    assert policy.pass_cost(1) / policy.pass_cost(0) == pytest.approx(12 / 11, rel=1e-4)
    assert policy.choose(1) == 1  # 1.6 tokens for 1.09x the cost


@pytest.mark.parametrize("bound", [TUNING.stall_bound, math.inf])
def test_a_few_stalled_passes_do_not_price_the_rest(bound):
    """Passes of 20 ms (8 ms beyond the profile), two early ones stalled
    (90, 85 ms): counted at most STALL_BOUND times what the fit expected, the
    extra stays under 18 ms, where a draft at ~0.5 acceptance (a 2-token
    verify: 2.5x) never pays. In full (the control) it drafts for a while."""
    tuning = replace(TUNING, stall_bound=bound)
    p = OneRow([12e-3 + 18e-3 * t for t in range(9)], tuning=tuning)
    for _ in range(20):
        p.update(1, 1)
        p.update(1, 0)
    extras, choices = [], []
    for seconds in [20e-3, 20e-3, 90e-3, 85e-3] + [20e-3] * 4:
        p.observe_pass(0, seconds)  # the first: a warm-up pass, not counted
        extras.append(p.cost.fitted()["extra"])
        choices.append(p.choose(1))
    if bound == math.inf:
        assert max(extras) > 50e-3 and choices[2:6] == [1] * 4
    else:
        assert max(extras) < 18e-3 and choices == [0] * 8
    # A lasting slowdown (every pass twice as slow) is followed all the same.
    for _ in range(60):
        p.observe_pass(0, 40e-3)
    assert p.cost.fitted()["extra"] == pytest.approx(28e-3, rel=0.05)


def test_drafting_time_seen_only_in_whole_passes_is_learned():
    """A lazy draft's device time is invisible to the host timer (draft cost
    0 here) but shows in what passes take: 2 ms more per draft. Then one draft
    at 50% acceptance (1.5 tokens for 3x the time) no longer pays."""
    policy = OneRow([1e-3] * 9)  # verify costs the same for any T
    for _ in range(20):
        policy.update(1, 1)
        policy.update(1, 0)
    assert policy.choose(1) == 1
    for _ in range(20):
        policy.observe_pass(0, 1e-3)
        policy.observe_pass(1, 3e-3)
    fit = policy.cost.fitted()  # pulled a little to 0
    assert fit["extra"] == pytest.approx(0, abs=2e-4)
    assert fit["per_drafting_row"] == pytest.approx(2e-3, rel=0.15)
    assert policy.choose(1) == 0


def test_verify_cost_grows_with_context_between_the_profiles():
    c0, c1 = policy.SHORT_CONTEXT, 3000
    short = [1.0 + 0.1 * t for t in range(9)]
    long = [s + 0.01 * (t + 1) * (c1 - c0) / 1000 for t, s in enumerate(short)]
    p = OneRow(short, long_profile=(c1, long))
    assert p.verify_cost(0, c0) == pytest.approx(short[0])
    assert p.verify_cost(4, c1) == pytest.approx(long[4])
    # linear in context beyond the long profile: +1000 tokens, +0.01 s per token verified
    assert p.verify_cost(4, c1 + 1000) == pytest.approx(long[4] + 0.05)
    for _ in range(10):  # the first draft accepted 9 times in 10, then all
        for n in [8] * 9 + [0]:
            p.update(8, n)
    assert p.choose(8, context=c0) == 8
    # where every verified token costs far more than the pass: not drafting
    assert p.choose(8, context=10**7) == 0


@pytest.fixture
def gpu_like_costs(monkeypatch):
    """Pin the verify-cost profile (a T-token verify costs 1 + 0.05 (T-1) steps,
    the shape of a memory-bound GPU decode) and ignore the passes' own timings,
    so decisions do not depend on how busy this machine is."""
    monkeypatch.setattr(DraftLengths, "observe", lambda *a, **k: None)
    # A fresh cache: the model's cost profile, built by an earlier test and
    # corrected by its timed passes, would otherwise stand for the pinned one.
    monkeypatch.setattr(verify_profile, "_profiles", {})

    def pin(model):
        costs = [1e-3 * (1 + 0.05 * t) for t in range(MAX_AUTO_DRAFT_TOKENS + 1)]
        for context in (policy.SHORT_CONTEXT, verify_profile.long_context(model)):
            monkeypatch.setitem(verify_profile._profiles, (id(model), context), costs)

    return pin


@pytest.mark.parametrize(
    "family, error, n", [("qwen3_next", 1.0, 160), ("qwen3_5", 0.0, 60)]
)
def test_auto_is_lossless_and_follows_acceptance(
    models, gpu_like_costs, family, error, n
):
    """Drafts that are always wrong: k = 0 nearly everywhere; drafts that are
    always right: long drafts. Lossless either way."""
    model, tok = models[family]
    gpu_like_costs(model)
    prompt = prompts("mixed")
    ref = reference_tokens(model, tok, prompt, n)
    stats = mlx_spec.SpecStats()
    drafter = OracleDrafter(prompt + ref, error=error)
    out = spec_tokens(
        model, tok, prompt, n, draft=drafter, num_draft_tokens="auto", stats=stats
    )
    assert out == ref
    if error:
        assert stats.accepted == 0 and stats.verify_passes == n
        # Only the first passes (while the prior still hopes) and the periodic
        # one-draft probes draft anything: k = 0 everywhere else.
        assert stats.drafted <= 15 + n // 16  # vs >= n if it kept drafting
    else:
        assert stats.tokens_per_pass > 4


def test_drafting_passes_are_anchored_by_timed_plain_passes():
    """While drafting pays, a pass without drafts is still timed now and then
    (about one in 28), so the cost of k = 0 is measured, not extrapolated."""
    policy = OneRow([1e-3] * 9)
    for _ in range(20):
        policy.update(2, 2)
    choices = []
    for _ in range(200):
        k = policy.choose(2)
        choices.append(k)
        policy.observe_pass(k, 1e-3 * (1 + k))
        if k:
            policy.update(k, k)
    plain = [i for i, k in enumerate(choices) if k == 0]
    assert 4 <= len(plain) <= 12  # about 200 / 28, plus the warm-up pass
    assert choices.count(2) >= 180
    assert policy.pass_cost(2) - policy.pass_cost(0) == pytest.approx(2e-3, rel=0.2)


def test_passes_are_learned_at_the_context_they_ran_at(models, monkeypatch):
    """The decode loop times each pass against the verify cost at the context
    the choice was made at: timed at a short context, a long-context pass's
    extra verify cost would be counted twice (in the fit and in the profile)."""
    model, tok = models["qwen3_next"]
    chosen, observed = [], []
    choose, observe = DraftLengths.choose, DraftLengths.observe

    def spy_choose(self, request):
        chosen.append(request.context)
        return choose(self, request)

    def spy_observe(self, shape, seconds, drafted):
        observed.append((chosen[-1], shape.context))  # the pass's own choice
        assert shape.rows == 1
        return observe(self, shape, seconds, drafted)

    monkeypatch.setattr(DraftLengths, "choose", spy_choose)
    monkeypatch.setattr(DraftLengths, "observe", spy_observe)
    prompt = prompts("mixed")
    spec_tokens(model, tok, prompt, 12, draft="ngram", num_draft_tokens="auto")
    assert len(observed) >= 2 and all(c == o for c, o in observed), observed
    assert len(chosen) >= 2
    assert chosen[0] == len(prompt) and chosen == sorted(chosen)


def test_passes_are_timed_as_one_forward_or_as_an_edge_of_the_queue(
    models, monkeypatch
):
    """A plain pass queued ahead runs during the pass before it: the pass that
    restarts a run of queued passes waits for two target forwards, the one
    that ends it for none (on this CPU backend, where queuing a forward waits
    for most of it). Every other pass is timed over one forward; those two
    are observed as edges of the queue, one of each per break, so their
    cost is learnt apart (a biased pass cost made the choice flip at every
    pass)."""
    from mlx_spec.core.batch import BatchDecoder
    from mlx_spec.session import DecodeOptions, Session
    from mlx_spec.core.target import Target

    model, tok = models["qwen3_next"]
    prompt = prompts("mixed")
    sequence = prompt + reference_tokens(model, tok, prompt, 60)
    forwards, window, observed = [0], [0], []
    forward, verify = Target.forward_rows, BatchDecoder.verify
    observe = DraftLengths.observe

    def count_forward(self, *args):
        forwards[0] += 1
        return forward(self, *args)

    def mark_verify(self, *args, **kwargs):
        window[0] = forwards[0]
        return verify(self, *args, **kwargs)

    def spy_observe(self, shape, seconds, drafted):
        ran = forwards[0] - window[0]
        observed.append((sum(drafted.values()), ran, shape.queue_edges))
        return observe(self, shape, seconds, drafted)

    monkeypatch.setattr(Target, "forward_rows", count_forward)
    monkeypatch.setattr(BatchDecoder, "verify", mark_verify)
    monkeypatch.setattr(DraftLengths, "observe", spy_observe)
    never = OracleDrafter(sequence, error=1.0)  # never accepted: mostly k = 0
    steps = Session(model, DecodeOptions(never, num_draft_tokens="auto")).generate(
        prompt,
        verify_costs=[1e-3 * (1 + 0.5 * t) for t in range(9)],
        max_tokens=60,
    )
    assert [t for t, _, _ in steps] == sequence[len(prompt) :]
    drafted = {n for n, _, _ in observed}  # plain passes and some that drafted
    assert 0 in drafted and len(drafted) >= 2
    assert len(observed) >= 30
    inner = [ran for _, ran, edges in observed if not edges]
    assert inner and all(ran == 1 for ran in inner), observed
    restarts = [ran for _, ran, edges in observed if edges and ran == 2]
    ends = [ran for _, ran, edges in observed if edges and ran == 0]
    assert restarts and len(restarts) + len(ends) == sum(e for *_, e in observed)
    assert abs(len(restarts) - len(ends)) <= 1, observed  # the last pass ends one
    assert all(n == 0 for n, _, edges in observed if edges), observed
