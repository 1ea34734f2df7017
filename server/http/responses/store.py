"""Stored /v1/responses objects, for ``previous_response_id`` and ``GET /v1/responses/{id}``.

A bounded in-memory LRU by count (default 1,024 responses): the least recently stored or read one goes
first. Each entry keeps the response object as sent and the conversation that produced it as Responses
input items (the request's history + its input + its output), so a follow-up request continues from them
with the same rendering as a client that resends the whole history: the prefix cache hits either way.
Histories of one conversation share their item objects (a new entry is the previous list plus new items),
so a long chain costs its new items, not quadratic copies. Thread-safe (one lock); not persisted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

__all__ = ["StoredResponse", "ResponseStore"]


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as returned to the client
    history: tuple  # input items (validated models) of the whole conversation, output included


class ResponseStore:
    def __init__(self, max_entries: int = 1024):
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        """The entry, or None when it was never stored (``store: false``) or has been evicted."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
