"""``mlx_spec server`` driven by the official ``openai`` and ``anthropic``
SDKs, as agent clients drive it, with drafts accepted.

Two server processes on 127.0.0.1: the predictive checkpoint of
test_server_accepted.py (long greedy text, most drafts accepted; no chat
template) for plain and streamed text, and the agent checkpoint
(``mlx_spec/testing/agent_checkpoint.py``: a chat template with tools, think
tags, a tool call a logit bias steers it into) for tool round trips: the
model calls a tool, the test sends the result back, the model answers. Every
reply is compared with mlx-lm's greedy decoding of the same prompt, every
response reports accepted drafts, and every streamed event must be one the
SDK knows (its own class, strictly valid), with no warning from the SDK.
"""

import json
import threading

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors

from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.agent_checkpoint import (
    ANSWER_TEXT,
    CALL_BIAS,
    PLAN_TEXT,
    TOOL,
    TOOL_ARGUMENTS,
    TOOL_NAME,
    added_token_ids,
    write_agent_checkpoint,
)
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint
from mlx_spec.testing.sdk_clients import (
    anthropic_client,
    anthropic_stream_event_classes,
    check_typed_events,
    client_warnings,
    openai_client,
    openai_response_event_classes,
    validated,
)
from mlx_spec.testing.server import served_checkpoint

N = 40
SYSTEM = "You write Python."
USER = "def fibonacci(n):"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = "sunny, 22 C"
RESPONSE_TOOLS = [{"type": "function", **TOOL}]
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
ANTHROPIC_TOOLS = [
    {
        "name": TOOL["name"],
        "description": TOOL["description"],
        "input_schema": TOOL["parameters"],
    }
]
CALL_TEXT = json.dumps({"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS})


def _bias():
    return {added_token_ids()["<think>"]: CALL_BIAS}


STEER = {"logit_bias": {str(k): v for k, v in _bias().items()}}  # calls the tool


@pytest.fixture(scope="module")
def pred(tmp_path_factory):
    with served_checkpoint(
        tmp_path_factory,
        write_predictive_checkpoint,
        "pred",
        "qwen3_next",
        "--num-draft-tokens",
        "3",
    ) as (path, port):
        yield port, mlx_lm.load(str(path))


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    with served_checkpoint(
        tmp_path_factory,
        write_agent_checkpoint,
        "agent",
        "qwen3_next",
        "--num-draft-tokens",
        "3",
    ) as (path, port):
        yield port, mlx_lm.load(str(path))


def reference(plain, prompt, max_tokens=N, bias=None):
    """mlx-lm's greedy ``(text, tokens)`` for ``prompt`` (token ids)."""
    model, tok = plain
    processors = make_logits_processors(logit_bias=bias) if bias else None
    text, tokens = "", []
    for r in mlx_lm.stream_generate(
        model, tok, prompt, max_tokens=max_tokens, logits_processors=processors
    ):
        text += r.text
        tokens.append(r.token)
    return text, tokens


def plain_chat_tokens(plain, messages):
    """The prompt of a tokenizer without a chat template (mlx_lm.server's)."""
    convert_chat, _ = server_message_helpers()
    return plain[1].encode(convert_chat(messages))


def template_tokens(plain, messages, tools=CHAT_TOOLS):
    return plain[1].apply_chat_template(
        messages, tools=tools, add_generation_prompt=True
    )


def assert_accepted(speculation):
    assert 0 < speculation["accepted"] <= speculation["drafted"], speculation


def _stop_word(text):
    """A 3-character piece first occurring past ``text``'s first quarter."""
    for i in range(len(text) // 4, len(text) - 3):
        piece = text[i : i + 3]
        if "\ufffd" not in piece and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no stop word in {text!r}")


# -- openai SDK: /v1/responses -----------------------------------------------


def test_openai_sdk_response_equals_mlx_lm_and_chat(pred):
    port, plain = pred
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]
    prompt = plain_chat_tokens(plain, messages)
    want = reference(plain, prompt)[0]
    client = openai_client(port)
    with client_warnings() as warned:
        r = client.responses.create(
            model="pred", instructions=SYSTEM, input=USER, max_output_tokens=N
        )
        chat = client.chat.completions.create(
            model="pred", messages=messages, max_tokens=N
        )
    validated(r)
    assert r.output_text == want == chat.choices[0].message.content
    assert [o.type for o in r.output] == ["message"]
    assert r.status == "incomplete" and r.output[0].status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == N and r.usage.input_tokens == len(prompt)
    assert r.max_output_tokens == N and r.instructions == SYSTEM
    assert_accepted(r.model_extra["speculation"])
    assert not warned


def test_openai_sdk_streams_every_response_event_typed(pred):
    """The stream's events are the SDK's own classes, numbered without a
    gap (none dropped), in the documented order; their text is mlx-lm's."""
    port, plain = pred
    want = reference(
        plain, plain_chat_tokens(plain, [{"role": "user", "content": USER}])
    )
    client = openai_client(port)
    with client_warnings() as warned:
        events = list(
            client.responses.create(
                model="pred", input=USER, max_output_tokens=N, stream=True
            )
        )
    check_typed_events(events, openai_response_event_classes())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == want[0] == events[-4].text
    assert len(deltas) < N  # a pass's accepted tokens go out as one delta
    final = events[-1].response
    assert final.output_text == want[0] and final.usage.output_tokens == N
    assert_accepted(final.model_extra["speculation"])
    assert not warned


def test_concurrent_responses_share_passes_and_equal_mlx_lm(pred):
    """Three Responses requests and a chat request decoded together in
    batched passes: each gets its own mlx-lm text, with drafts accepted."""
    port, plain = pred
    client = openai_client(port)
    inputs = [USER, "hello", "class Stack:\n    def"]
    replies, errors = {}, []

    def ask(i):
        try:
            if i < len(inputs):
                replies[i] = client.responses.create(
                    model="pred", input=inputs[i], max_output_tokens=N
                )
            else:
                replies[i] = client.chat.completions.create(
                    model="pred", messages=[{"role": "user", "content": USER}]
                )
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(replies) == 4, errors
    for i, text in enumerate(inputs):
        prompt = plain_chat_tokens(plain, [{"role": "user", "content": text}])
        assert replies[i].output_text == reference(plain, prompt)[0], text
        assert_accepted(replies[i].model_extra["speculation"])
    assert replies[3].choices[0].message.content.startswith(replies[0].output_text)


def test_openai_sdk_tool_round_trip_on_responses(agent):
    """The model thinks and calls the tool; the output items go back with
    the call's result, as the SDK's function-calling guide does, and the
    model answers. Each turn is mlx-lm's, and chat completions answers the
    same conversation alike."""
    port, plain = agent
    client = openai_client(port)
    with client_warnings() as warned:
        first = client.responses.create(
            model="agent", input=QUESTION, tools=RESPONSE_TOOLS, extra_body=STEER
        )
    validated(first)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    reasoning, call = first.output
    assert reasoning.content[0].text == PLAN_TEXT
    assert call.name == TOOL_NAME and json.loads(call.arguments) == TOOL_ARGUMENTS
    assert first.status == "completed"
    text, tokens = reference(
        plain, template_tokens(plain, QUESTION), bias=_bias(), max_tokens=64
    )
    assert text == f"<think>{PLAN_TEXT}</think><tool_call>{CALL_TEXT}</tool_call>"
    assert first.usage.output_tokens == len(tokens)  # the EOS token included
    assert first.usage.output_tokens_details.reasoning_tokens == 4
    assert_accepted(first.model_extra["speculation"])

    result = {"type": "function_call_output", "call_id": call.call_id}
    with client_warnings() as warned_too:
        second = client.responses.create(
            model="agent",
            input=QUESTION + first.output + [{**result, "output": WEATHER}],
            tools=RESPONSE_TOOLS,
        )
    validated(second)
    conversation = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": PLAN_TEXT,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": WEATHER},
    ]
    messages = json.loads(json.dumps(conversation))
    messages[1]["tool_calls"][0]["function"]["arguments"] = TOOL_ARGUMENTS
    prompt = template_tokens(plain, messages)
    assert second.output_text == reference(plain, prompt)[0] == ANSWER_TEXT
    assert second.usage.input_tokens == len(prompt)
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first prompt
    assert_accepted(second.model_extra["speculation"])
    chat = client.chat.completions.create(
        model="agent", messages=conversation, tools=CHAT_TOOLS
    )
    assert chat.choices[0].message.content == ANSWER_TEXT
    assert chat.usage.prompt_tokens == len(prompt)
    assert not warned and not warned_too


def test_openai_sdk_streamed_tool_round_trip_with_previous_response_id(agent):
    """The SDK's stream helper (which checks every event against the
    snapshot it builds) gets the call, then the answer continuing the
    stored response by its id."""
    port, plain = agent
    client = openai_client(port)
    classes = openai_response_event_classes()
    with client_warnings() as warned:
        with client.responses.stream(
            model="agent", input=QUESTION, tools=RESPONSE_TOOLS, extra_body=STEER
        ) as stream:
            events = list(stream)
            first = stream.get_final_response()
        raw = [e for e in events if e.type in classes]  # the helper adds its own
        check_typed_events(raw, classes)
        call = first.output[1]
        kinds = [e.type for e in raw if "function_call" in e.type]
        assert kinds == [
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
        ]
        assert json.loads(call.arguments) == TOOL_ARGUMENTS
        with client.responses.stream(
            model="agent",
            previous_response_id=first.id,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": call.call_id,
                    "output": WEATHER,
                }
            ],
            tools=RESPONSE_TOOLS,
        ) as stream:
            text = "".join(
                e.delta for e in stream if e.type == "response.output_text.delta"
            )
            second = stream.get_final_response()
    assert text == second.output_text == ANSWER_TEXT
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert_accepted(second.model_extra["speculation"])
    assert not warned


def test_openai_sdk_streams_chat_tool_calls(agent):
    """Chat completions, streamed: reasoning, then the tool call in one
    delta, ``finish_reason`` tool_calls; the result sent back gets the
    answer."""
    port, plain = agent
    client = openai_client(port)
    with client_warnings() as warned:
        chunks = list(
            client.chat.completions.create(
                model="agent",
                messages=QUESTION,
                tools=CHAT_TOOLS,
                stream=True,
                extra_body=STEER,
            )
        )
    for chunk in chunks:
        validated(chunk)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning") or "" for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert reasoning == PLAN_TEXT and len(calls) == 1
    assert calls[0].function.name == TOOL_NAME
    assert json.loads(calls[0].function.arguments) == TOOL_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert_accepted(chunks[-1].model_extra["speculation"])
    answer = client.chat.completions.create(
        model="agent",
        messages=QUESTION
        + [
            {"role": "assistant", "content": "", "tool_calls": [calls[0].to_dict()]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": WEATHER},
        ],
        tools=CHAT_TOOLS,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    assert text == ANSWER_TEXT
    assert not warned


# -- anthropic SDK: /v1/messages ----------------------------------------------


def test_anthropic_sdk_message_equals_mlx_lm(pred):
    port, plain = pred
    want = reference(
        plain, plain_chat_tokens(plain, [{"role": "user", "content": USER}])
    )
    client = anthropic_client(port)
    with client_warnings() as warned:
        message = client.messages.create(
            model="pred", max_tokens=N, messages=[{"role": "user", "content": USER}]
        )
    validated(message)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == want[0]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == N
    assert_accepted(message.model_extra["speculation"])
    assert not warned


def test_anthropic_sdk_streams_every_event_typed(pred):
    port, plain = pred
    want = reference(
        plain, plain_chat_tokens(plain, [{"role": "user", "content": USER}])
    )
    client = anthropic_client(port)
    body = dict(
        model="pred", max_tokens=N, messages=[{"role": "user", "content": USER}]
    )
    with client_warnings() as warned:
        events = list(client.messages.create(**body, stream=True))
        with client.messages.stream(**body) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    check_typed_events(events, anthropic_stream_event_classes())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == text == final.content[0].text == want[0]
    assert final.stop_reason == "max_tokens"
    assert_accepted(events[-2].model_extra["speculation"])
    assert not warned


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_stop_sequences(pred, stream):
    port, plain = pred
    want = reference(
        plain, plain_chat_tokens(plain, [{"role": "user", "content": USER}])
    )
    stop, at = _stop_word(want[0])
    client = anthropic_client(port)
    body = dict(
        model="pred",
        max_tokens=N,
        messages=[{"role": "user", "content": USER}],
        stop_sequences=[stop],
    )
    with client_warnings() as warned:
        if stream:
            with client.messages.stream(**body) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**body)
    assert message.content[0].text == want[0][:at] and message.content[0].text
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert not warned


def test_anthropic_sdk_tool_round_trip(agent):
    """The model thinks and asks for the tool (``tool_use``); the
    ``tool_result`` goes back with the assistant's blocks, and the model
    answers: the same answer as on /v1/responses."""
    port, plain = agent
    client = anthropic_client(port)
    with client_warnings() as warned:
        first = client.messages.create(
            model="agent",
            max_tokens=64,
            messages=QUESTION,
            tools=ANTHROPIC_TOOLS,
            extra_body=STEER,
        )
        validated(first)
        assert [b.type for b in first.content] == ["thinking", "tool_use"]
        thinking, use = first.content
        assert thinking.thinking == PLAN_TEXT
        assert use.name == TOOL_NAME and use.input == TOOL_ARGUMENTS
        assert first.stop_reason == "tool_use"
        assert_accepted(first.model_extra["speculation"])
        result = {"type": "tool_result", "tool_use_id": use.id, "content": WEATHER}
        with client.messages.stream(
            model="agent",
            max_tokens=64,
            messages=QUESTION
            + [
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": [result]},
            ],
            tools=ANTHROPIC_TOOLS,
        ) as stream:
            events = list(stream)
            second = stream.get_final_message()
    check_typed_events(
        [e for e in events if e.type in anthropic_stream_event_classes()],
        anthropic_stream_event_classes(),
    )
    assert second.content[0].text == ANSWER_TEXT and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0
    assert not warned


# -- bad input on /v1/responses -------------------------------------------------

# (the fields that make the body bad, the param the error names, a text the
# message must hold)
BAD_RESPONSES = [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"type": "web_search_call"}]}, "input", "web_search_call"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
        "input",
        "call_id",
    ),
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].name"),
    ({"input": 7}, "input", "input"),
    ({"input": []}, "input", "input"),
    ({"input": [{"role": "user", "content": 5}]}, "input", "input[0].content"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        "input",
        "input_image",
    ),
    (
        {
            "input": [
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "[1]",
                }
            ]
        },
        "input",
        "input[0].arguments",
    ),
    ({"max_output_tokens": "many"}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"top_p": 2}, "top_p", "top_p"),
    ({"instructions": 5}, "instructions", "instructions"),
    ({"stream": "yes"}, "stream", "stream"),
    ({"store": "no"}, "store", "store"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
    ({"text": {"format": {"type": "json_schema"}}}, "text", "text.format"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include[0]"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "truncation"),
]


@pytest.mark.parametrize("fields, param, named", BAD_RESPONSES)
def test_bad_responses_input_is_named_and_the_server_keeps_serving(
    agent, fields, param, named
):
    from mlx_spec.testing.http_client import post_json

    port, plain = agent
    status, reply = post_json(port, "/v1/responses", {"input": "hi", **fields})
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert named in error["message"] and len(error["message"].splitlines()) == 1
    r = openai_client(port).responses.create(model="agent", input=QUESTION)
    assert r.output_text == ANSWER_TEXT


def test_a_response_not_stored_cannot_be_continued(agent):
    port, _ = agent
    client = openai_client(port)
    first = client.responses.create(model="agent", input=QUESTION, store=False)
    assert first.store is False and first.output_text == ANSWER_TEXT
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model="agent", input="and tomorrow?", previous_response_id=first.id
        )
    assert e.value.body["param"] == "previous_response_id"
    kept = client.responses.create(model="agent", input=QUESTION)
    again = client.responses.create(
        model="agent", input="and tomorrow?", previous_response_id=kept.id
    )
    assert again.status == "completed"
    assert again.usage.input_tokens_details.cached_tokens > 0
