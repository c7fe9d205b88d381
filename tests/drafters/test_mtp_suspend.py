"""The MTP head suspended while its drafts do not pay: no forward, no rows
beyond a bounded tail, no judging; resumed for a probe or a draft, with its
window restarted over the rows it kept. Greedy output stays mlx-lm's, alone
and as an engine's rows; sampled output keeps plain sampling's distribution."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_spec
from mlx_spec import DecodeOptions, Session
from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.policy_tuning import DEFAULT_TUNING
from mlx_spec.core.sampling import Sampler
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.drafters.mtp_rows import RESUME_ROWS
from mlx_spec.testing.checkpoints import FAMILIES
from mlx_spec.testing.distributions import (
    FILTERED_SAMPLERS,
    discriminating_prompt,
    exact_first_tokens,
    rejects,
    sample_pvalues,
    verifying_with,
)
from mlx_spec.testing.mtp_heads import cycle_order, write_cycle_checkpoint
from mlx_spec.testing.reference import fed_decoder, reference_tokens

# Verify costs (seconds, T = 1..9 tokens of one forward): two tokens cost a
# hundred one-token passes and each token more four times as much, so
# drafting never pays (one row or two: a batch reads the profile at rows x
# T) and probes wait their longest; or every length costs the same.
DEAR = [1e-3] + [0.1 * 4**t for t in range(8)]
CHEAP = [1e-3] * 9
# The fit keeps the profile's scale (the passes timed here are the machine's,
# not the profile's seconds), and the head rests after 4 plain choices.
TUNING = replace(DEFAULT_TUNING, scale_prior_weight=1e9, suspend_after=4)


@pytest.fixture(scope="module")
def cycle_models(tmp_path_factory):
    """family -> (model, tokenizer) whose head predicts its greedy text well."""
    root = tmp_path_factory.mktemp("suspend")
    return {f: mlx_spec.load(write_cycle_checkpoint(root / f, f)) for f in FAMILIES}


class CountedHead:
    """The model's MTP head, its forwards (rows run, logits taken) counted."""

    def __init__(self, head):
        self._head, self.forwards = head, 0

    def __getattr__(self, name):
        return getattr(self._head, name)

    def head_hidden(self, *args, **kwargs):
        self.forwards += 1
        return self._head.head_hidden(*args, **kwargs)

    def logits(self, *args, **kwargs):
        self.forwards += 1
        return self._head.logits(*args, **kwargs)


class WatchedMTP(MTPDrafter):
    """An MTP drafter that records, for each suspension, the head forwards
    run until it resumed, and the rows it kept while suspended."""

    def __init__(self, head: CountedHead):
        super().__init__(head)
        self.spans, self.kept, self._since = [], [], None

    def suspend(self, source):
        if not self.rows.suspended:
            self._since = self.head.forwards
        super().suspend(source)

    def resume(self, source):
        if self.rows.suspended:
            self.spans.append(self.head.forwards - self._since)
        super().resume(source)

    def accept(self, emitted, hidden):
        super().accept(emitted, hidden)
        if self.rows.suspended:
            self.kept.append(self.rows.pending_rows)


def _assert_rested(drafter: WatchedMTP):
    """It was suspended and resumed, ran no head forward while suspended,
    kept a bounded tail and dropped the rest."""
    assert drafter.spans, "never suspended and resumed"
    assert drafter.spans == [0] * len(drafter.spans)
    assert max(drafter.kept) <= RESUME_ROWS and drafter.rows.dropped > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_that_does_not_pay_rests_and_resumes_when_it_does(cycle_models, family):
    """Turn 1 prices a draft at a hundred plain passes: the head rests, its probes
    resume it (accepted: it predicts this text), and it rests again. Turn 2
    prices drafts as free: it resumes and its drafts are accepted. Both
    turns are mlx-lm's tokens."""
    model, tok = cycle_models[family]
    order = cycle_order()
    turns = [order[100:110], order[350:354]]
    cache = make_prompt_cache(model)
    want = [
        reference_tokens(model, tok, t, n, prompt_cache=cache)
        for t, n in zip(turns, (200, 40))
    ]
    drafter = WatchedMTP(CountedHead(model.mtp_head))
    session = Session(model, DecodeOptions(drafter, "auto", tuning=TUNING))
    got, accepted = [], []
    for turn, n, costs in zip(turns, (200, 40), (DEAR, CHEAP)):
        before = session.stats.accepted
        steps = session.generate(turn, max_tokens=n, verify_costs=costs)
        got.append([t for t, _, _ in steps])
        accepted.append(session.stats.accepted - before)
    assert got == want
    _assert_rested(drafter)
    assert len(drafter.spans) >= 2  # rested again after a probe
    assert accepted[1] >= 10  # resumed: its drafts pay and are accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_an_engines_head_rows_rest_together_and_resume_for_probes(cycle_models, family):
    """Two rows of a server engine drafting with their heads run together:
    while drafting does not pay both rest (their kept rows never ride along
    with the other's catch-up), a probe resumes them over an empty window,
    and the probes' drafts are accepted. Each row's tokens are mlx-lm's."""
    model, tok = cycle_models[family]
    order = cycle_order()
    prompts = [order[100:110], order[200:230]]
    head = CountedHead(model.mtp_head)  # one head: the engine runs it for both
    batch = BatchDecoder(model, n_slots=2, max_draft=4, tuning=TUNING)
    drafters, ids = [], []
    for prompt in prompts:
        drafters.append(WatchedMTP(head))
        decoder = fed_decoder(model, prompt, drafters[-1])
        ids.append(batch.add(decoder, RowOptions(200, verify_costs=DEAR)))
    got = {id: [] for id in ids}
    while batch.active:
        for id, (tokens, _) in batch.step().items():
            got[id] += tokens
    assert len(batch.heads.members) == 2
    for id, prompt in zip(ids, prompts):
        assert got[id] == reference_tokens(model, tok, prompt, 200)
    accepted = sum(batch.take(id).stats.accepted for id in ids)
    for drafter in drafters:
        _assert_rested(drafter)
    assert accepted > 0  # probes after resuming: the head's state is current


def _sampled_first_tokens(model, prompt, sampler, n_runs, drafters):
    """The first three tokens [n_runs, 3] of sampled generations with
    ``auto``, the head resting after its first plain pass and resumed for a
    probe at the second (``drafters`` collects each run's drafter)."""
    tuning = replace(TUNING, suspend_after=0, probe_every=2)
    mx.random.seed(0)
    runs = []
    for _ in range(n_runs):
        drafters.append(WatchedMTP(CountedHead(model.mtp_head)))
        options = DecodeOptions(drafters[-1], "auto", tuning=tuning)
        steps = Session(model, options).generate(
            prompt, max_tokens=3, sampler=sampler, verify_costs=DEAR
        )
        runs.append([t for t, _, _ in steps])
    return np.array(runs)


@pytest.mark.slow
def test_sampling_through_suspension_keeps_the_distribution(
    predictive_model, monkeypatch
):
    """Sampled, the first three tokens of runs whose head rests after the
    first pass and is resumed for a probe follow plain sampling (chi-square);
    the control, its drafts verified against another sampler, is rejected."""
    sampler = Sampler(**FILTERED_SAMPLERS["min_p"])
    prompt = discriminating_prompt(predictive_model, sampler, "mtp")
    pairs, third = exact_first_tokens(predictive_model, prompt, sampler)
    drafters = []
    runs = _sampled_first_tokens(predictive_model, prompt, sampler, 400, drafters)
    assert min(sample_pvalues(pairs, third, runs)) > 1e-3
    resumed = [d for d in drafters if d.spans]
    assert len(resumed) == len(drafters) and all(d.spans == [0] for d in resumed)
    verifying_with(monkeypatch, Sampler(temp=1.2, top_k=8))  # min_p ignored
    control = _sampled_first_tokens(predictive_model, prompt, sampler, 150, [])
    assert rejects(lambda: sample_pvalues(pairs, third, control))
