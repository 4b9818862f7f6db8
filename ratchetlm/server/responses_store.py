"""The stored responses behind ``previous_response_id`` and ``GET /v1/responses/{id}``: a bounded
in-memory LRU (``--responses-store-size`` entries; the least recently used goes first). Nothing
survives a restart; a response created with ``store: false`` is never kept."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as the client received it
    # the conversation through this response, as chat messages (its instructions left out: a
    # follow-up's own instructions replace them, as OpenAI does)
    history: list[dict[str, Any]]


class ResponseStore:
    """Thread-safe (requests are prepared on a worker thread, finished on the event loop)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, item: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._items[rid] = item
            self._items.move_to_end(rid)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(rid)
            if item is not None:
                self._items.move_to_end(rid)
            return item

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
