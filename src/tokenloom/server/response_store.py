"""The Responses API's store: the latest responses, each with the whole conversation it ended (its input items, the
earlier responses' it continued, and its own output as items), so that ``previous_response_id`` continues it and
``GET /v1/responses/{id}`` reads it back, as OpenAI's ``store`` does.

Bounded: the entries' bytes (their JSON's, and an estimate of their objects') stay under the store's budget
(``--responses-store-bytes``), the least recently used going first; an entry is its tenant's alone (another
tenant's id reads as not found). In memory, per server: under ``--ray`` each replica keeps its own, and the
prefix router sends a continuation to the replica named in the id (replicas/routing.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenloom.server.responses_api_protocol import ConversationItem

# What an entry's Python objects hold beyond their JSON's bytes (dicts, models, small strings): with these a full
# store's tracemalloc'd memory measured 0.84-0.87x of its count, short entries or long (RESULTS.md).
ENTRY_OVERHEAD = 3072
ITEM_OVERHEAD = 512


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    conversation: list[ConversationItem]  # input items, the earliest first, then the response's output as input items
    body: dict[str, Any]  # the response object as it was sent
    size: int  # the JSON bytes of both and their objects' overhead: what the budget counts


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, "a store keeps something"
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, tenant: str, conversation: list[ConversationItem], body: dict[str, Any]) -> bool:
        """Keeps a response, making room by dropping the least recently used; False if it alone is over budget."""
        size = (ENTRY_OVERHEAD + len(json.dumps(body))
                + sum(ITEM_OVERHEAD + len(item.model_dump_json()) for item in conversation))  # fmt: skip
        if size > self.max_bytes:
            return False
        self._drop(response_id)
        while self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = StoredResponse(tenant, conversation, body, size)
        self.bytes += size
        return True

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, tenant: str) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._drop(response_id)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        assert self.bytes >= 0, "the store's bytes are its entries' sizes"
