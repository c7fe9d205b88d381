"""What a careless or hostile client may cost the server, and what it is told:
a reply capped at the model's context and at ``--max-tokens-limit`` (with the
finish reason saying so).

Two kinds of server: an ``mlx_spec server`` process on a tiny checkpoint
with a small context (the command's own wiring), and an in-process app on an
engine of the test's. Every wait is for a signal, bounded; servers listen on
free ports of 127.0.0.1.
"""

import pytest

import mlx_spec
from mlx_spec.commands import server as server_command
from mlx_spec.core.batch_row import BatchRow
from mlx_spec.drafters import default_draft
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Finished, GenerationParams, Job
from mlx_spec.server.http import make_app
from mlx_spec.server.requests import ServerContext
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import get_health, post_json, post_stream
from mlx_spec.testing.server import GatedEngine, job_events, served_checkpoint
from mlx_spec.testing.server import serving

MODEL_ID = "tiny"
CONTEXT = 128  # the small-context checkpoint's max_position_embeddings
CEILING = 12  # the in-process app's max_tokens_limit
PROMPT = "import os"  # greedy, its reply runs past 3000 tokens before EOS
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
FINISH = {"/v1/messages": "max_tokens"}  # else "length"


def body_for(path, max_tokens, **fields):
    if path == "/v1/completions":
        body = {"prompt": PROMPT}
    else:
        body = {"messages": [{"role": "user", "content": PROMPT}]}
    return {"max_tokens": max_tokens, **body, **fields}


def finish_of(path, reply) -> str:
    if path == "/v1/messages":
        return reply["stop_reason"]
    return reply["choices"][0]["finish_reason"]


def usage_of(path, reply):
    """(prompt tokens, completion tokens) of a reply not streamed."""
    u = reply["usage"]
    if path == "/v1/messages":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"]
    return u["prompt_tokens"], u["completion_tokens"]


# -- servers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    """``mlx_spec server`` on a checkpoint whose context is ``CONTEXT``
    tokens, drafting 3 tokens a pass (so drafts reach the context's end)."""

    def write(path, family):
        return write_tiny_checkpoint(path, family, max_position_embeddings=CONTEXT)

    with served_checkpoint(
        tmp_path_factory, write, MODEL_ID, "qwen3_next", "--num-draft-tokens", "3"
    ) as served:
        yield served[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("limits") / MODEL_ID, "qwen3_next"
    )


@pytest.fixture(scope="module")
def engine(tiny):
    model, tokenizer = mlx_spec.load(tiny)
    engine = GatedEngine(model, tokenizer, default_draft(model), 3)
    yield engine
    engine.gate.set()
    engine.close()


def _context(engine, **extra):
    return ServerContext(
        engine.tokenizer,
        model_id=MODEL_ID,
        defaults={
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "max_tokens": 8,
        },
        context_length=4096,
        vocab_size=512,
        **extra,
    )


@pytest.fixture(scope="module")
def apps(engine):
    """An in-process app on the engine: ``capped`` (a ``max_tokens_limit``
    of ``CEILING``)."""
    with serving(make_app(engine, _context(engine, max_tokens_limit=CEILING))) as a:
        yield {"capped": a}


# -- max_tokens: capped, never past the context ----------------------------


def _streamed_usage(port, path, body):
    """(prompt tokens, completion tokens) of a streamed reply, whose finish
    must say it was cut at its budget."""
    if path == "/v1/messages":
        events = post_stream(port, path, {**body, "stream": True})
        (start,) = [e for e in events if e["type"] == "message_start"]
        (delta,) = [e for e in events if e["type"] == "message_delta"]
        assert delta["delta"]["stop_reason"] == "max_tokens"
        usage = start["message"]["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        return prompt, delta["usage"]["output_tokens"]
    options = {"stream": True, "stream_options": {"include_usage": True}}
    events = post_stream(port, path, {**body, **options})
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("asked", [1000, 2**70])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_reply_ends_at_the_context_with_a_length_finish(
    small_context, path, asked, stream
):
    """``max_tokens`` past what the prompt leaves of the context (or 2**70)
    is not refused: the reply stops at the context, and says so."""
    body = body_for(path, asked)
    if stream:
        prompt, completion = _streamed_usage(small_context, path, body)
    else:
        status, reply = post_json(small_context, path, body)
        assert status == 200, reply
        assert finish_of(path, reply) == FINISH.get(path, "length")
        prompt, completion = usage_of(path, reply)
    assert prompt + completion == CONTEXT
    # the states kept after the replies hold no more than the context
    assert max(get_health(small_context)["kept_states"]) <= CONTEXT


def test_the_engine_never_drafts_past_the_context(tiny, monkeypatch):
    """Every draft a row makes, verified with its pending token, ends within
    the model's context, and the reply fills it: the budget a row gets is
    what its prompt leaves of the context."""
    reach = []  # tokens the caches would hold after each pass, drafts kept
    draft = BatchRow.draft

    def recorded(self, k, heads):
        made = draft(self, k, heads)
        reach.append((len(self.decoder.history) + made[0].size, made[0].size))
        return made

    monkeypatch.setattr(BatchRow, "draft", recorded)
    model, tok = mlx_spec.load(tiny)
    context = 96
    for name in ("ngram", "mtp+ngram"):
        engine = Engine(model, tok, name, num_draft_tokens=3, context_length=context)
        try:
            prompt = tok.encode(PROMPT * 4)
            job = engine.submit(Job(prompt, GenerationParams(max_tokens=10**6)))
            (finished,) = [e for e in job_events(job) if isinstance(e, Finished)]
        finally:
            engine.close()
        assert finished.reason == "length"
        assert len(prompt) + finished.completion_tokens == context
        assert finished.speculation["drafted"] > 0
    assert max(r for r, _ in reach) <= context
    assert any(size for _, size in reach)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_max_tokens_is_capped_at_the_server_limit(apps, path):
    port = apps["capped"]
    for fields in ({"max_tokens": 2**70}, {"max_tokens": 10**6}):
        status, reply = post_json(port, path, body_for(path, **fields))
        assert status == 200, reply
        assert usage_of(path, reply)[1] == CEILING
        assert finish_of(path, reply) == FINISH.get(path, "length")
    if path != "/v1/messages":
        body = body_for(path, 4, max_completion_tokens=2**70)
        status, reply = post_json(port, path, body)
        assert status == 200 and usage_of(path, reply)[1] == CEILING
    status, reply = post_json(port, path, body_for(path, 5))
    assert status == 200 and usage_of(path, reply)[1] == 5  # below it: its own


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-tokens", "600", "--max-tokens-limit", "500"], "--max-tokens"),
        (["--max-tokens-limit", "0"], "--max-tokens-limit"),
        (["--temp", "1e-30"], "--temp"),
    ],
)
def test_bad_limit_flags_are_one_line_naming_the_flag(capsys, argv, flag):
    assert server_command.main(["--model", "/nonexistent", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mlx_spec server: ")
    assert flag in err
