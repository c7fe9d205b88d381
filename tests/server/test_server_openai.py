"""The OpenAI-shaped responses: the chunks streamed for the events a pass
hands over together."""

from types import SimpleNamespace

from mlx_spec.server.events import (
    Finished,
    GenerationParams,
    Segment,
    Started,
    Token,
    ToolCall,
)
from mlx_spec.server.openai import OpenAIResponse


def _response(chat=True):
    params = GenerationParams(max_tokens=8, logprobs=True)
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    return OpenAIResponse(chat, "m", params, tokenizer)


def _tok(t):
    return Token(t, -0.5, [])


def _streamed(chunk):
    choice = chunk["choices"][0]
    logprobs = [e["token"] for e in choice["logprobs"]["content"]]
    return choice["delta"], logprobs, choice["finish_reason"]


def test_a_passs_text_goes_out_as_one_chunk_with_its_tokens_logprobs():
    """Consecutive text of one kind in a pass's events is one chunk carrying
    the logprobs of its tokens; a tool call, a change of kind or the finish
    starts a new one, and each chunk has the logprobs of the tokens up to
    its text (a token whose text is held back goes with the next)."""
    r = _response()
    assert [_streamed(c)[0] for c in r.stream([Started(5, 0)])] == [
        {"role": "assistant", "content": ""}
    ]
    pass_one = [_tok(1), Segment("content", "a"), _tok(2), Segment("content", "b")]
    assert [_streamed(c) for c in r.stream(pass_one)] == [
        ({"content": "ab"}, ["<1>", "<2>"], None)
    ]
    pass_two = [_tok(3), Segment("reasoning", "r"), _tok(4), Segment("content", "c")]
    pass_two += [_tok(5), ToolCall("f", {"x": 1}), _tok(6)]  # 6: held back
    chunks = [_streamed(c) for c in r.stream(pass_two)]
    assert [(d, lp) for d, lp, _ in chunks[:2]] == [
        ({"reasoning": "r"}, ["<3>"]),
        ({"content": "c"}, ["<4>"]),
    ]
    assert chunks[2][0]["tool_calls"][0]["function"]["name"] == "f"
    assert chunks[2][1] == ["<5>"] and len(chunks) == 3
    end = r.stream([_tok(7), Segment("content", "d"), Finished("stop", 7, {})])
    assert [_streamed(c) for c in end] == [
        ({"content": "d"}, ["<6>", "<7>"], None),
        ({}, [], "stop"),
    ]
    assert r.content == "abcd" and r.reasoning == "r" and len(r.tokens) == 0


def test_completions_stream_text_only():
    r = _response(chat=False)
    assert r.stream([Started(5, 0)]) == []
    events = [_tok(1), Segment("content", "a"), _tok(2), Segment("content", "b")]
    (chunk,) = r.stream(events + [Finished("length", 2, {})])[:1]
    assert chunk["choices"][0]["text"] == "ab"
    assert chunk["choices"][0]["logprobs"]["tokens"] == ["<1>", "<2>"]
