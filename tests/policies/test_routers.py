"""Routers on hand-built replica views, and cost-based routing on real replicas with a warm prefix cache."""

from collections import Counter

import pytest

from core.interfaces import ReplicaView
from core.kv_cache import KVCacheManager
from core.replica import Replica, SchedulerLimits
from core.request import Request
from policies.eviction.lru import LRUEviction
from policies.routers.cost_based import CostBasedRouter
from policies.routers.least_kv import LeastKVRouter
from policies.routers.least_outstanding import LeastOutstandingRouter
from policies.routers.power_of_two import PowerOfTwoRouter
from policies.routers.prefix_aware import PrefixAwareRouter
from policies.routers.random import RandomRouter
from policies.schedulers.sarathi import SarathiScheduler

REQ = Request("q", 0.0, 1024, 8)


def view(i, waiting=0, running=0, free=100, cached=0, prefill=0, decode=0) -> ReplicaView:
    return ReplicaView(index=i, num_waiting=waiting, num_running=running, num_free_blocks=free, num_blocks=100,
                       block_size=16, pending_tokens=lambda: (prefill, decode),
                       cached_prefix_len=lambda r, c=cached: c)


def test_least_outstanding_and_least_kv():
    views = [view(0, waiting=3, free=90), view(1, running=2, free=10), view(2, waiting=1, running=1, free=90)]
    assert LeastOutstandingRouter().route(REQ, views) == 1
    assert LeastKVRouter().route(REQ, views) == 2  # 90 free blocks on 0 and 2; 2 has fewer outstanding


def test_prefix_aware_respects_the_imbalance_guard():
    views = [view(0, waiting=10, cached=960), view(1), view(2, running=2, cached=320)]
    assert PrefixAwareRouter(max_imbalance=4).route(REQ, views) == 2  # 0 is 10 above the least loaded
    assert PrefixAwareRouter(max_imbalance=10).route(REQ, views) == 0
    assert PrefixAwareRouter(max_imbalance=0).route(REQ, views) == 1
    # equal prefixes: the less loaded replica
    tied = [view(0, running=3, cached=64), view(1, running=1, cached=64)]
    assert PrefixAwareRouter(max_imbalance=8).route(REQ, tied) == 1
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAwareRouter(max_imbalance=-1)


def test_cost_based_estimate_charges_the_suffix_its_attention_to_the_prefix():
    r = CostBasedRouter(prefill_s_per_token=0.0, prefill_s_per_pair=1.0, decode_s_per_token=0.0)
    req = Request("q", 0.0, 100, 1)
    # C(n) = n(n+1)/2: C(100) - C(90) = 5050 - 4095 = 955, not C(10) = 55
    assert r.estimate_s(req, view(0, cached=90)) == 955
    r = CostBasedRouter(prefill_s_per_token=2.0, prefill_s_per_pair=0.0, decode_s_per_token=3.0)
    assert r.estimate_s(req, view(0, cached=40, prefill=7, decode=5)) == 2 * 7 + 3 * 5 + 2 * (100 - 40)


def test_cost_based_picks_idle_uncached_over_a_long_queue_and_cached_over_a_short_one():
    r = CostBasedRouter(prefill_s_per_token=1e-4, prefill_s_per_pair=2e-9, decode_s_per_token=5e-4)
    # the hit saves C(1024) - (C(1024) - C(960)) = C(960) = 0.096 + 2e-9 * 960 * 961 / 2 = 0.0969 s
    assert r.route(REQ, [view(0, cached=960, prefill=900, decode=40), view(1)]) == 1  # queue 0.09 + 0.02 > 0.0969
    assert r.route(REQ, [view(0, cached=960, prefill=500, decode=40), view(1)]) == 0  # queue 0.05 + 0.02 < 0.0969
    with pytest.raises(ValueError, match="decode_s_per_token"):
        CostBasedRouter(decode_s_per_token=-1.0)


def test_cost_based_on_real_replicas():
    bs, shared = 16, tuple(range(1, 9))  # 8 content blocks of 16 tokens = 128 shared tokens
    reps = [Replica(i, SarathiScheduler(), KVCacheManager(64, bs, LRUEviction()), SchedulerLimits())
            for i in range(2)]
    warm = reps[0].add(Request("warm", 0.0, 129, 1, hash_ids=shared + (99,), tokens_per_hash_id=bs), 0.0)
    batch = reps[0].schedule(0.0)
    reps[0].apply(batch, [1], 0.01)  # warm finishes; its 8 full blocks stay cached on replica 0
    assert warm.finish_s == 0.01
    req = Request("q", 1.0, 129, 4, hash_ids=shared + (7,), tokens_per_hash_id=bs)
    assert reps[0].view().cached_prefix_len(req) == 128 and reps[1].view().cached_prefix_len(req) == 0
    r = CostBasedRouter(prefill_s_per_token=1e-3, prefill_s_per_pair=0.0, decode_s_per_token=1e-3)
    assert r.route(req, [x.view() for x in reps]) == 0  # the hit saves 0.128 s, nothing queued
    for i in range(4):  # queue 4 x (100 prefill + 10 decode) tokens = 0.44 s on replica 0
        reps[0].add(Request(f"w{i}", 1.0, 100, 10), 1.0)
    assert r.route(req, [x.view() for x in reps]) == 1


def test_power_of_two_never_picks_the_most_loaded_and_is_seeded():
    views = [view(i, running=i) for i in range(4)]
    router = PowerOfTwoRouter(seed=3)
    picks = [router.route(REQ, views) for _ in range(3000)]
    counts = Counter(picks)
    assert counts[3] == 0  # the most loaded replica loses every pair it is in
    # replica i wins the pairs with a more loaded partner: P = (3 - i) / 6
    for i in range(3):
        assert counts[i] / len(picks) == pytest.approx((3 - i) / 6, abs=0.03)
    again = PowerOfTwoRouter(seed=3)
    assert [again.route(REQ, views) for _ in range(3000)] == picks
    other = PowerOfTwoRouter(seed=4)
    assert [other.route(REQ, views) for _ in range(3000)] != picks
    assert PowerOfTwoRouter().route(REQ, views[:1]) == 0


def test_random_is_seeded_and_uniform():
    views = [view(i) for i in range(4)]
    a, b, c = RandomRouter(seed=7), RandomRouter(seed=7), RandomRouter(seed=8)
    pa = [a.route(REQ, views) for _ in range(4000)]
    assert pa == [b.route(REQ, views) for _ in range(4000)]
    assert pa != [c.route(REQ, views) for _ in range(4000)]
    assert all(n / 4000 == pytest.approx(0.25, abs=0.03) for n in Counter(pa).values()) and len(set(pa)) == 4
