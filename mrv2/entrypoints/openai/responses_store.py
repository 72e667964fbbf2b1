"""The responses `store: true` keeps, in this process's memory, for `GET /v1/responses/{id}` and
for `previous_response_id` to continue from (vLLM keeps them in memory too; nothing survives a
restart).

Bounded: at most `max_responses` responses and about `max_bytes` of them (their JSON size);
the least recently used go first. A response too big for the store alone is not kept.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    response: dict[str, Any]
    # The conversation so far as chat messages (the instructions aside, which a continuation
    # does not inherit): this response's input, then its output.
    conversation: list[dict[str, Any]]
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES,
                 max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keeps a copy of `response` under its id (evicting the least recently used as
        needed); False when it alone is over the byte bound."""
        text = json.dumps(response)
        size = len(text) + len(json.dumps(conversation))
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than the response store (%d "
                           "bytes): not stored", response["id"], size, self.max_bytes)
            return False
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(json.loads(text), conversation, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size
