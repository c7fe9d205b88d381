"""Bad sampling fields and malformed text, on the OpenAI and Anthropic
endpoints: a 400 naming the field, before anything reaches the engine; and a
``top_k`` past the vocabulary, sent beside other requests, harms none of them.

One server process on 127.0.0.1 (a free port) serves the module's tests,
reached with a plain HTTP client (only the request and response shapes
matter here, not the HTTP stack behind them).
"""

import http.client
import json
import threading

import mlx_lm
import pytest

from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.checkpoints import write_tiny_checkpoint
from mlx_spec.testing.server import served_checkpoint

MODEL_ID = "tiny"
VOCAB = 512  # the tiny checkpoint's vocab_size
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for"
OPENAI = ("/v1/chat/completions", "/v1/completions")
ENDPOINTS = OPENAI + ("/v1/messages",)


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


def post(port, path, body, raw=None):
    """(status, parsed JSON) of a plain HTTP POST (``raw``: the body's bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def request(path, max_tokens=4, **fields):
    """A minimal valid body for ``path`` with ``fields`` added."""
    if path == "/v1/completions":
        body = {"prompt": PROMPT}
    else:
        body = {"messages": [{"role": "user", "content": PROMPT}]}
    return {"model": MODEL_ID, "max_tokens": max_tokens, **body, **fields}


def error_message(body) -> str:
    return body["error"]["message"]


BAD_FIELDS = {
    "seed": [-1, 2**64, 1.5, "7"],
    "temperature": [-0.1, "hot"],
    "top_p": [1.5, -0.2],
    "min_p": [2, -1],
    "top_k": [-2, 2.5, True],
    "xtc_probability": [1.5],
    "max_tokens": [0, -3],
}


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    "name, value", [(n, v) for n, values in BAD_FIELDS.items() for v in values]
)
def test_a_bad_sampling_field_is_a_400_naming_it(server, path, name, value):
    status, body = post(server[1], path, request(path, **{name: value}))
    assert status == 400, body
    assert f"'{name}'" in error_message(body) and repr(value) in error_message(body)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("name", ["temperature", "top_p", "seed"])
def test_nan_and_infinity_are_refused(server, path, name):
    for literal in ("NaN", "Infinity", "-Infinity"):
        raw = json.dumps(request(path))[:-1] + f', "{name}": {literal}}}'
        status, body = post(server[1], path, None, raw=raw.encode())
        assert status == 400 and f"'{name}'" in error_message(body), body


@pytest.mark.parametrize("path", OPENAI)
@pytest.mark.parametrize(
    "name, value, named",
    [
        ("logit_bias", {str(VOCAB): 1.0}, f"below {VOCAB}"),
        ("logit_bias", {"-1": 1.0}, "'-1'"),
        ("logit_bias", {"5": float("nan")}, "nan"),
        ("presence_penalty", "x", "'presence_penalty'"),
        ("repetition_penalty", -1, "'repetition_penalty'"),
        ("repetition_context_size", 10**30, "'repetition_context_size'"),
    ],
)
def test_bad_logits_processing_is_a_400_naming_it(server, path, name, value, named):
    fields = {name: value}
    if name.endswith("context_size"):
        fields["repetition_penalty"] = 1.2
    status, body = post(server[1], path, request(path, **fields))
    assert status == 400 and named in error_message(body), body


@pytest.mark.parametrize(
    "path, field, named",
    [
        ("/v1/completions", "prompt", "prompt"),
        ("/v1/chat/completions", "messages", "messages[0].content"),
        ("/v1/messages", "messages", "messages[0].content"),
        ("/v1/messages", "system", "system"),
        ("/v1/chat/completions", "stop", "stop"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(server, path, field, named):
    body = request(path)
    text = "hello \ud800 there"
    if field == "messages":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body[field] = text
    status, reply = post(server[1], path, body)  # json.dumps writes \ud800
    assert status == 400, reply
    assert named in error_message(reply) and "surrogate" in error_message(reply)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize(
    "content, named",
    [
        ([5], "messages[0].content[0]"),
        ([{"type": "text"}], "messages[0].content[0].text"),
        ([{"type": "text", "text": "a"}, {"type": "image"}], "messages[0].content[1]"),
        (["hello"], "messages[0].content[0]"),
    ],
)
def test_bad_content_parts_are_a_400_naming_them(server, path, content, named):
    body = request(path, messages=[{"role": "user", "content": content}])
    status, reply = post(server[1], path, body)
    assert status == 400, reply
    assert named in error_message(reply), reply


def test_text_parts_are_joined_as_one_string(server):
    parts = [
        {"type": "text", "text": PROMPT[:10]},
        {"type": "text", "text": PROMPT[10:]},
    ]
    path = "/v1/chat/completions"
    one = post(server[1], path, request(path, max_tokens=6))
    split = post(
        server[1], path, request(path, 6, messages=[{"role": "user", "content": parts}])
    )
    assert one[0] == split[0] == 200
    text = [r[1]["choices"][0]["message"]["content"] for r in (one, split)]
    assert text[0] == text[1]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_top_k_past_the_vocabulary_harms_no_other_request(server, path):
    """A ``top_k`` of at least the vocabulary size, sampled, beside greedy
    requests: every request is answered, the greedy ones as mlx-lm decodes
    them, and sampled requests after it still work. A ``top_k`` past the
    vocabulary keeps every token (as vLLM clamps it)."""
    model, tok = mlx_lm.load(str(server[0]))
    if path == "/v1/completions":
        prompt = tok.encode(PROMPT)
    else:  # the tiny tokenizer has no chat template: mlx_lm.server's text
        convert_chat, _ = server_message_helpers()
        prompt = tok.encode(convert_chat([{"role": "user", "content": PROMPT}]))
    want = mlx_lm.generate(model, tok, prompt, max_tokens=12)
    results = {}

    def client(name, body):
        results[name] = post(server[1], path, body)

    bodies = {
        "huge_top_k": request(path, 12, temperature=0.7, top_k=5000),
        "vocab_top_k": request(path, 12, temperature=0.7, top_k=VOCAB),
        "greedy": request(path, 12, temperature=0.0),
        "greedy_2": request(path, 12, temperature=0.0),
    }
    threads = [threading.Thread(target=client, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    assert {name: r[0] for name, r in results.items()} == dict.fromkeys(bodies, 200)
    for name in ("greedy", "greedy_2"):
        reply = results[name][1]
        text = (
            reply["choices"][0]["text"]
            if path == "/v1/completions"
            else "".join(b["text"] for b in reply["content"] if b["type"] == "text")
        )
        assert text == want
    later = post(server[1], path, request(path, 8, temperature=0.9, top_k=7))
    assert later[0] == 200, later


# Every number a request may carry, by endpoint; each is range-checked before
# anything reaches MLX (which cannot take an integer past 64 bits, and turns a
# float past float32's range into inf).
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "seed", "xtc_probability"]
SAMPLING += ["xtc_threshold", "num_draft_tokens", "max_tokens"]
PENALTIES = ["repetition_penalty", "presence_penalty", "frequency_penalty"]
PENALTIES += [f"{p}_context_size" for p in ("repetition", "presence", "frequency")]
NUMBERS = {
    "/v1/chat/completions": SAMPLING
    + PENALTIES
    + ["max_completion_tokens", "n", "top_logprobs", "logit_bias"],
    "/v1/completions": SAMPLING
    + PENALTIES
    + ["max_completion_tokens", "n", "logprobs", "best_of", "logit_bias"],
    "/v1/messages": SAMPLING,
}
HUGE = [2**70, -(2**70), 1e308, -1e308, 10**400]
# a large integer is a budget to cap (tested in test_server_limits.py) or a
# top_k that keeps every token; anything else out of range is refused
ACCEPTED = {"max_tokens", "max_completion_tokens", "top_k"}


@pytest.mark.parametrize(
    "path, name", [(p, n) for p, names in NUMBERS.items() for n in names]
)
def test_huge_numbers_are_a_400_naming_the_field(server, path, name):
    for value in HUGE:
        if name in ACCEPTED and isinstance(value, int) and value > 0:
            continue
        fields = {name: value}
        if name == "logit_bias":
            fields = {name: {"5": value}}
        elif name.endswith("_context_size"):
            fields["repetition_penalty"] = 1.2
        elif name == "max_tokens":
            fields = {}
        body = request(path, **fields)
        if name == "max_tokens":
            body["max_tokens"] = value
        status, reply = post(server[1], path, body)
        assert status == 400, (value, reply)
        assert f"'{name}'" in error_message(reply), (value, reply)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_huge_top_k_keeps_every_token(server, path):
    status, reply = post(server[1], path, request(path, top_k=2**70))
    assert status == 200, reply


@pytest.mark.parametrize("path", OPENAI)
@pytest.mark.parametrize(
    "name, value",
    [
        ("temperature", 1e-300),  # 1 / temperature is inf in float32
        ("repetition_penalty", 1e-300),  # seen logits divided by 0
        ("repetition_penalty", 11),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("temperature", 101),
    ],
)
def test_numbers_outside_their_documented_range_are_a_400(server, path, name, value):
    status, reply = post(server[1], path, request(path, **{name: value}))
    assert status == 400 and f"'{name}'" in error_message(reply), reply


@pytest.mark.parametrize("path", OPENAI)
def test_values_clients_send_are_accepted(server, path):
    """The common settings (OpenAI's, mlx-lm's, Qwen's recommended ones)."""
    for fields in (
        {"temperature": 2, "presence_penalty": 2, "frequency_penalty": -2},
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5},
        {"repetition_penalty": 1.1, "repetition_context_size": 64},
        {"temperature": 1e-5, "min_p": 0.05, "seed": 2**64 - 1},
    ):
        status, reply = post(server[1], path, request(path, **fields))
        assert status == 200, (fields, reply)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_number_too_long_to_read_is_a_400(server, path):
    raw = json.dumps(request(path))[:-1] + ', "seed": ' + "9" * 5000 + "}"
    status, reply = post(server[1], path, None, raw=raw.encode())
    assert status == 400 and "too many digits" in error_message(reply), reply
