"""The server's engine without HTTP: kept states reused exactly, the text
router (reasoning, tool calls, stop words) and the state cache's bounds."""

import json

import mlx.core as mx
import pytest
from mlx_lm.tool_parsers import json_tools

from mlx_spec.states.snapshot import DecoderState
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import (
    GenerationParams,
    Job,
    Segment,
    Started,
    TextRouter,
    Token,
    ToolCall,
)
from mlx_spec.states.memory import StateCache
from mlx_spec.testing.reference import prompts, reference_tokens, tokens_of
from mlx_spec.testing.server import job_events


def run(engine, prompt, **params):
    return job_events(engine.submit(Job(prompt, GenerationParams(**params))))


@pytest.fixture(params=["ngram", "mtp+ngram"])
def engine(request, models):
    model, tok = models["qwen3_next"]
    e = Engine(model, tok, request.param, num_draft_tokens=3)
    yield e
    e.close()


def test_a_longer_prompt_continues_the_kept_state_exactly(engine, models):
    model, tok = models["qwen3_next"]
    tok.eos_token_ids = set()  # run the full lengths
    try:
        first = prompts("mixed")
        events = run(engine, first, max_tokens=10)
        reply = tokens_of(events)
        assert reply == reference_tokens(model, tok, first, 10)
        second = first + reply + [5, 6, 7]
        events = run(engine, second, max_tokens=12)
        # the first request's state, kept with its last token pending (no
        # forward when it left): that token is fed with the new ones
        started = next(e for e in events if isinstance(e, Started))
        assert started.cached_tokens == len(first) + len(reply) - 1
        assert tokens_of(events) == reference_tokens(model, tok, second, 12)
        # the same conversation again: the state at the end of its prompt
        again = run(engine, second, max_tokens=12)
        assert next(e for e in again if isinstance(e, Started)).cached_tokens == (
            len(second) - 1
        )
        assert tokens_of(again) == tokens_of(events)
    finally:
        tok.eos_token_ids = {399}


def test_kept_states_leave_their_last_token_pending(models, family):
    """A request that ends keeps its state without a forward (its last token
    pending, and its MTP head's last rows deferred). A prompt equal to that
    history continues it with nothing to prefill; a longer one feeds the
    pending token with its own. Both equal mlx-lm's decoding of the whole
    prompt."""
    model, tok = models[family]
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full lengths
    engine = Engine(model, tok, "mtp+ngram", num_draft_tokens=3)
    try:
        first = prompts("mixed")
        history = first + tokens_of(run(engine, first, max_tokens=10))
        kept = engine.states.lookup("mtp+ngram", history)
        assert kept.history == history and kept.pending == 1
        offsets = {c.offset for c in kept.caches if hasattr(c, "keys")}
        assert offsets == {len(history) - 1}  # the last token was not run
        assert kept.drafter_deferred  # nor the head's last rows
        for prompt in (history, history + [5, 6]):
            events = run(engine, prompt, max_tokens=8)
            started = next(e for e in events if isinstance(e, Started))
            assert started.cached_tokens == len(history) - 1
            assert tokens_of(events) == reference_tokens(model, tok, prompt, 8)
    finally:
        tok.eos_token_ids = eos
        engine.close()


def test_token_logprobs_only_when_asked(engine):
    """Reading a logprob synchronises the host (behind any pass queued
    ahead), so a request that did not ask for them gets none."""
    plain = [e for e in run(engine, [5, 6, 7], max_tokens=4) if isinstance(e, Token)]
    asked = run(engine, [5, 6, 7], max_tokens=4, logprobs=True)
    asked = [e for e in asked if isinstance(e, Token)]
    assert [e.token for e in plain] == [e.token for e in asked]
    assert all(e.logprob is None for e in plain)
    assert all(isinstance(e.logprob, float) and e.logprob <= 0 for e in asked)


def test_concurrent_jobs_share_passes_and_each_gets_its_answer(models):
    model, tok = models["qwen3_5_moe"]
    engine = Engine(model, tok, "ngram", num_draft_tokens=3, batch_size=3, start=False)
    try:
        specs = [(prompts("mixed"), 12), (prompts("repetitive"), 20), ([4, 8, 15], 7)]
        jobs = [engine.submit(Job(p, GenerationParams(n))) for p, n in specs]
        engine.start()  # all three are waiting: they join the first pass together
        for job, (prompt, n) in zip(jobs, specs):
            assert tokens_of(job_events(job)) == reference_tokens(model, tok, prompt, n)
        assert engine.peak_decoding == 3
        work = engine.status()["worker"]
        assert work["prefill_s"] > 0 and work["passes_s"] > 0
        # every pass ran all three rows until the shortest ended, then fewer
        assert 1 < work["rows_per_pass"] < 3 and work["passes"] >= 20 / 4
    finally:
        engine.close()


def test_a_cancelled_job_keeps_only_what_was_decoded(engine, models):
    model, tok = models["qwen3_next"]
    prompt = prompts("repetitive")
    job = Job(prompt, GenerationParams(max_tokens=500))
    job.cancel()  # before it starts: never run
    engine.submit(job)
    events = run(engine, prompt, max_tokens=4)  # the queue moved on
    assert len(tokens_of(events)) == 4
    assert job.events.empty()


class StubTokenizer:
    """The attributes mlx-lm's text state machine reads, for a tokenizer with
    think and tool-call markers (mlx-lm's JSON tool parser)."""

    has_thinking, think_start, think_end = True, "<think>", "</think>"
    has_tool_calling = True
    tool_call_start, tool_call_end = "<tool_call>", "</tool_call>"
    response_transitions, structural_markers = {}, []
    tool_parser = staticmethod(json_tools.parse_tool_call)


def route(chunks, stop=(), initial="normal", last="stop"):
    router = TextRouter(StubTokenizer(), GenerationParams(8, stop=list(stop)), initial)
    events = []
    for i, chunk in enumerate(chunks):
        end = i == len(chunks) - 1
        events += router.feed(chunk, end and last == "stop", end and last == "length")
        if router.stopped:
            break
    return router, events


def test_router_splits_reasoning_content_and_tool_calls():
    call = json.dumps({"name": "f", "arguments": {"x": 1}})
    text = f"<think>plan it</think>Hello <tool_call>{call}</tool_call>"
    chunks = [text[i : i + 5] for i in range(0, len(text), 5)]  # markers split
    router, events = route(chunks)
    reasoning = "".join(
        e.text for e in events if isinstance(e, Segment) and e.kind == "reasoning"
    )
    content = "".join(
        e.text for e in events if isinstance(e, Segment) and e.kind == "content"
    )
    assert reasoning == "plan it" and content == "Hello "
    assert [e for e in events if isinstance(e, ToolCall)] == [ToolCall("f", {"x": 1})]
    assert router.made_tool_call


def test_router_starts_in_reasoning_when_the_prompt_opened_a_think_block():
    _, events = route(["a</think>b"], initial="reasoning")
    assert events == [Segment("reasoning", "a"), Segment("content", "b")]


def test_stop_word_across_chunks_ends_the_text_before_it():
    router, events = route(["abcST", "OPdef", "ghi"], stop=["STOP"])
    assert router.stopped
    assert "".join(e.text for e in events) == "abc"


def test_length_flushes_held_back_text():
    _, events = route(["ab<thi"], last="length")
    assert "".join(e.text for e in events) == "ab<thi"


def _state(history, nbytes):
    return DecoderState(list(history), None, [], "ngram", [mx.zeros((nbytes // 4,))])


def test_state_cache_longest_strict_prefix_and_bounds():
    cache = StateCache(max_bytes=1000, max_entries=3)
    cache.insert(_state([1, 2], 100))
    cache.insert(_state([1, 2, 3, 4], 100))
    assert cache.lookup("ngram", [1, 2, 3, 4, 5]).history == [1, 2, 3, 4]
    assert cache.lookup("ngram", [1, 2, 3, 4]).history == [1, 2]  # strict prefix
    assert cache.lookup("mtp", [1, 2, 3, 4, 5]) is None  # another drafter's
    assert cache.lookup("ngram", [9]) is None
    left = _state([1, 2, 3, 4, 5], 100)
    left.pending = 1  # its last token not run: a prompt may end there
    cache.insert(left)
    assert cache.lookup("ngram", [1, 2, 3, 4, 5]) is left
    assert cache.lookup("ngram", [1, 2, 3, 4, 6]).history == [1, 2, 3, 4]
    cache.insert(_state([7], 100))
    cache.insert(_state([8], 100))  # a fourth entry: the least recently used goes
    assert len(cache) == 3 and cache.lookup("ngram", [1, 2, 3, 4, 5, 6]) is not None
    cache.insert(_state([6], 900))  # over the byte bound: evicted down to fit
    assert cache.nbytes <= 1000
    cache.insert(_state([5], 5000))  # larger than the bound: not kept
    assert cache.lookup("ngram", [5, 1]) is None and cache.nbytes <= 1000


class _Recording(Engine):
    """Records, before each pass, how many prompts are still prefilling."""

    def _step(self, batch):
        self.prefilling_at_pass.append(len(self.prefills.joining))
        super()._step(batch)


def _submit_all_then_start(engine, model, tok, specs):
    """Submit a job per (prompt, max_tokens) of ``specs`` to the stopped
    ``engine``, start it, and check that each answer equals mlx-lm's."""
    jobs = [engine.submit(Job(p, GenerationParams(n))) for p, n in specs]
    engine.start()
    for job, (prompt, n) in zip(jobs, specs):
        assert tokens_of(job_events(job)) == reference_tokens(model, tok, prompt, n)


def test_a_long_prompt_joins_mid_run_in_chunks(models):
    """A 300-token prompt joins while another request decodes: it is
    prefilled 64 tokens between passes (the other one goes on decoding), and
    both answers equal mlx-lm's."""
    model, tok = models["qwen3_next"]
    tok.eos_token_ids = set()  # run the full lengths
    engine = _Recording(
        model, tok, "mtp+ngram", 3, batch_size=2, prefill_chunk=64, start=False
    )
    engine.prefilling_at_pass = []
    try:
        specs = [(prompts("mixed"), 40), (prompts("random", n=300, seed=3), 12)]
        _submit_all_then_start(engine, model, tok, specs)
        # passes with the long one prefilling: the short one's first, then one
        # after each of its 299 tokens' chunks but the last; then it decodes
        chunks = -(-299 // 64)
        assert engine.prefilling_at_pass[: chunks + 1] == [1] * chunks + [0]
        assert engine.peak_decoding == 2
    finally:
        tok.eos_token_ids = {399}
        engine.close()


@pytest.mark.parametrize("predict", [True, False])
def test_no_pass_is_queued_ahead_of_a_joining_prompt(
    models, family, monkeypatch, predict
):
    """Plain passes are queued a pass ahead, and a row joining rolls the
    queued pass back. The engine does not queue the pass before a prompt
    joins, so none is thrown away (the control, without the prediction,
    throws one away); both answers equal mlx-lm's either way."""
    from mlx_spec.core.queue_ahead import QueueAhead
    from mlx_spec.server.prefill import PrefillQueue

    discarded = []
    unqueue = QueueAhead.unqueue

    def counting(self):
        discarded.append(self.forward is not None)
        unqueue(self)

    monkeypatch.setattr(QueueAhead, "unqueue", counting)
    if not predict:
        monkeypatch.setattr(PrefillQueue, "admits_next", lambda *_: False)
    model, tok = models[family]
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full lengths
    engine = Engine(model, tok, "none", 0, batch_size=2, prefill_chunk=64, start=False)
    try:
        specs = [(prompts("mixed"), 40), (prompts("random", n=200, seed=3), 12)]
        _submit_all_then_start(engine, model, tok, specs)
        assert any(discarded) != predict
    finally:
        tok.eos_token_ids = eos
        engine.close()
