"""Least frequently used: evict the block with the fewest prefix-cache hits, the least recently used first."""

from core.eviction import KeyedEviction
from core.kv_cache import Block


class LFUEviction(KeyedEviction):
    def key(self, block: Block, now: float) -> tuple[int, float]:
        return block.num_hits, now  # hits since cached; `now` = when it became evictable (its last use)
