"""The server's protocol fields over HTTP: Anthropic's stop sequences and
cached input tokens, ``echo`` (with ``best_of`` and ``suffix`` refused by
name), non-finite logprobs as JSON null, the model's id (never its path) in
errors, and every route and method answering JSON."""

import json

import pytest

import mlx_spec
from mlx_spec.server.engine import Engine
from mlx_spec.server.events import Finished, GenerationParams, Started, Token
from mlx_spec.server.http import make_app
from mlx_spec.server.openai import OpenAIResponse
from mlx_spec.server.wire import json_bytes
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import request
from mlx_spec.testing.server import gated_engine, request_context, serving

MODEL_ID = "tiny"
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for"
CHAT = [{"role": "user", "content": "write a loop over range(10)"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("protocol") / MODEL_ID, "qwen3_next"
    )


@pytest.fixture(scope="module")
def ports(tiny):
    """The port of ``wide``: an app bound, as far as it knows, to every
    address (no Host check)."""
    with gated_engine(tiny) as engine:
        ctx = request_context(engine.tokenizer, MODEL_ID)
        with serving(make_app(engine, ctx, host="0.0.0.0")) as port:
            yield {"wide": port}


def completion(port, max_tokens=4, **extra):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, **extra}
    status, _, reply = request(port, "POST", "/v1/completions", body)
    assert status == 200, reply
    return reply


def _messages(port, **extra):
    body = {"model": MODEL_ID, "max_tokens": 24, "messages": CHAT, **extra}
    status, _, reply = request(port, "POST", "/v1/messages", body)
    assert status == 200, reply
    return reply


def _events(port, path, body):
    status, _, text = request(port, "POST", path, {**body, "stream": True})
    assert status == 200
    return [json.loads(l[6:]) for l in text.splitlines() if l.startswith("data: {")]


def test_anthropic_stop_sequences_are_reported(ports):
    port = ports["wide"]
    full = _messages(port)["content"][0]["text"]
    stop = full[6:9]
    assert stop and stop not in full[:6]
    msg = _messages(port, stop_sequences=[stop, "never appears"])
    assert msg["content"][0]["text"] == full[: full.index(stop)]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    body = {"max_tokens": 24, "messages": CHAT, "stop_sequences": [stop]}
    (delta,) = [
        e for e in _events(port, "/v1/messages", body) if e["type"] == "message_delta"
    ]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    plain = _messages(port)
    assert (plain["stop_reason"], plain["stop_sequence"]) == ("max_tokens", None)


def test_anthropic_input_tokens_exclude_the_cached_ones(ports):
    port = ports["wide"]
    messages = [{"role": "user", "content": "input tokens, cached or not"}]
    first = _messages(port, messages=messages)["usage"]
    second = _messages(port, messages=messages)["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] > 0
    assert (
        second["input_tokens"] + second["cache_read_input_tokens"]
        == first["input_tokens"]
    )


def test_echo_implemented_best_of_and_suffix_refused_by_name(ports):
    port = ports["wide"]
    text = completion(port, 8)["choices"][0]["text"]
    echoed = completion(port, 8, echo=True)["choices"][0]["text"]
    assert echoed == PROMPT + text
    chunks = _events(
        port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "echo": True}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + text
    for extra, name in (
        ({"best_of": 2}, "best_of"),
        ({"suffix": "return x"}, "suffix"),
        ({"echo": True, "logprobs": 2}, "echo"),
    ):
        body = {"prompt": PROMPT, "max_tokens": 2, **extra}
        status, _, reply = request(port, "POST", "/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == name
        assert f"'{name}'" in reply["error"]["message"]
    assert completion(port, 2, best_of=1, suffix="", echo=False)


def test_non_finite_logprobs_are_null_and_json_stays_standard():
    tokenizer = type("T", (), {"decode": staticmethod(lambda ids: f"<{ids[0]}>")})
    for chat in (True, False):
        params = GenerationParams(max_tokens=2, logprobs=True, top_logprobs=2)
        r = OpenAIResponse(chat, "m", params, tokenizer)
        r.add(Started(3, 0))
        r.add(Token(1, float("-inf"), [(2, -0.1), (1, float("-inf"))]))
        r.add(Finished("length", 1, {}))
        body = json.loads(json_bytes(r.body()))  # raises on NaN or Infinity
        logprobs = body["choices"][0]["logprobs"]
        if chat:
            (entry,) = logprobs["content"]
            assert entry["logprob"] is None
            assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, None]
        else:
            assert logprobs["token_logprobs"] == [None]
            assert logprobs["top_logprobs"] == [{"<2>": -0.1, "<1>": None}]
    with pytest.raises(ValueError):
        json_bytes({"x": float("nan")})
    assert json.loads(json_bytes({"x": "a\ud800"})) == {"x": "a\ud800"}


def test_errors_name_the_model_id_not_its_path(tmp_path):
    """A model without MTP weights: the engine's refusal of ``draft: mtp``
    names the directory; the client sees the model's id instead."""
    path = write_tiny_checkpoint(
        tmp_path / "nomtp", "qwen3_next", mtp_num_hidden_layers=0
    )
    model, tokenizer = mlx_spec.load(path)
    engine = Engine(model, tokenizer, "ngram", 3)
    try:
        ctx = request_context(tokenizer, MODEL_ID)
        app = make_app(engine, ctx, hidden=(str(path),))
        with serving(app) as port:
            body = {"prompt": "x", "max_tokens": 2, "draft": "mtp"}
            status, _, reply = request(port, "POST", "/v1/completions", body)
    finally:
        engine.close()
    message = reply["error"]["message"]
    assert status == 400 and "MTP" in message
    assert str(tmp_path) not in message and MODEL_ID in message


def test_routes_and_methods_answer_json(ports):
    port = ports["wide"]
    status, _, reply = request(port, "GET", "/v1/completions")
    assert status == 405 and "GET" in reply["error"]["message"]
    status, _, reply = request(port, "POST", "/v1/messages/nope", {})
    assert status == 404 and reply["type"] == "error"
    status, _, reply = request(port, "GET", "/v1/models")
    assert [m["id"] for m in reply["data"]] == [MODEL_ID]
