"""A base for eviction policies that order evictable blocks by a key (smallest key is evicted first)."""

from __future__ import annotations

import heapq
from typing import Any

from core.kv_cache import Block


class KeyedEviction:
    """Implements the EvictionPolicy Protocol with a lazy-deletion heap; subclasses define ``key``.

    The key is taken when a block becomes evictable and stays fixed while it is evictable (a hit takes the
    block out of the evictable set), so a heap is exact. Ties go to the block that became evictable first.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, int]] = []
        self._entry: dict[int, int] = {}  # evictable block id -> sequence number of its live heap entry
        self._seq = 0

    def key(self, block: Block, now: float) -> Any:
        raise NotImplementedError

    def on_cached(self, block: Block, now: float) -> None:
        pass

    def on_hit(self, block: Block, now: float) -> None:
        self._entry.pop(block.id, None)

    def on_free(self, block: Block, now: float) -> None:
        self._seq += 1
        self._entry[block.id] = self._seq
        heapq.heappush(self._heap, (self.key(block, now), self._seq, block.id))
        if len(self._heap) > 2 * len(self._entry) + 64:  # drop dead entries left by hits (bounded memory)
            self._heap = [e for e in self._heap if self._entry.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def victim(self) -> int:
        while self._heap:
            _, seq, bid = heapq.heappop(self._heap)
            if self._entry.get(bid) == seq:
                del self._entry[bid]
                return bid
        raise LookupError("no evictable block")

    def __len__(self) -> int:
        return len(self._entry)
