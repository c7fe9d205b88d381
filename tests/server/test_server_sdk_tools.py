"""``mlx_spec server`` driven by the official ``openai`` and ``anthropic``
SDKs as agent clients drive it: tool round trips (the model calls a tool, the
test sends the result back, the model answers) on ``/v1/responses`` (with
``previous_response_id``), chat completions and ``/v1/messages``; bad
Responses input named; a response not stored cannot be continued.

A server process on 127.0.0.1 serves the agent checkpoint
(``mlx_spec/testing/agent_checkpoint.py``: a chat template with tools, think
tags, a tool call a logit bias steers it into). Every reply is compared with
mlx-lm's greedy decoding of the same prompt, every response reports accepted
drafts, and every streamed event must be one the SDK knows, with no warning
from the SDK.
"""

import json

import mlx_lm
import pytest

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
from mlx_spec.testing.sdk_clients import (
    anthropic_client,
    anthropic_stream_event_classes,
    assert_accepted,
    check_typed_events,
    client_warnings,
    greedy_reply,
    openai_client,
    openai_response_event_classes,
    validated,
)
from mlx_spec.testing.server import served_checkpoint

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


def template_tokens(plain, messages, tools=CHAT_TOOLS):
    return plain[1].apply_chat_template(
        messages, tools=tools, add_generation_prompt=True
    )


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
    text, tokens = greedy_reply(
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
    assert second.output_text == greedy_reply(plain, prompt)[0] == ANSWER_TEXT
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
