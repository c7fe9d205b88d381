"""Exact distributions of plain sampling, and the chi-square test that
sampled speculative output follows them (scipy, a test dependency)."""

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np

from ..drafters import make_drafter
from .reference import prompts


def chi2_pvalue(counts, probs) -> float:
    """p-value of ``counts`` under ``probs``; any count outside the support fails."""
    from scipy import stats as sps

    probs = np.asarray(probs, dtype=np.float64)
    keep = probs > 0
    if counts[~keep].sum():
        raise AssertionError("a token outside the support was emitted")
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return sps.chisquare(counts[keep], expected).pvalue


def exact_first_tokens(
    model, prompt, sampler, processors=()
) -> Tuple[Dict, np.ndarray]:
    """Exact joint distribution of the first two tokens of plain sampling
    (after mlx-lm logits ``processors``), and the marginal of the third, by
    enumerating the top-k supports."""

    def dist(prefixes):
        x = mx.array([prompt + list(p) for p in prefixes])
        logits = model(x)[:, -1, :]
        for i, row in enumerate(x):
            for p in processors:
                logits[i : i + 1] = p(row, logits[i : i + 1])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.array(
            mx.softmax(sampler.logits(logprobs), axis=-1).astype(mx.float32)
        )

    p1 = dist([()])[0]
    firsts = [int(a) for a in np.flatnonzero(p1)]
    p2 = dist([(a,) for a in firsts])
    pairs = {
        (a, int(b)): p1[a] * p2[i, b]
        for i, a in enumerate(firsts)
        for b in np.flatnonzero(p2[i])
    }
    p3_rows = dist(list(pairs))
    third = np.zeros(p1.size)
    for w, row in zip(pairs.values(), p3_rows):
        third += w * row
    return pairs, third


def discriminating_prompt(model, sampler, drafter_name: str = "ngram") -> List[int]:
    """A repetitive prompt whose first (greedy) draft the target finds neither
    certain nor impossible (random models rarely do): there, a verifier that
    mishandles rejections visibly shifts the output distribution."""
    for seed in range(200):
        prompt = prompts("repetitive", n=10, seed=seed)
        drafter = make_drafter(drafter_name, model)
        hidden = model.model(mx.array([prompt[:-1]]))[0]
        drafter.reset(prompt, hidden)
        draft = drafter.draft(1)
        logits = model(mx.array([prompt]))[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p = mx.softmax(sampler.logits(logprobs), axis=-1)[0]
        if draft and 0.25 < p[draft[0]].item() < 0.75:
            return prompt
    raise AssertionError("no discriminating prompt found")


def sample_pvalues(pairs: Dict, third: np.ndarray, runs: np.ndarray):
    """Chi-square p-values of sampled runs [N, >= 3] against the exact
    distributions of :func:`exact_first_tokens`: (first two tokens, third)."""
    index = {pair: i for i, pair in enumerate(pairs)}
    counts = np.zeros(len(pairs))
    for a, b in runs[:, :2]:
        if (a, b) not in index:
            raise AssertionError(
                f"pair {(a, b)} has probability 0 under plain sampling"
            )
        counts[index[(a, b)]] += 1
    p_pairs = chi2_pvalue(counts, list(pairs.values()))
    p_third = chi2_pvalue(np.bincount(runs[:, 2], minlength=third.size), third)
    return p_pairs, p_third


def speculative_first_tokens(
    model,
    prompt,
    sampler,
    drafter_name: str,
    n_runs: int,
    k: int = 3,
    seed: int = 0,
    stats=None,
) -> np.ndarray:
    """The first three tokens [n_runs, 3] of ``n_runs`` sampled speculative
    generations of ``prompt`` (one sequence, ``k`` drafts a pass); ``stats``
    (a ``SpecStats``) sums their speculation counters."""
    from ..session import DecodeOptions, Session

    mx.random.seed(seed)
    runs = []
    for _ in range(n_runs):
        options = DecodeOptions(make_drafter(drafter_name, model), k)
        steps = Session(model, options, stats=stats).generate(
            prompt, max_tokens=3, sampler=sampler
        )
        runs.append([t for t, _, _ in steps])
    return np.array(runs)


def verifying_with(monkeypatch, wrong_sampler):
    """Negative controls: every pass with drafts (one sequence or a batch)
    is verified against ``wrong_sampler``'s distribution instead of the
    row's own; drafting and plain passes are unchanged."""
    from ..core import batch_row, verify

    def verify_draft(draft, logprobs, sampler, draft_probs, verification):
        return verify.verify_draft(
            draft, logprobs, wrong_sampler, draft_probs, verification
        )

    monkeypatch.setattr(batch_row, "verify_draft", verify_draft)  # the one engine


def rejects(pvalues) -> bool:
    """Whether a sample was rejected: a p-value below 1e-4, or a token that
    plain sampling never emits (``pvalues`` is a callable that raises then)."""
    try:
        return min(pvalues()) < 1e-4
    except AssertionError as e:
        if "probability 0" in str(e) or "outside the support" in str(e):
            return True
        raise


def batch_first_tokens(model, rows, n_runs: int, k: int = 3, seed: int = 0):
    """The first three tokens of each of ``rows`` ((prompt, sampler, drafter
    name) each), sampled together in one batch, ``n_runs`` times: a list of
    [n_runs, 3] arrays, and per row its (drafted, accepted) totals."""
    from ..core.batch import BatchDecoder, RowOptions
    from .reference import fed_decoder

    mx.random.seed(seed)
    runs = [[] for _ in rows]
    counts = np.zeros((len(rows), 2), dtype=np.int64)
    for _ in range(n_runs):
        batch = BatchDecoder(model, n_slots=len(rows), max_draft=k)
        ids, decoders = [], []
        for prompt, sampler, drafter_name in rows:
            d = fed_decoder(model, prompt, make_drafter(drafter_name, model), k)
            ids.append(batch.add(d, RowOptions(3, sampler, k, stop_tokens=())))
            decoders.append(d)
        tokens = {b: [] for b in ids}
        for _ in range(10 * k):  # three tokens each: a few passes
            if not batch.active:
                break
            for b, (emitted, _) in batch.step().items():
                tokens[b] += emitted
        else:
            raise AssertionError("the batch did not finish")
        for i, b in enumerate(ids):
            runs[i].append(tokens[b])
            counts[i] += decoders[i].stats.drafted, decoders[i].stats.accepted
    return [np.array(r) for r in runs], [tuple(c) for c in counts]


# Settings whose filters change the first token's distribution on the tiny
# checkpoints (top-p 0.8 removes nothing there), with the runs a chi-square
# test draws and the runs that let a broken verifier's control reject.
FILTERED_SAMPLERS = {
    "top_p": dict(temp=0.5, top_p=0.1, top_k=8),
    "min_p": dict(temp=1.2, min_p=0.5, top_k=8),
}
FILTERED_RUNS = 400
FILTERED_CONTROL_RUNS = 150  # the controls reject at p < 1e-20 with 400 runs
