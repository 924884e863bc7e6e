"""A base for eviction policies that order evictable blocks by a key (smallest key is evicted first)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from core.kv_cache import Block


class KeyedEviction:
    """Implements the EvictionPolicy Protocol with a lazy-deletion heap; subclasses define ``key``.

    The key is taken when a block becomes evictable and stays fixed while it is evictable (a hit takes the
    block out of the evictable set), so a heap is exact. Ties go to the block that became evictable first.
    While keys come in non-decreasing order (LRU's key is the clock) the entries are kept in a FIFO queue instead:
    it is then sorted by (key, sequence number), the heap's own order, and its head pops in O(1) where a heap pop
    takes O(log n) tuple comparisons; the first smaller key turns it into the heap (a sorted list is one).
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[Any, int, int]] | list[tuple[Any, int, int]] = deque()
        self._sorted = True  # _queue is a sorted deque (else a heap list)
        self._entry: dict[int, int] = {}  # evictable block id -> sequence number of its live queue entry
        self._seq = 0

    def key(self, block: Block, now: float) -> Any:
        raise NotImplementedError

    def on_cached(self, block: Block, now: float) -> None:
        pass

    def on_hit(self, block: Block, now: float) -> None:
        entries = self._entry
        # an evictable block's queue entry is dead now; hits are the only source of dead entries, so this is where
        # they are dropped once they outnumber the live ones (bounded memory; the order of victims is unchanged)
        if entries.pop(block.id, None) is not None and len(self._queue) > 2 * len(entries) + 64:
            live = [e for e in self._queue if entries.get(e[2]) == e[1]]
            if self._sorted:
                self._queue = deque(live)
            else:
                heapq.heapify(live)
                self._queue = live

    def on_free(self, block: Block, now: float) -> None:
        seq = self._seq = self._seq + 1
        entries, queue = self._entry, self._queue  # locals: this runs for every cached block a request frees
        entries[block.id] = seq
        entry = (self.key(block, now), seq, block.id)
        if not self._sorted:
            heapq.heappush(queue, entry)
        elif queue and entry[0] < queue[-1][0]:
            self._queue = queue = list(queue)
            self._sorted = False
            heapq.heappush(queue, entry)
        else:
            queue.append(entry)

    def victim(self) -> int:
        queue, entry = self._queue, self._entry
        while queue:
            _, seq, bid = queue.popleft() if self._sorted else heapq.heappop(queue)
            if entry.get(bid) == seq:
                del entry[bid]
                return bid
        raise LookupError("no evictable block")

    def __len__(self) -> int:
        return len(self._entry)
