"""Cost-aware eviction: keep the blocks whose loss would cost the most prefill work (GreedyDual-style)."""

from __future__ import annotations

from core.checks import check_float
from core.eviction import KeyedEviction
from core.kv_cache import Block
from core.metrics import prefix_work


class CostAwareEviction(KeyedEviction):
    """Key (smallest evicted first) of a block at depth ``d`` with ``h`` hits, taken when it becomes evictable:

        key = clock + (h + 1) * (C((d + 1) * bs) - C(d * bs)),   C(n) = a*n + b*n*(n+1)/2

    The second term is the prefill work a future hit on the block saves (its tokens attend to the whole
    prefix before it, so deep blocks cost more), weighted by how often it was reused. ``clock`` is the key
    of the last evicted block (GreedyDual-Size-Frequency aging): a block that stays unused sees newly freed
    blocks enter above it, so its value ages by recency without any time constant.

    Chain rule: a block is only reachable through its ancestors, so evicting a parent before its child
    orphans the child. A block freed right after its own child (KVCacheManager.free releases a table tail
    first) therefore takes ``max(own key, child's key)``; ties go to the child, so chains shrink from the tail.
    """

    def __init__(self, a: float = 1.0, b: float = 4e-5) -> None:
        check_float(a, "eviction.a", 0.0), check_float(b, "eviction.b", 0.0)
        if a + b <= 0:
            raise ValueError(f"eviction.a and eviction.b must not both be 0, got a={a}, b={b}")
        super().__init__()
        self.a, self.b = a, b
        self.clock = 0.0
        self._keys: dict[int, float] = {}
        self._work: dict[int, float] = {}  # depth -> block_work(depth)
        self._last: tuple[float, int, float] | None = None  # (now, depth, key) of the previous on_free

    def block_work(self, depth: int, bs: int) -> float:
        """C((d + 1) * bs) - C(d * bs): the block's tokens, each attending to everything before it (one pool has
        one block size, so the cache is keyed by depth)."""
        w = self._work.get(depth)
        if w is None:
            w = self._work[depth] = float(prefix_work((depth + 1) * bs, self.a, self.b)
                                          - prefix_work(depth * bs, self.a, self.b))
        return w

    def key(self, block: Block, now: float) -> float:
        k = self.clock + (block.num_hits + 1) * self.block_work(block.depth, block.size)
        if self._last is not None and self._last[:2] == (now, block.depth + 1):
            k = max(k, self._last[2])
        self._last = (now, block.depth, k)
        self._keys[block.id] = k
        return k

    def on_hit(self, block: Block, now: float) -> None:
        super().on_hit(block, now)
        self._keys.pop(block.id, None)

    def victim(self) -> int:
        bid = super().victim()
        self.clock = self._keys.pop(bid)
        return bid
