"""``mlx_spec server`` over HTTP where drafts are accepted.

The server of test_server.py drafts with a random-weight head whose drafts
are never accepted, so a server that lost a pass's accepted drafts would
still answer right there. This one serves a predictive checkpoint (its head
predicts the target, its greedy text repeats itself): every test asserts
that the server reported accepted drafts for the request, and compares the
text, the stop-word cut and the logprobs with mlx-lm's own decoding in this
process. Bad requests get a 400 whose message names the bad field.
"""

import math
import threading

import mlx.core as mx
import mlx_lm
import pytest

from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.http_client import post_json, post_stream
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint
from mlx_spec.testing.server import served_checkpoint

MODEL_ID = "pred"
PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for"
PROMPTS = [PROMPT, "hello", "class Stack:\n    def"]
CHAT = [{"role": "user", "content": "def fibonacci(n):"}]
N = 40
LOGPROB_TOLERANCE = 1e-4  # float32 logits of a verify pass vs one-token steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served_checkpoint(
        tmp_path_factory,
        write_predictive_checkpoint,
        MODEL_ID,
        "qwen3_next",
        "--num-draft-tokens",
        "3",
    ) as served:
        yield served


@pytest.fixture(scope="module")
def plain(server):
    return mlx_lm.load(str(server[0]))


def reference(plain, prompt_tokens, max_tokens=N):
    """mlx-lm's greedy text, token ids and per-token log-probabilities."""
    model, tok = plain
    text, tokens, logprobs = "", [], []
    for r in mlx_lm.stream_generate(model, tok, prompt_tokens, max_tokens=max_tokens):
        text += r.text
        tokens.append(r.token)
        logprobs.append(r.logprobs)
    return text, tokens, logprobs


def chat_tokens(plain, messages):
    convert_chat, _ = server_message_helpers()
    return plain[1].encode(convert_chat(messages))


def complete(server, **body):
    status, reply = post_json(
        server[1], "/v1/completions", {"model": MODEL_ID, "max_tokens": N, **body}
    )
    assert status == 200, reply
    return reply


def assert_accepted(reply, draft=None):
    spec = reply["speculation"]
    assert 0 < spec["accepted"] <= spec["drafted"], spec
    if draft is not None:
        assert spec["draft"] == draft


@pytest.mark.parametrize("draft", ["ngram", "mtp", "mtp+ngram"])
def test_completion_with_accepted_drafts_equals_mlx_lm(server, plain, draft):
    want = reference(plain, plain[1].encode(PROMPT))[0]
    reply = complete(server, prompt=PROMPT, draft=draft)
    assert reply["choices"][0]["text"] == want
    assert reply["usage"]["completion_tokens"] == N
    assert_accepted(reply, draft)


def test_streamed_completion_with_accepted_drafts_equals_mlx_lm(server, plain):
    want = reference(plain, plain[1].encode(PROMPT))[0]
    chunks = post_stream(
        server[1],
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": N, "stream": True},
    )
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert_accepted(chunks[-1])


def test_chat_with_accepted_drafts_equals_mlx_lm(server, plain):
    want = reference(plain, chat_tokens(plain, CHAT))[0]
    status, reply = post_json(
        server[1], "/v1/chat/completions", {"messages": CHAT, "max_tokens": N}
    )
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == want
    assert_accepted(reply)


def test_concurrent_requests_with_accepted_drafts(server, plain):
    """Three requests decoded together in batched passes: each gets its own
    text, and drafts were accepted in each."""
    replies, errors = {}, []

    def ask(i, prompt):
        try:
            replies[i] = complete(server, prompt=prompt)
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=ask, args=a) for a in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(replies) == len(PROMPTS), errors
    for i, prompt in enumerate(PROMPTS):
        want = reference(plain, plain[1].encode(prompt))[0]
        assert replies[i]["choices"][0]["text"] == want, prompt
        assert_accepted(replies[i])


def _stop_word(text):
    """A 3-character piece of ``text`` that first occurs past its first
    quarter (so the reply before it is not empty), free of replacement
    characters; and where it starts."""
    for i in range(len(text) // 4, len(text) - 3):
        piece = text[i : i + 3]
        if "\ufffd" not in piece and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no stop word in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_word_cuts_the_reply_before_it(server, plain, stream):
    want = reference(plain, plain[1].encode(PROMPT))[0]
    stop, at = _stop_word(want)
    body = {"prompt": PROMPT, "max_tokens": N, "stop": [stop]}
    if stream:
        chunks = post_stream(server[1], "/v1/completions", {**body, "stream": True})
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finish, reply = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]
    else:
        reply = complete(server, **body)
        text, finish = reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]
    assert text and text == want[:at]
    assert finish == "stop"
    assert_accepted(reply)


def _top(logprobs, n):
    order = mx.argsort(-logprobs)[:n].tolist()
    return [(i, logprobs[i].item()) for i in order]


def test_completion_logprobs_equal_mlx_lm(server, plain):
    """Each token's log-probability, and the top alternatives' values, are
    mlx-lm's (accepted drafts' rows come from a multi-token verify pass)."""
    text, tokens, logprobs = reference(plain, plain[1].encode(PROMPT))
    reply = complete(server, prompt=PROMPT, logprobs=3)
    got = reply["choices"][0]["logprobs"]
    assert reply["choices"][0]["text"] == text
    assert len(got["token_logprobs"]) == len(tokens)
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert math.isclose(
            got["token_logprobs"][i], lp[token].item(), abs_tol=LOGPROB_TOLERANCE
        ), i
        want_values = [v for _, v in _top(lp, 3)]
        got_values = sorted(got["top_logprobs"][i].values(), reverse=True)
        # distinct ids may decode to one string (a partial UTF-8 byte): the
        # dict keeps one value per string, each one of mlx-lm's top three
        for v in got_values:
            assert any(
                math.isclose(v, w, abs_tol=LOGPROB_TOLERANCE) for w in want_values
            )
    assert_accepted(reply)


def test_chat_logprobs_equal_mlx_lm(server, plain):
    """Chat logprobs list each alternative with its bytes: the top ids'
    values in mlx-lm's order."""
    text, tokens, logprobs = reference(plain, chat_tokens(plain, CHAT))
    status, reply = post_json(
        server[1],
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": N, "logprobs": True, "top_logprobs": 2},
    )
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == len(tokens)
    for entry, token, lp in zip(content, tokens, logprobs):
        assert math.isclose(
            entry["logprob"], lp[token].item(), abs_tol=LOGPROB_TOLERANCE
        )
        got = [alt["logprob"] for alt in entry["top_logprobs"]]
        want = [v for _, v in _top(lp, 2)]
        assert all(
            math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE) for a, b in zip(got, want)
        )
        assert len(got) == 2
    assert_accepted(reply)


# (endpoint, the fields that make the body bad, the field the message names)
BAD_FIELDS = [
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"min_p": -0.1}, "min_p"),
    ("/v1/completions", {"top_k": 2.5}, "top_k"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"seed": "x"}, "seed"),
    ("/v1/completions", {"logprobs": 99}, "logprobs"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"draft": "bogus"}, "draft"),
    ("/v1/completions", {"num_draft_tokens": 99}, "num_draft_tokens"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"repetition_penalty": -1}, "repetition_penalty"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
]


@pytest.mark.parametrize("path, fields, name", BAD_FIELDS)
def test_a_bad_field_is_named_and_the_server_keeps_serving(
    server, plain, path, fields, name
):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    status, reply = post_json(server[1], path, {**base, "max_tokens": 4, **fields})
    assert status == 400, reply
    message = reply["error"]["message"]
    assert name in message and len(message.splitlines()) == 1, message
    want = reference(plain, plain[1].encode(PROMPT), 8)[0]
    assert complete(server, prompt=PROMPT, max_tokens=8)["choices"][0]["text"] == want
