"""A base for eviction policies that order evictable blocks by a key (smallest key is evicted first)."""

from __future__ import annotations

import heapq
from collections import deque
from functools import partial
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
        self._entry.pop(block.id, None)

    def on_free(self, block: Block, now: float) -> None:
        self._seq += 1
        self._entry[block.id] = self._seq
        entry, queue = (self.key(block, now), self._seq, block.id), self._queue
        if not self._sorted:
            heapq.heappush(queue, entry)
        elif queue and entry[0] < queue[-1][0]:
            self._queue = queue = list(queue)
            self._sorted = False
            heapq.heappush(queue, entry)
        else:
            queue.append(entry)
        if len(queue) > 2 * len(self._entry) + 64:  # drop dead entries left by hits (bounded memory)
            live = [e for e in queue if self._entry.get(e[2]) == e[1]]
            if self._sorted:
                self._queue = deque(live)
            else:
                heapq.heapify(live)
                self._queue = live

    def victim(self) -> int:
        queue, entry = self._queue, self._entry
        pop = queue.popleft if self._sorted else partial(heapq.heappop, queue)
        while queue:
            _, seq, bid = pop()
            if entry.get(bid) == seq:
                del entry[bid]
                return bid
        raise LookupError("no evictable block")

    def __len__(self) -> int:
        return len(self._entry)
