"""The official ``openai`` and ``anthropic`` SDKs as a test's clients of a
server on 127.0.0.1, and checks that they understood every event.

An SDK builds its objects without validating them, and one that meets an
event type it does not know builds some other event class (the first of its
union) rather than failing. So a client that "worked" proves little; the
checks here prove more: each streamed event is an instance of the SDK's class
for its ``type``, and every object validates strictly against the SDK's own
pydantic model (a missing required field, a wrong literal fails). Warnings
and log records an SDK emits while parsing are collected so a test can
require that there were none. What a reply must equal: mlx-lm's greedy
decoding of the same prompt, with drafts accepted. Needs the test extras (``pip install -e
".[test]"``).
"""

import contextlib
import logging
import typing
import warnings
from typing import Dict, Iterator, List

from ..mlx_lm_compat import make_logits_processors, plain_stream_generate

TIMEOUT = 120.0


def openai_client(port: int):
    """An ``openai.OpenAI`` client of the server on ``port`` (no retries: a
    failure shows at once)."""
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
    )


def anthropic_client(port: int):
    """An ``anthropic.Anthropic`` client of the server on ``port``."""
    import anthropic

    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}",
        api_key="unused",
        max_retries=0,
        timeout=TIMEOUT,
    )


def _classes_by_type(union) -> Dict[str, type]:
    """``type`` literal -> class, for an SDK's (annotated) union of models."""
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    out = {}
    for cls in typing.get_args(union):
        (literal,) = typing.get_args(cls.model_fields["type"].annotation)
        out[literal] = cls
    return out


def openai_response_event_classes() -> Dict[str, type]:
    """The Responses API's stream events the ``openai`` SDK knows."""
    from openai.types.responses import ResponseStreamEvent

    return _classes_by_type(ResponseStreamEvent)


def anthropic_stream_event_classes() -> Dict[str, type]:
    """The Messages API's stream events the ``anthropic`` SDK knows."""
    from anthropic.types import RawMessageStreamEvent

    return _classes_by_type(RawMessageStreamEvent)


def validated(obj):
    """``obj`` (an SDK model) validated strictly by its own class: the
    required fields present, every literal and type right. Returns the
    validated copy."""
    return type(obj).model_validate(obj.to_dict())


def check_typed_events(events: List, classes: Dict[str, type]):
    """Every event is an instance of the class the SDK has for its ``type``
    and validates strictly; an AssertionError naming the first that is not."""
    for i, event in enumerate(events):
        cls = classes.get(event.type)
        assert cls is not None, f"event {i}: the SDK has no class for {event.type!r}"
        assert isinstance(event, cls), f"event {i} ({event.type}) parsed as {event!r}"
        validated(event)


@contextlib.contextmanager
def client_warnings() -> Iterator[List[str]]:
    """Collects the warnings and the log records (WARNING and above) raised
    while the block runs; the list is filled when the block ends."""
    found: List[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            found.append(f"{record.name}: {record.getMessage()}")

    handler, root = Collect(logging.WARNING), logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
        found.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        root.removeHandler(handler)


def greedy_reply(plain, prompt, max_tokens: int = 40, bias=None):
    """mlx-lm's greedy ``(text, tokens)`` for ``prompt`` (token ids) on
    ``plain`` (a model and its tokenizer), with ``bias`` as a logit bias."""
    model, tok = plain
    processors = make_logits_processors(logit_bias=bias) if bias else None
    text, tokens = "", []
    for r in plain_stream_generate(
        model, tok, prompt, max_tokens=max_tokens, logits_processors=processors
    ):
        text += r.text
        tokens.append(r.token)
    return text, tokens


def assert_accepted(speculation):
    """A reply's speculation counters show drafts accepted."""
    assert 0 < speculation["accepted"] <= speculation["drafted"], speculation
