"""``mlx_spec server`` driven by the official ``openai`` and ``anthropic``
SDKs, with drafts accepted: plain and streamed text.

A server process on 127.0.0.1 serves the predictive checkpoint of
test_server_accepted.py (long greedy text, most drafts accepted; no chat
template). Every reply is compared with mlx-lm's greedy decoding of the same
prompt, every response reports accepted drafts, and every streamed event must
be one the SDK knows (its own class, strictly valid), with no warning from the
SDK. Tool round trips: test_server_sdk_tools.py.
"""

import threading

import mlx_lm
import pytest

from mlx_spec.mlx_lm_compat import server_message_helpers
from mlx_spec.testing.mtp_heads import write_predictive_checkpoint
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

N = 40
SYSTEM = "You write Python."
USER = "def fibonacci(n):"


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


def plain_chat_tokens(plain, messages):
    """The prompt of a tokenizer without a chat template (mlx_lm.server's)."""
    convert_chat, _ = server_message_helpers()
    return plain[1].encode(convert_chat(messages))


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
    want = greedy_reply(plain, prompt)[0]
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
    want = greedy_reply(
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
        assert replies[i].output_text == greedy_reply(plain, prompt)[0], text
        assert_accepted(replies[i].model_extra["speculation"])
    assert replies[3].choices[0].message.content.startswith(replies[0].output_text)


# -- anthropic SDK: /v1/messages ----------------------------------------------


def test_anthropic_sdk_message_equals_mlx_lm(pred):
    port, plain = pred
    want = greedy_reply(
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
    want = greedy_reply(
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
    want = greedy_reply(
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
