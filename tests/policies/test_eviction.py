"""Eviction policies on hand-built caches: which block goes when one must."""

import pytest

from core.kv_cache import Block, KVCacheManager
from core.metrics import prefix_work
from core.prompt import block_hashes
from core.request import Request, RequestState
from policies.eviction.cost_aware import CostAwareEviction
from policies.eviction.fifo import FIFOEviction
from policies.eviction.lfu import LFUEviction
from policies.eviction.lru import LRUEviction

BS = 4


def prompt(tag: int, n_blocks: int) -> Request:
    """A prompt of n_blocks full blocks plus one token (so a repeat reuses all n_blocks)."""
    n = n_blocks * BS + 1
    return Request(f"{tag}-{id(object())}", 0.0, n, 1, prompt_token_ids=tuple(range(tag * 100, tag * 100 + n)))


def run(kv: KVCacheManager, req: Request, now: float) -> None:
    """Admit, compute and free a request: its full blocks end up cached and evictable."""
    state = RequestState(req, block_hashes=block_hashes(req, BS))
    assert kv.admit(state, state.num_tokens - kv.lookup(state), now)
    state.num_computed_tokens = state.num_tokens
    kv.register_computed(state, now)
    kv.free(state, now)


def cached_blocks(kv: KVCacheManager, tag: int, n_blocks: int) -> int:
    req = prompt(tag, n_blocks)
    return kv.lookup(RequestState(req, block_hashes=block_hashes(req, BS))) // BS


def force_evictions(kv: KVCacheManager, n: int, now: float) -> None:
    """Take n blocks for a private request that is never freed."""
    req = Request(f"filler-{now}", now, n * BS, 1)
    assert kv.admit(RequestState(req, block_hashes=block_hashes(req, BS)), n * BS, now)


def hot_and_cold(policy) -> KVCacheManager:
    """Pool of 3 blocks (a 5-token prompt takes a full block and a partial one): 'hot' (tag 1) cached at t=1
    and reused twice by t=3; 'cold' (tag 2) cached at t=4."""
    kv = KVCacheManager(3, BS, policy)
    for t in (1.0, 2.0, 3.0):
        run(kv, prompt(1, 1), t)
    run(kv, prompt(2, 1), 4.0)
    return kv


def test_lfu_keeps_the_hot_block_that_lru_evicts():
    lfu, lru = hot_and_cold(LFUEviction()), hot_and_cold(LRUEviction())
    for kv in (lfu, lru):
        force_evictions(kv, 2, 5.0)  # 1 free block + 1 eviction
        kv.check_invariants()
    assert (cached_blocks(lfu, 1, 1), cached_blocks(lfu, 2, 1)) == (1, 0)
    assert (cached_blocks(lru, 1, 1), cached_blocks(lru, 2, 1)) == (0, 1)


def test_lfu_breaks_ties_by_least_recent_use():
    kv = KVCacheManager(3, BS, LFUEviction())
    run(kv, prompt(1, 1), 1.0)
    run(kv, prompt(2, 1), 2.0)
    force_evictions(kv, 2, 3.0)  # 1 free block + 1 eviction
    assert (cached_blocks(kv, 1, 1), cached_blocks(kv, 2, 1)) == (0, 1)


def test_fifo_evicts_by_insertion_even_when_recently_used():
    def build(policy):
        kv = KVCacheManager(3, BS, policy)
        run(kv, prompt(1, 1), 1.0)  # first in
        run(kv, prompt(2, 1), 2.0)
        run(kv, prompt(1, 1), 3.0)  # first in is also the most recently used
        force_evictions(kv, 2, 4.0)  # 1 free block + 1 eviction
        kv.check_invariants()
        return kv
    fifo, lru = build(FIFOEviction()), build(LRUEviction())
    assert (cached_blocks(fifo, 1, 1), cached_blocks(fifo, 2, 1)) == (0, 1)
    assert (cached_blocks(lru, 1, 1), cached_blocks(lru, 2, 1)) == (1, 0)


def test_cost_aware_key_by_hand():
    pol = CostAwareEviction(a=1.0, b=1.0)
    # C(n) = n + n(n+1)/2: block 0 = C(4) - C(0) = 14, block 2 = C(12) - C(8) = 90 - 44 = 46
    assert prefix_work(12, 1.0, 1.0) - prefix_work(8, 1.0, 1.0) == 46
    pol.on_free(Block(0, depth=0, num_hits=3, size=4), 1.0)  # (3 + 1) * 14 = 56
    pol.on_free(Block(1, depth=2, num_hits=0, size=4), 2.0)  # 46
    pol.on_free(Block(2, depth=0, num_hits=0, size=4), 3.0)  # 14
    assert [pol.victim(), pol.clock] == [2, 14]
    pol.on_free(Block(3, depth=0, num_hits=0, size=4), 4.0)  # aged: clock 14 + 14 = 28
    assert [pol.victim(), pol.clock] == [3, 28]
    assert [pol.victim(), pol.clock] == [1, 46]
    pol.on_free(Block(4, depth=1, num_hits=0, size=4), 5.0)  # 46 + (C(8) - C(4)) = 46 + 30 = 76 > 56
    assert [pol.victim(), pol.victim()] == [0, 4] and len(pol) == 0
    with pytest.raises(LookupError):
        pol.victim()


def test_cost_aware_keeps_the_expensive_block_that_lru_evicts():
    def build(policy):
        kv = KVCacheManager(5, BS, policy)
        run(kv, prompt(1, 3), 1.0)  # a 3-block chain: its tail (depth 2) attends to 8 cached tokens
        run(kv, prompt(2, 1), 2.0)  # one shallow block, used more recently
        force_evictions(kv, 2, 3.0)  # 1 free block + 1 eviction
        kv.check_invariants()
        return kv
    cost, lru = build(CostAwareEviction(a=1.0, b=1.0)), build(LRUEviction())
    assert (cached_blocks(cost, 1, 3), cached_blocks(cost, 2, 1)) == (3, 0)
    assert (cached_blocks(lru, 1, 3), cached_blocks(lru, 2, 1)) == (2, 1)  # LRU takes the chain's tail


def test_cost_aware_shrinks_a_chain_from_its_tail():
    # the root is the cheapest block by its own work, but evicting it would orphan the other two
    kv = KVCacheManager(4, BS, CostAwareEviction(a=1.0, b=1.0))
    run(kv, prompt(1, 3), 1.0)
    for kept in (2, 1, 0):
        force_evictions(kv, 1 if kept < 2 else 2, 2.0 + kept)
        assert cached_blocks(kv, 1, 3) == kept
    kv.check_invariants()


def test_cost_aware_weights_hits():
    # a shallow block reused 3 times (4 x 14 = 56) outlives a deep unused one (46): hits outweigh depth
    def build():
        kv = KVCacheManager(5, BS, CostAwareEviction(a=1.0, b=1.0))
        for t in (1.0, 2.0, 3.0, 4.0):
            run(kv, prompt(2, 1), t)
        run(kv, prompt(1, 3), 5.0)
        force_evictions(kv, 2, 6.0)
        return kv
    kv = build()
    assert (cached_blocks(kv, 2, 1), cached_blocks(kv, 1, 3)) == (1, 2)


def test_cost_aware_rejects_bad_coefficients():
    with pytest.raises(ValueError, match="eviction.a"):
        CostAwareEviction(a=-1.0)


@pytest.mark.parametrize("keys", [[1, 1, 2, 3, 5, 8, 8, 9, 12, 20], [1, 2, 3, 4, 0.5, 6, 0, 7, 7, 1]])
def test_sorted_queue_evicts_in_heap_order(keys):
    """KeyedEviction's FIFO queue (keys non-decreasing, as LRU's clock) and the heap it turns into at the first
    smaller key evict by (key, order of becoming evictable), hits taking blocks out, as the definition says."""
    policy, victims = LRUEviction(), []  # LRU's key is the ``now`` it is given
    evictable, ref = {}, []  # the definition: block id -> (key, sequence), and its victims
    for i, k in enumerate(keys):  # block i becomes evictable with key k; every third step hits the one before
        policy.on_free(Block(i, size=BS), k)
        evictable[i] = (k, i)
        if i % 3 == 2:
            policy.on_hit(Block(i - 1, size=BS), k)
            evictable.pop(i - 1)
        if i % 4 == 3:
            victims.append(policy.victim())
            ref.append(min(evictable, key=evictable.get))
            evictable.pop(ref[-1])
    victims += [policy.victim() for _ in range(len(policy))]
    assert victims == ref + sorted(evictable, key=evictable.get) and len(policy) == 0
