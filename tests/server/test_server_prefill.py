"""Joining prompts that begin alike: one prefill of the common part, a state
kept where they part, and each answer exactly mlx-lm's."""

from mlx_spec.core.decode import SpeculativeDecoder
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.mtp import MTPDrafter
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import GenerationParams, Job, Started
from mlx_spec.server.anthropic import messages_request
from mlx_spec.server.prefill import SHARED_MIN, Joining, PrefillQueue
from mlx_spec.server.openai import openai_request
from mlx_spec.server.prompts import chat_prompt
from mlx_spec.server.requests import ServerContext
from mlx_spec.states.memory import StateCache
from mlx_spec.testing.reference import prompts, reference_tokens, tokens_of
from mlx_spec.testing.server import job_events


def test_prompts_that_begin_alike_prefill_the_common_part_once(models, family):
    """Submitted together: ``a`` (prefilled first), ``b`` sharing its first
    100 tokens, ``c`` equal to ``a`` and ``d`` sharing fewer than
    ``SHARED_MIN``. ``b`` continues the state kept at token 100, ``c`` the one
    at the end of ``a``; ``d`` prefills alone. Every answer equals mlx-lm's."""
    model, tok = models[family]
    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full lengths
    shared = prompts("random", n=100, seed=1)
    a = shared + prompts("random", n=20, seed=2)
    b = shared + [(a[100] + 1) % 256] + prompts("random", n=14, seed=3)
    d = shared[: SHARED_MIN - 1] + [(a[SHARED_MIN - 1] + 1) % 256] + [9] * 40
    engine = Engine(
        model, tok, "mtp+ngram", 3, batch_size=4, prefill_chunk=64, start=False
    )
    try:
        specs = [(a, 10), (b, 8), (list(a), 6), (d, 5)]
        jobs = [engine.submit(Job(p, GenerationParams(n))) for p, n in specs]
        engine.start()
        cached = []
        for job, (prompt, n) in zip(jobs, specs):
            events = job_events(job)
            assert tokens_of(events) == reference_tokens(model, tok, prompt, n)
            cached.append(
                next(e for e in events if isinstance(e, Started)).cached_tokens
            )
        # each kept state's last token is pending: fed with the rest
        assert cached == [0, len(shared) - 1, len(a) - 1, 0]
    finally:
        tok.eos_token_ids = eos
        engine.close()


def _joining(model, prompt, fed):
    """A prefill of ``prompt`` that has fed its first ``fed`` tokens."""
    decoder = SpeculativeDecoder(model, make_drafter("ngram", model), max_draft=3)
    decoder.feed(prompt[:fed])
    return Joining(
        Job(prompt, GenerationParams(4)), "ngram", 3, decoder, prompt[fed:], True
    )


def test_a_prompt_waits_only_for_a_prefill_that_can_still_stop_where_they_part(
    models,
):
    model, _ = models["qwen3_next"]
    states = StateCache(1 << 30)
    queue = PrefillQueue(states, chunk=8)
    prompt = prompts("random", n=120, seed=4)
    j = _joining(model, prompt, 60)
    queue.joining.append(j)

    def job(common):
        return Job(
            prompt[:common] + [(prompt[common] + 1) % 256, 5], GenerationParams(4)
        )

    assert not queue.wait_to_share(job(50), "ngram", 0)  # it is past token 50
    assert not queue.wait_to_share(job(90), "mtp", 0)  # another drafter's state
    assert not queue.wait_to_share(job(90), "ngram", 90 - SHARED_MIN + 1)  # too few
    assert queue.wait_to_share(job(90), "ngram", 0) and j.marks == {90}
    assert not queue.wait_to_share(job(60), "ngram", 0)  # it is there: kept now
    kept = states.lookup("ngram", prompt[:60] + [1])
    assert kept.history == prompt[:60] and kept.pending == 1
    # fed on, it stops at 90, keeps the state there and lets the job waiting start
    released = queue.feed(40, admit=lambda j: None)
    assert [r.prompt[:90] for r in released] == [prompt[:90]]
    assert j.fed == 100 and not j.marks and not queue.waiting
    assert states.lookup("ngram", prompt[:90] + [1]).history == prompt[:90]


def test_a_first_turns_system_prompt_is_kept_for_new_conversations(models, family):
    """A first turn's prompt tells where its system prompt ends; the prefill
    keeps a state there, and a new conversation with the same system prompt
    continues it, its answer still mlx-lm's."""
    model, tok = models[family]
    defaults = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    ctx = ServerContext(tok, "tiny", {**defaults, "max_tokens": 8})
    system = {"role": "system", "content": "Answer in Python only. " * 6}

    def first_turn(text):
        return [system, {"role": "user", "content": text}]

    one, _, shared = chat_prompt(first_turn("sort a list"), None, ctx)
    two, _, shared_two = chat_prompt(first_turn("parse a date"), None, ctx)
    assert shared == shared_two and SHARED_MIN < shared < len(one)
    assert one[:shared] == two[:shared]
    later = first_turn("a") + [{"role": "assistant", "content": "b"}]
    assert chat_prompt(later + [{"role": "user", "content": "c"}], None, ctx)[2] == 0
    for request in (
        openai_request("/v1/chat/completions", {"messages": first_turn("x")}, ctx),
        messages_request(
            {
                "system": system["content"],
                "max_tokens": 8,
                "messages": first_turn("x")[1:],
            },
            ctx,
        ),
    ):
        assert request[2].shared_prefix == shared

    eos, tok.eos_token_ids = tok.eos_token_ids, set()  # run the full lengths
    engine = Engine(model, tok, "mtp+ngram", 3)
    try:
        for prompt, cached in ((one, 0), (two, shared - 1)):
            params = GenerationParams(6, shared_prefix=shared)
            events = job_events(engine.submit(Job(prompt, params)))
            assert (
                next(e for e in events if isinstance(e, Started)).cached_tokens
                == cached
            )
            assert tokens_of(events) == reference_tokens(model, tok, prompt, 6)
    finally:
        tok.eos_token_ids = eos
        engine.close()


class _Template:
    """A chat template that renders a fixed prompt and refuses one-letter texts."""

    has_chat_template, has_thinking, response_initial_state = True, False, None

    def apply_chat_template(self, messages, **kwargs):
        if messages[-1]["content"] in ("a", "b"):
            raise ValueError("refused")
        return list(range(50))


def test_a_template_that_refuses_the_other_texts_still_serves_the_turn():
    ctx = ServerContext(_Template(), "stub", {})
    turn = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert chat_prompt(turn, None, ctx) == (list(range(50)), "normal", 0)


def test_a_job_cancelled_while_it_waits_never_starts(models):
    model, tok = models["qwen3_next"]
    engine = Engine(model, tok, "ngram", 3, start=False)
    prompt = prompts("random", n=80, seed=5)
    first, second = (Job(prompt, GenerationParams(4)) for _ in range(2))
    engine._start(first)
    engine._start(second)  # the same prompt: it waits for the first's prefill
    assert [w[0] for w in engine.prefills.waiting] == [second]
    second.cancel()
    engine._prefill(engine._new_batch())  # the first joins; the second is dropped
    assert len(engine._live) == 1 and len(engine.prefills) == 0
    assert [type(e) for e in list(second.events.queue)] == []


def test_the_drafter_gets_a_prompts_chunks_at_once_where_a_state_is_kept(
    models, monkeypatch
):
    """A prompt prefilled in chunks reaches the drafter in one piece up to
    each length where a state is kept, and at its end; the state kept holds
    the drafter's rows. Fed chunk by chunk it would see 8 pieces."""
    model, _ = models["qwen3_next"]
    seen = []
    for name in ("reset", "accept"):
        own = getattr(MTPDrafter, name)
        monkeypatch.setattr(
            MTPDrafter,
            name,
            lambda d, t, h, own=own, name=name: seen.append((name, len(t)))
            or own(d, t, h),
        )
    states = StateCache(1 << 30)
    queue = PrefillQueue(states, chunk=8)
    prompt = prompts("random", n=64, seed=6)
    decoder = SpeculativeDecoder(model, make_drafter("mtp", model), max_draft=3)
    job = Job(prompt, GenerationParams(4))
    queue.join(Joining(job, "mtp", 3, decoder, prompt, True), shared_prefix=40)
    admitted = []
    while queue.joining:
        queue.feed(8, admit=admitted.append)
    assert seen == [("reset", 40), ("accept", 24)] and len(admitted) == 1
    kept = states.lookup("mtp", prompt[:40] + [1])
    assert kept.history == prompt[:40] and kept.drafter_arrays
    assert kept.drafter_arrays[0].shape[2] == 39  # the head's rows up to there


def test_a_prompt_whose_client_left_is_not_prefilled_further(models):
    """A job cancelled while its prompt is prefilled: the next feed drops it
    at the chunk boundary (nothing more fed, never admitted), and a job
    waiting to share its prefix starts again on its own."""
    model, _ = models["qwen3_next"]
    queue = PrefillQueue(StateCache(1 << 30), chunk=8)
    prompt = prompts("random", n=120, seed=5)
    j = _joining(model, prompt, 16)
    queue.joining.append(j)
    other = Job(prompt[:90] + [(prompt[90] + 1) % 256, 5], GenerationParams(4))
    assert queue.wait_to_share(other, "ngram", 0)
    admitted = []
    assert queue.feed(8, admitted.append) == []  # one chunk: it goes on
    assert j.fed == 24
    j.job.cancel()
    assert queue.feed(64, admitted.append) == [other]
    assert j.fed == 24 and not admitted and not queue.joining and not queue.waiting
