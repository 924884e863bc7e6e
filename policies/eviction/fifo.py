"""First in, first out: evict the block that entered the prefix cache earliest, however often it is used."""

from core.eviction import KeyedEviction
from core.kv_cache import Block


class FIFOEviction(KeyedEviction):
    def key(self, block: Block, now: float) -> float:
        return block.cached_s
