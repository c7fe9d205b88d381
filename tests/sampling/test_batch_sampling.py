"""How a batch's rows sample and process logits: each row's logits processors
and sampler act on its own rows of a pass, as they do on the row decoded alone."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.core.batch import BatchDecoder, RowOptions
from mlx_spec.core.sampling import Sampler
from mlx_spec.drafters import make_drafter
from mlx_spec.testing.distributions import (
    discriminating_prompt,
    exact_first_tokens,
    sample_pvalues,
)
from mlx_spec.testing.reference import (
    drafter_for,
    fed_decoder,
    prompts,
    reference_tokens,
    run_batch,
)

EOS = 399


@pytest.mark.parametrize("kinds", [("oracle", "ngram"), ("mtp+ngram", "mtp")])
@pytest.mark.slow
def test_rows_with_logits_processors_equal_mlx_lm(models, family, kinds):
    """Each row's processors see its own history and drafts: a penalty row and
    a biased row decode as mlx-lm does with the same processors, beside a row
    without any (the batch never queues a plain pass for them)."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = models[family]
    specs = [
        (
            prompts("repetitive", n=30),
            dict(repetition_penalty=1.5, repetition_context_size=8),
        ),
        (prompts("mixed", seed=5), dict(logit_bias={11: 4.0, 12: -9.0})),
        (prompts("mixed", seed=8), None),
    ]
    batch = BatchDecoder(model, n_slots=3, max_draft=4)
    rows, want = {}, {}
    for (prompt, args), kind in zip(specs, kinds + ("ngram",)):
        procs = make_logits_processors(**args) if args else None
        ref = reference_tokens(model, tok, prompt, 24, logits_processors=procs)
        drafter = drafter_for(kind, model, prompt, ref)
        b = batch.add(
            fed_decoder(model, prompt, drafter),
            RowOptions(
                24,
                num_draft_tokens="auto" if kind == "ngram" else 4,
                stop_tokens={EOS},
                logits_processors=procs,
            ),
        )
        rows[b], want[b] = [], ref
    run_batch(batch, rows)
    assert rows == want
    # the bias changes its row's text (the penalty does too, but not in
    # every family): rows decoded without processors would fail the test
    assert want[1] != reference_tokens(model, tok, specs[1][0], 24)
    # a row alone that never drafts: no pass is queued ahead past its processors
    alone, procs = BatchDecoder(model, n_slots=1, max_draft=4), specs[1][1]
    b = alone.add(
        fed_decoder(model, specs[1][0], None),
        RowOptions(
            24, num_draft_tokens=0, logits_processors=make_logits_processors(**procs)
        ),
    )
    rows = {b: []}
    run_batch(alone, rows)
    assert rows[b] == want[1]


def test_greedy_head_drafts_follow_each_rows_processors(models, family):
    """The batched head drafts a greedy row with processors as their argmax
    (a processor forcing the successor of the last token: every draft right),
    beside a row without any, which drafts the raw argmax; both equal mlx-lm."""

    def successor(tokens, logits):  # [1, V]: the last token + 1, always
        forced = (tokens[-1].astype(mx.int32) + 1) % logits.shape[-1]
        return mx.where(mx.arange(logits.shape[-1]) == forced, 100.0, logits)

    model, tok = models[family]
    batch = BatchDecoder(model, n_slots=2, max_draft=3)
    rows, want, decoders = {}, {}, {}
    for seed, procs in ((3, [successor]), (4, None)):
        prompt = prompts("mixed", seed=seed)
        decoder = fed_decoder(model, prompt, make_drafter("mtp", model), 3)
        b = batch.add(
            decoder, RowOptions(20, num_draft_tokens=3, logits_processors=procs)
        )
        want[b] = reference_tokens(model, tok, prompt, 20, logits_processors=procs)
        rows[b], decoders[b] = [], decoder
    run_batch(batch, rows)
    assert rows == want
    forced = decoders[0].stats
    assert forced.accepted == forced.drafted > 0


TOP_K, N_RUNS = 6, 500


def _batch_samples(model, prompt, sampler, drafter_name, processors=None):
    """The first three tokens of ``prompt``'s row (with its logits
    ``processors``), sampled in a batch beside another sequence, ``N_RUNS``
    times."""
    mx.random.seed(0)
    other, runs = prompts("mixed", seed=9), []
    for _ in range(N_RUNS):
        batch = BatchDecoder(model, n_slots=2, max_draft=3)
        rows = []
        for p, n, procs in ((prompt, 3, processors), (other, 5, None)):
            d = fed_decoder(model, p, make_drafter(drafter_name, model), 3)
            rows.append(
                batch.add(
                    d,
                    RowOptions(n, sampler, 3, stop_tokens=(), logits_processors=procs),
                )
            )
        tokens = []
        while rows[0] in batch.active:
            tokens += batch.step().get(rows[0], ([], None))[0]
        runs.append(tokens)
    return np.array(runs)


@pytest.mark.slow
def test_sampled_rows_with_processors_follow_plain_sampling(predictive_model):
    """Drafts sampled from the head under the row's processors, verified
    against the target under them: plain sampling with those processors."""
    from mlx_lm.sample_utils import make_logits_processors

    sampler = Sampler(temp=1.0, top_k=TOP_K)
    prompt = discriminating_prompt(predictive_model, sampler, "mtp")
    first = exact_first_tokens(predictive_model, prompt, sampler)[1].argmax()
    procs = make_logits_processors(logit_bias={int(first): 1.0}, repetition_penalty=1.3)
    pairs, third = exact_first_tokens(predictive_model, prompt, sampler, procs)
    runs = _batch_samples(predictive_model, prompt, sampler, "mtp", procs)
    p_pairs, p_third = sample_pvalues(pairs, third, runs)
    assert min(p_pairs, p_third) > 1e-3, (p_pairs, p_third)
