"""The Anthropic-shaped stream: the events streamed for those a pass hands
over together."""

from mlx_spec.server.anthropic import MessageResponse
from mlx_spec.server.events import Finished, Segment, Started, Token, ToolCall


def _tok(t):
    return Token(t, None, [])


def _deltas(stream):
    return [
        (data["index"], data["delta"])
        for name, data in stream
        if name == "content_block_delta"
    ]


def test_a_passs_text_is_one_delta_per_block():
    """A pass's consecutive text in one block goes out as one delta; a new
    block (thinking to text, a tool call) starts its own, and the message
    holds the whole text."""
    r = MessageResponse("m")
    assert [name for name, _ in r.stream([Started(5, 0)])] == ["message_start"]
    one = [_tok(1), Segment("reasoning", "x"), _tok(2), Segment("reasoning", "y")]
    one += [_tok(3), Segment("content", "a"), _tok(4), Segment("content", "b")]
    stream = r.stream(one)
    assert _deltas(stream) == [
        (0, {"type": "thinking_delta", "thinking": "xy"}),
        (1, {"type": "text_delta", "text": "ab"}),
    ]
    assert [n for n, _ in stream].count("content_block_start") == 2
    two = [_tok(5), Segment("content", "c"), _tok(6), ToolCall("f", {"x": 1})]
    two += [Finished("tool_calls", 6, {})]
    stream = r.stream(two)
    assert _deltas(stream)[0] == (1, {"type": "text_delta", "text": "c"})
    assert _deltas(stream)[1][1]["type"] == "input_json_delta"
    assert [n for n, _ in stream][-2:] == ["message_delta", "message_stop"]
    assert [b.get("text") or b.get("thinking") for b in r.blocks[:2]] == ["xy", "abc"]
