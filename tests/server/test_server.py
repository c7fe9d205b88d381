"""``mlx_spec server`` over HTTP: lossless answers, streaming, concurrency,
conversation state reuse, disconnects and bad input.

One server process on 127.0.0.1 (a free port) serves the module's tests; it
is stopped whatever happens. References are plain mlx-lm greedy decoding of
the same prompt in this process.
"""

import http.client
import json
import socket
import threading
import time

import mlx_lm
import openai
import pytest

import mlx_spec
from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.http_client import get_health as health
from mlx_spec.testing.server import (
    free_port,
    mlx_spec_server,
    running_server,
    served_checkpoint,
)

MODEL_ID = "tiny"
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for"
CHAT = [{"role": "user", "content": "write a loop over range(10)"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served_checkpoint(
        tmp_path_factory,
        write_tiny_checkpoint,
        MODEL_ID,
        "qwen3_next",
        "--num-draft-tokens",
        "3",
    ) as served:
        yield served


@pytest.fixture(scope="module")
def plain(server):
    return mlx_lm.load(str(server[0]))


@pytest.fixture
def client(server):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server[1]}/v1", api_key="none", max_retries=0
    )


def reference(plain, prompt_tokens, max_tokens):
    model, tok = plain
    return mlx_lm.generate(model, tok, prompt_tokens, max_tokens=max_tokens)


def chat_tokens(plain, messages):
    convert_chat, _ = server_message_helpers()
    return plain[1].encode(convert_chat(messages))


def post(port, path, body, raw=None):
    """(status, parsed JSON or SSE text) of a plain HTTP POST."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    is_json = r.getheader("Content-Type", "").startswith("application/json")
    return r.status, json.loads(text) if is_json else text


def wait_idle(port, limit=600):
    """Poll /health until no request is running or queued (bounded)."""
    for _ in range(limit):
        status = health(port)
        if not status["busy"] and status["queued"] == 0:
            return status
        time.sleep(0.05)
    raise TimeoutError("the server stayed busy")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert health(server[1])["status"] == "ok"


def test_completion_equals_mlx_lm_and_mlx_spec_greedy(client, plain, server):
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=24)
    want = reference(plain, plain[1].encode(PROMPT), 24)
    model, tok = mlx_spec.load(server[0])
    assert (
        r.choices[0].text
        == want
        == mlx_spec.generate(model, tok, PROMPT, max_tokens=24)
    )
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    spec = r.model_extra["speculation"]
    assert spec["verify_passes"] >= 1 and 0 <= spec["accepted"] <= spec["drafted"]


def test_penalties_and_logit_bias_equal_mlx_lm(client, plain):
    """mlx_lm.server's logits-processing fields: the text mlx-lm decodes with
    the same processors (which differs from the plain text)."""
    from mlx_lm.sample_utils import make_logits_processors

    args = dict(repetition_penalty=1.5, repetition_context_size=8)
    bias = {11: 4.0, 12: -9.0}
    procs = make_logits_processors(logit_bias=bias, **args)
    model, tok = plain
    prompt = tok.encode(PROMPT)
    want = mlx_lm.generate(model, tok, prompt, max_tokens=24, logits_processors=procs)
    r = client.completions.create(
        model=MODEL_ID,
        prompt=PROMPT,
        max_tokens=24,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body=args,
    )
    assert r.choices[0].text == want != reference(plain, prompt, 24)


def test_xtc_fields_sample_as_mlx_lm(client, plain):
    """XTC always on with threshold 0 keeps the least likely token (and the
    newline and EOS); top_k=1 then makes the draw deterministic."""
    from mlx_lm.sample_utils import make_sampler

    model, tok = plain
    fields = dict(top_k=1, xtc_probability=1.0, xtc_threshold=0.0)
    special = tok.encode("\n") + list(tok.eos_token_ids)
    sampler = make_sampler(1.0, xtc_special_tokens=special, **fields)
    prompt = tok.encode(PROMPT)
    want = mlx_lm.generate(model, tok, prompt, max_tokens=16, sampler=sampler)
    r = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body=fields
    )
    assert r.choices[0].text == want != reference(plain, prompt, 16)


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_chat_equals_mlx_lm_greedy_streaming_or_not(client, plain, draft):
    want = reference(plain, chat_tokens(plain, CHAT), 20)
    extra = {"draft": draft}
    r = client.chat.completions.create(
        model=MODEL_ID, messages=CHAT, max_tokens=20, extra_body=extra
    )
    assert r.choices[0].message.content == want
    stream = client.chat.completions.create(
        model=MODEL_ID,
        messages=CHAT,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[-1].usage.completion_tokens == 20
    assert r.model_extra["speculation"]["draft"] == draft


def test_logprobs_are_those_of_the_chosen_tokens(client):
    r = client.chat.completions.create(
        model=MODEL_ID, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:  # greedy: the chosen token is the most likely
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0


def test_stop_words_end_the_reply(client, plain):
    full = reference(plain, plain[1].encode(PROMPT), 24)
    stop = full[5:8]
    r = client.completions.create(
        model=MODEL_ID, prompt=PROMPT, max_tokens=24, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and full.startswith(r.choices[0].text)


def test_concurrent_requests_each_get_their_answer(server, plain):
    prompts = [PROMPT, "import os\nimport sys\n", "class Stack:\n    def"]
    results = {}

    def ask(i, prompt):
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server[1]}/v1", api_key="x", max_retries=0
        )
        results[i] = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16)

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == [0, 1, 2]
    for i, prompt in enumerate(prompts):
        want = reference(plain, plain[1].encode(prompt), 16)
        assert results[i].choices[0].text == want


def test_next_turn_reuses_the_conversation_state_losslessly(client, plain):
    first = [{"role": "user", "content": "def add(a, b):"}]
    r1 = client.chat.completions.create(model=MODEL_ID, messages=first, max_tokens=12)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "and now subtract"},
    ]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=second, max_tokens=12)
    tokens = chat_tokens(plain, second)
    assert r2.choices[0].message.content == reference(plain, tokens, 12)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # the first turn's prompt (all but its last token) was not prefilled again
    assert len(chat_tokens(plain, first)) - 1 <= cached < len(tokens)


def test_client_disconnect_stops_generation_and_state_stays_exact(
    server, client, plain
):
    port = server[1]
    body = json.dumps({"prompt": "for i in range(", "max_tokens": 2000, "stream": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(request.encode())
        received = b""
        while received.count(b"data: ") < 3:  # a few chunks arrive, then we leave
            data = sock.recv(4096)
            assert data, "the server closed the stream"
            received += data
    status = wait_idle(port)
    prompt_len = len(plain[1].encode("for i in range("))
    assert all(n < prompt_len + 2000 for n in status["kept_states"])
    # the server goes on, with exact state
    r = client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=10)
    assert r.choices[0].text == reference(plain, plain[1].encode(PROMPT), 10)


def test_anthropic_messages(server, plain):
    port = server[1]
    body = {"model": MODEL_ID, "max_tokens": 16, "messages": CHAT}
    status, msg = post(port, "/v1/messages", body)
    assert status == 200 and msg["type"] == "message"
    want = reference(plain, chat_tokens(plain, CHAT), 16)
    assert msg["content"][0] == {"type": "text", "text": want}
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 16
    status, events = post(port, "/v1/messages", {**body, "stream": True})
    datas = [json.loads(l[6:]) for l in events.splitlines() if l.startswith("data: ")]
    kinds = [d["type"] for d in datas]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    text = "".join(
        d["delta"]["text"] for d in datas if d["type"] == "content_block_delta"
    )
    assert text == want


BAD = [
    ("/v1/chat/completions", None, b"{not json", 400),
    ("/v1/chat/completions", {"max_tokens": 4}, None, 400),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, None, 400),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, None, 400),
    ("/v1/chat/completions", {"messages": CHAT, "model": "/etc/passwd"}, None, 404),
    ("/v1/chat/completions", {"messages": CHAT, "draft": "bogus"}, None, 400),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "draft": "mtp", "num_draft_tokens": 12},
        None,
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 99, "logprobs": True},
        None,
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x " * 5000}]},
        None,
        400,
    ),
    ("/v1/completions", {"prompt": 7}, None, 400),
    ("/v1/completions", {"prompt": "x", "n": 2}, None, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"512": 3}}, None, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 3}}, None, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 300}}, None, 400),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": -1}, None, 400),
    ("/v1/completions", {"prompt": "x", "xtc_threshold": 0.9}, None, 400),
    ("/v1/completions", None, b'{"prompt": "x", "temperature": NaN}', 400),
    ("/v1/nothing", {}, None, 404),
]


@pytest.mark.parametrize("path, body, raw, status", BAD)
def test_bad_input_is_a_json_error_and_the_server_keeps_serving(
    server, client, path, body, raw, status
):
    got, reply = post(server[1], path, body, raw)
    assert got == status
    assert isinstance(reply["error"]["message"], str) and reply["error"]["type"]
    r = client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_anthropic_errors_have_anthropic_shape(server):
    status, reply = post(server[1], "/v1/messages", {"messages": CHAT})
    assert status == 400 and reply["type"] == "error"
    assert "max_tokens" in reply["error"]["message"]
    status, reply = post(
        server[1],
        "/v1/messages",
        {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image"}]}],
        },
    )
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"


def test_sigterm_after_serving_exits_cleanly(tmp_path):
    """A server that has decoded requests on its worker thread stops on
    SIGTERM with status 0 (it used to abort while MLX freed the worker
    thread's compile cache during interpreter shutdown)."""
    path = write_tiny_checkpoint(tmp_path / MODEL_ID, "qwen3_next")
    port = free_port()
    with running_server(mlx_spec_server(path, port), port) as proc:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"prompt": PROMPT, "max_tokens": 8}
        conn.request("POST", "/v1/completions", json.dumps(body))
        assert conn.getresponse().status == 200
        conn.close()
        proc.terminate()
        assert proc.wait(timeout=60) == 0
