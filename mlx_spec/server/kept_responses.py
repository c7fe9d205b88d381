"""Responses kept for ``previous_response_id`` (``POST /v1/responses``).

A response stored (``store`` true, the API's default) keeps the conversation
it ended: the chat messages of its input, of the responses it continued, and
its own reply, without its ``instructions`` (the API does not carry those
over). A request naming it continues that conversation; its prompt then
begins with the tokens of the earlier one, so the kept decoding states
(:mod:`.state_cache`) serve it as they serve a client that resends the whole
conversation. Only text is kept here, never a decoding state.

Bounded by count and by the characters of the conversations kept (each
counted whole, though consecutive turns share their messages), least
recently used first.
"""

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

MAX_KEPT_RESPONSES = 512
MAX_KEPT_CHARS = 64 << 20


@dataclass(frozen=True)
class KeptConversation:
    """A conversation as chat messages (never changed once kept: a request
    continuing it builds a new list) and the function calls made in it."""

    messages: Tuple[dict, ...]
    call_ids: frozenset
    chars: int  # its size in JSON characters, for the bound

    @staticmethod
    def empty() -> "KeptConversation":
        return KeptConversation((), frozenset(), 0)

    def extended(self, messages, call_ids) -> "KeptConversation":
        chars = self.chars + sum(len(json.dumps(m)) for m in messages)
        return KeptConversation(
            self.messages + tuple(messages), self.call_ids | frozenset(call_ids), chars
        )


class KeptResponses:
    """The stored responses' conversations by response id (any thread)."""

    def __init__(self, max_count: int = MAX_KEPT_RESPONSES, max_chars=MAX_KEPT_CHARS):
        self.max_count, self.max_chars = max_count, max_chars
        self._lock = threading.Lock()
        self._kept: "OrderedDict[str, KeptConversation]" = OrderedDict()
        self._chars = 0

    def get(self, response_id: str) -> Optional[KeptConversation]:
        with self._lock:
            conversation = self._kept.get(response_id)
            if conversation is not None:
                self._kept.move_to_end(response_id)
            return conversation

    def put(self, response_id: str, conversation: KeptConversation):
        """Keep ``conversation`` under ``response_id``; one larger than the
        whole bound is not kept."""
        if conversation.chars > self.max_chars:
            return
        with self._lock:
            self._kept[response_id] = conversation
            self._chars += conversation.chars
            while len(self._kept) > self.max_count or self._chars > self.max_chars:
                _, old = self._kept.popitem(last=False)
                self._chars -= old.chars

    def __len__(self) -> int:
        return len(self._kept)
