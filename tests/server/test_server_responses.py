"""The Responses API without a server: input items become the chat
conversation a chat completions client would send (the same prompt tokens),
engine events become output items and the typed event stream, and stored
responses stay within their bounds."""

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_spec.server.events import Finished, Segment, Started, Token, ToolCall
from mlx_spec.server.kept_responses import KeptConversation, KeptResponses
from mlx_spec.server.prompts import chat_prompt
from mlx_spec.server.requests import RequestError, ServerContext
from mlx_spec.server.response_output import ResponseOutput
from mlx_spec.server.responses import responses_request
from mlx_spec.testing.agent_checkpoint import TOOL, write_agent_checkpoint

DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
DEFAULTS["max_tokens"] = 64
CHAT_TOOLS = [{"type": "function", "function": TOOL}]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    path = write_agent_checkpoint(tmp_path_factory.mktemp("agent") / "agent")
    return ServerContext(load_tokenizer(path), "agent", DEFAULTS, 4096, 512)


def _request(ctx, kept=None, **body):
    return responses_request(body, ctx, kept or KeptResponses())


def test_input_items_render_as_the_chat_conversation(ctx):
    """Every kind of item, mapped to chat messages: the prompt is the one
    chat completions builds from those messages."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "x"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    call = lambda i, city: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'},
    }
    messages = [
        {"role": "system", "content": "Answer in English."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Look it up.",
            "tool_calls": [call("c1", "Paris"), call("c2", "Rome")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
        {"role": "user", "content": "Thanks"},
    ]
    r = _request(
        ctx,
        instructions="Answer in English.",
        input=items,
        tools=[{"type": "function", **TOOL}],
    )
    want = chat_prompt(messages, CHAT_TOOLS, ctx)[0]
    assert r.prompt == want
    assert r.params.tools == CHAT_TOOLS
    assert list(r.conversation.messages) == messages[1:]  # without instructions
    assert r.conversation.call_ids == {"c1", "c2"}


def test_a_string_input_is_one_user_message(ctx):
    r = _request(ctx, input="Hello")
    assert r.prompt == chat_prompt([{"role": "user", "content": "Hello"}], None, ctx)[0]
    assert r.params.tools is None and r.stream is False and r.store is True


def test_tool_choice_none_leaves_the_tools_out(ctx):
    tools = [{"type": "function", **TOOL}]
    r = _request(ctx, input="Hello", tools=tools, tool_choice="none")
    assert r.prompt == _request(ctx, input="Hello").prompt
    assert r.params.tools is None and r.echo["tools"][0]["name"] == TOOL["name"]
    assert len(_request(ctx, input="Hello", tools=tools).prompt) > len(r.prompt)


def test_previous_response_id_continues_the_kept_conversation(ctx):
    kept = KeptResponses()
    first = [{"role": "user", "content": "Weather?"}]
    reply = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}  # fmt: skip
    kept.put("resp_1", KeptConversation.empty().extended(first + [reply], ["c1"]))
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    r = _request(ctx, kept, previous_response_id="resp_1", input=[output])
    tool = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert r.prompt == chat_prompt(first + [reply, tool], None, ctx)[0]
    with pytest.raises(RequestError) as e:  # the call is not in a fresh conversation
        _request(ctx, kept, input=[output])
    assert e.value.param == "input" and "c1" in str(e.value)


def test_kept_responses_are_bounded_least_recently_used_first():
    kept = KeptResponses(max_count=2, max_chars=10_000)
    one = KeptConversation.empty().extended([{"role": "user", "content": "x"}], [])
    for name in ("a", "b"):
        kept.put(name, one)
    assert kept.get("a") is one  # now the most recently used
    kept.put("c", one)
    assert kept.get("b") is None and kept.get("a") is one and len(kept) == 2
    big = one.extended([{"role": "user", "content": "y" * 6_000}], [])
    kept.put("d", big)
    kept.put("e", big)  # two of them pass the characters' bound
    assert kept.get("d") is None and kept.get("e") is big
    huge = one.extended([{"role": "user", "content": "z" * 20_000}], [])
    kept.put("f", huge)  # larger than the whole bound: not kept
    assert kept.get("f") is None and kept.get("e") is big


def _output(ctx, **body):
    return ResponseOutput("agent", _request(ctx, input="Hi", **body))


def _tok():
    return Token(1, None, [])


def test_a_pass_streams_one_delta_per_item_and_numbers_every_event(ctx):
    """A pass's consecutive text of one item is one delta; a change of item
    closes the last (text done, part done, item done) and opens the next;
    every event validates against the SDK's class for its type."""
    from openai.types.responses import Response

    from mlx_spec.testing.sdk_clients import openai_response_event_classes

    classes = openai_response_event_classes()
    out = _output(ctx)
    events = out.stream([Started(10, 4)])
    one = [_tok(), Segment("reasoning", "a"), _tok(), Segment("reasoning", "b")]
    one += [_tok(), Segment("content", "c"), _tok(), Segment("content", "d")]
    events += out.stream(one)
    two = [_tok(), Segment("content", "e"), _tok(), ToolCall("f", {"x": 1})]
    events += out.stream(two + [_tok(), Finished("tool_calls", 9, {"accepted": 3})])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", None),
        ("response.content_part.added", None),
        ("response.reasoning_text.delta", "ab"),
        ("response.reasoning_text.done", None),
        ("response.content_part.done", None),
        ("response.output_item.done", None),
        ("response.output_item.added", None),
        ("response.content_part.added", None),
        ("response.output_text.delta", "cd"),
        ("response.output_text.delta", "e"),
        ("response.output_text.done", None),
        ("response.content_part.done", None),
        ("response.output_item.done", None),
        ("response.output_item.added", None),
        ("response.function_call_arguments.delta", '{"x": 1}'),
        ("response.function_call_arguments.done", None),
        ("response.output_item.done", None),
        ("response.completed", None),
    ]
    for event in events:
        classes[event["type"]].model_validate(event)
    assert events[8]["item"]["content"] == [] and events[8]["item"]["status"] == (
        "in_progress"
    )
    body = Response.model_validate(out.body())
    assert [o.type for o in body.output] == ["reasoning", "message", "function_call"]
    assert body.output_text == "cde" and body.status == "completed"
    assert body.usage.input_tokens == 10 and body.usage.output_tokens == 9
    assert body.usage.input_tokens_details.cached_tokens == 4
    assert body.usage.output_tokens_details.reasoning_tokens == 2
    assert out.body()["speculation"] == {"accepted": 3}
    reply = list(out.kept().messages)[-1]
    assert reply["content"] == "cde" and reply["reasoning_content"] == "ab"
    assert reply["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_a_length_stop_is_incomplete_and_a_cut_short_stream_failed(ctx):
    from openai.types.responses import Response

    out = _output(ctx)
    out.stream([Started(3, 0), _tok(), Segment("content", "a")])
    last = out.stream([_tok(), Finished("length", 2, {})])
    assert last[-1]["type"] == "response.incomplete"
    body = Response.model_validate(out.body())
    assert body.status == "incomplete" and body.output[0].status == "incomplete"
    assert body.incomplete_details.reason == "max_output_tokens"
    assert out.kept() is not None  # a stored incomplete response continues

    cut = _output(ctx)
    cut.stream([Started(3, 0), _tok(), Segment("content", "a")])
    last = cut.stream([Finished("cancelled", 1, {})])
    assert [e["type"] for e in last][-2:] == [
        "response.output_item.done",
        "response.failed",
    ]
    failed = Response.model_validate(last[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert cut.kept() is None

    broken = _output(ctx)
    broken.stream([Started(3, 0)])
    (event,) = broken.failed("generation failed: boom")
    assert event["type"] == "response.failed" and event["sequence_number"] == 2
    assert event["response"]["error"]["message"] == "generation failed: boom"


def test_a_response_not_stored_is_not_kept(ctx):
    out = _output(ctx, store=False)
    out.stream([Started(3, 0), _tok(), Segment("content", "a")])
    out.stream([Finished("stop", 1, {})])
    assert out.status() == "completed" and out.kept() is None
