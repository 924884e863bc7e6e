"""Least recently used: evict the block whose last use is oldest."""

from core.eviction import KeyedEviction
from core.kv_cache import Block


class LRUEviction(KeyedEviction):
    def key(self, block: Block, now: float) -> float:
        return now  # the moment it became evictable = its last use
