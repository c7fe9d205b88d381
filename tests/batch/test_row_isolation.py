"""One request's sampling never harms another: a batch row whose own sampler
or logits processor raises ends with its error, the rows beside it finish
with exactly their tokens alone, and later requests (sampled ones too) work."""

import threading
import traceback

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k as compiled_top_k

from mlx_spec.core.sampling import make_sampler
from mlx_spec.mlx_lm_compat import apply_top_k, make_logits_processors
from mlx_spec.server import engine as engine_module
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import GenerationParams, Job
from mlx_spec.testing.reference import prompts, reference_tokens, tokens_of
from mlx_spec.testing.server import job_events

POISON_TOP_K = 4242  # a request asking for it gets the failing sampler


class Poisoned(Exception):
    pass


RAISED_IN = []  # the functions on the stack where a poisoned processor raised


def _processor_raising_on_call(n: int):
    calls = [0]

    def processor(tokens, logits):
        calls[0] += 1
        if calls[0] >= n:
            RAISED_IN.append({f.name for f in traceback.extract_stack()})
            raise Poisoned(f"processor call {calls[0]}")
        return logits

    return processor


def _sampler_failing_in_mlx_lm(logprobs):
    """Fails as mlx-lm's compiled top-k does for a ``top_k`` not below the
    vocabulary: while being traced, with the random state as its input."""
    return mx.random.categorical(compiled_top_k(logprobs, logprobs.shape[-1] + 1))


@pytest.fixture
def poisonable(monkeypatch):
    """The engine's sampler and processor factories, with two poisons: a
    request whose ``logits`` hold ``poison_at`` gets a processor raising on
    that call, one with ``top_k`` POISON_TOP_K a sampler failing in mlx-lm."""

    def processors(poison_at=None, **kwargs):
        made = make_logits_processors(**kwargs)
        return made + ([_processor_raising_on_call(poison_at)] if poison_at else [])

    def sampler(*args, top_k=0, **kwargs):
        if top_k == POISON_TOP_K:
            return _sampler_failing_in_mlx_lm
        return make_sampler(*args, top_k=top_k, **kwargs)

    monkeypatch.setattr(engine_module, "make_logits_processors", processors)
    monkeypatch.setattr(engine_module, "make_sampler", sampler)


def _run_concurrently(engine, jobs):
    """Each job submitted and read by its own client thread, the engine
    started once all are queued (so they share passes); job -> its events
    or the exception it ended with."""
    results, threads = {}, []
    submitted = threading.Barrier(len(jobs) + 1)

    def client(job):
        engine.submit(job)
        submitted.wait(timeout=60)
        try:
            results[job] = job_events(job, timeout=120)
        except Exception as e:
            results[job] = e

    for job in jobs:
        threads.append(threading.Thread(target=client, args=(job,)))
        threads[-1].start()
    submitted.wait(timeout=60)
    engine.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize(
    "draft, poison",
    [
        ("ngram", "processor"),
        ("mtp+ngram", "processor"),
        ("mtp+ngram", "processor_while_drafting"),
        ("ngram", "sampler"),
        ("mtp+ngram", "sampler"),
    ],
)
@pytest.mark.slow
def test_a_failing_row_ends_alone_and_later_requests_work(
    models, poisonable, draft, poison
):
    model, tok = models["qwen3_next"]
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full lengths
    engine = Engine(model, tok, draft, num_draft_tokens=3, start=False)
    try:
        greedy = [prompts("mixed", seed=s) for s in (1, 2, 3)]
        penalty = {"repetition_penalty": 1.3}  # a row with processors beside
        jobs = [Job(greedy[0], GenerationParams(max_tokens=14))]
        jobs.append(Job(greedy[1], GenerationParams(max_tokens=14, logits=penalty)))
        jobs.append(Job(greedy[2], GenerationParams(max_tokens=14)))
        RAISED_IN.clear()
        if poison == "processor":  # fails a few tokens in, verifying
            bad = GenerationParams(max_tokens=14, logits={"poison_at": 4})
        elif poison == "processor_while_drafting":  # in the heads' shared draft
            bad = GenerationParams(max_tokens=14, logits={"poison_at": 5})
        else:
            bad = GenerationParams(max_tokens=14, temperature=0.8, top_k=POISON_TOP_K)
        jobs.insert(1, Job(prompts("repetitive", n=30), bad))
        results = _run_concurrently(engine, jobs)
        failed = results.pop(jobs.pop(1))
        assert isinstance(failed, (Poisoned, ValueError)), failed
        if poison == "processor_while_drafting":
            assert "_choose" in RAISED_IN[0]  # MTPBatch drafting every row
        elif poison == "processor":
            assert "scored_logprobs" in RAISED_IN[0]  # verifying its own slice
        assert engine.peak_decoding == 4  # the failing row shared passes
        procs = [None, make_logits_processors(**penalty), None]
        for job, prompt, p in zip(jobs, greedy, procs):
            want = reference_tokens(model, tok, prompt, 14, logits_processors=p)
            assert tokens_of(results[job]) == want
        # later: a sampled request (no seed: it draws from the random state
        # as the failed row left it) and a greedy one
        sampled = GenerationParams(max_tokens=10, temperature=0.9, top_k=5)
        assert len(tokens_of(job_events(engine.submit(Job(greedy[0], sampled))))) == 10
        again = job_events(engine.submit(Job(greedy[2], GenerationParams(14))))
        assert tokens_of(again) == reference_tokens(model, tok, greedy[2], 14)
    finally:
        tok.eos_token_ids = eos
        engine.close()


def test_mlx_lm_filters_raising_while_traced_leave_the_random_state_whole():
    """mlx-lm's compiled top-k refuses a ``top_k`` at trace time; the random
    state it had taken as an input is put back, and the draws after it are
    those that would have come without the failed call."""
    logprobs = mx.log(mx.softmax(mx.arange(10, dtype=mx.float32)[None] / 3, axis=-1))
    mx.random.seed(7)
    want = mx.random.normal((4,)).tolist()
    mx.random.seed(7)
    with pytest.raises(ValueError, match="top_k"):
        apply_top_k(logprobs, 50)
    assert mx.random.normal((4,)).tolist() == want
    assert apply_top_k(logprobs, 3).shape == (1, 10)  # it still works


@pytest.mark.parametrize("xtc_probability", [0.0, 0.5])
def test_a_top_k_not_below_the_vocabulary_keeps_every_token(xtc_probability):
    """As keeping the top V of V tokens does: the same draws as no top-k."""
    logprobs = mx.log(mx.softmax(mx.arange(10, dtype=mx.float32)[None] / 3, axis=-1))
    draws = []
    for top_k in (0, 10, 5000):
        sampler = make_sampler(0.9, top_k=top_k, xtc_probability=xtc_probability)
        mx.random.seed(11)
        draws.append([sampler(logprobs).item() for _ in range(8)])
    assert draws[0] == draws[1] == draws[2]
