"""Host KV tier: swap preemption and prefix spill (core.host_tier), checked by replaying every step's block copies on
a model of the blocks' contents: whatever a step reads must be what was written there, in either tier."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.batch import Batch, BlockCopy, Chunk
from core.host_tier import HostTier, copy_seconds
from core.interfaces import BaseExecutor, StepOutput
from core.kv_cache import KVCacheManager
from core.links import Link
from core.loop import ServingLoop
from core.prompt import block_hashes
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, Status
from policies.eviction.lfu import LFUEviction
from policies.eviction.lru import LRUEviction
from policies.preemption.cost import CostPreemption
from policies.preemption.recompute import RecomputePreemption
from policies.preemption.swap import SwapPreemption
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from sim.clock import run_virtual
from sim.executor import CostModelExecutor
from tests.helpers import ListWorkload


def label(state: RequestState, i: int):
    """What block i of a request holds: its hash for a full prompt block (content + tenant salt), else the request's
    own block."""
    return state.block_hashes[i] if i < len(state.block_hashes) else (state.id, i)


class ContentExecutor(BaseExecutor):
    """Runs the step's copies on a map of block contents, then checks that each chunk's context holds its own
    tokens and writes its new ones (never into a shared block). Step time 10 ms + 1 us per copy."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.copies: list[BlockCopy] = []

    def execute(self, batch: Batch) -> StepOutput:
        kv, bs = self.kv, self.kv.block_size
        kv.check_invariants()
        for c in batch.copies:
            if c.to_host:
                assert c.device_block in self.device, f"{c}: copies a block nothing wrote"
                self.host[c.host_block] = self.device[c.device_block]
            else:
                assert c.host_block in self.host, f"{c}: copies a host block nothing wrote"
                self.device[c.device_block] = self.host[c.host_block]
        self.copies += batch.copies
        for ch in batch.chunks:
            state, table = ch.state, kv.block_table(ch.state.id)
            for i in range(-(-ch.start // bs)):
                assert self.device.get(table[i]) == label(state, i), f"{state.id} block {i} holds the wrong KV"
            for i in range(ch.start // bs, -(-ch.end // bs)):
                assert kv.blocks[table[i]].ref_count == 1, f"{state.id} writes shared block {table[i]}"
                self.device[table[i]] = label(state, i)
        return StepOutput([1] * sum(ch.samples for ch in batch.chunks), 0.01 + 1e-6 * len(batch.copies))


def run(requests, scheduler, policy, num_blocks, host_blocks, block_size=16, spill=True, host_eviction=LRUEviction,
        prefix_caching=True, **limits):
    host = HostTier(host_blocks, block_size, host_eviction(), spill) if host_blocks else None
    kv = KVCacheManager(num_blocks, block_size, LRUEviction(), prefix_caching, host)
    rep = Replica(0, scheduler(), kv, SchedulerLimits(**limits), preemption=policy)
    ex = ContentExecutor(kv)
    loop = ServingLoop([rep], [ex], RoundRobinRouter(), ListWorkload(requests))
    return run_virtual(loop), rep, ex


def state_of(req: Request, block_size: int = 4) -> RequestState:
    return RequestState(req, block_hashes=block_hashes(req, block_size))


def test_host_link_prices_each_direction_once_plus_bytes():
    link = Link(bandwidth_bytes_s=1e9, latency_s=1e-5)
    copies = [BlockCopy("swap_out", 0, 0), BlockCopy("spill", 1, 1), BlockCopy("load", 2, 3)]
    assert copy_seconds(copies, link, 2e6) == pytest.approx((1e-5 + 2 * 2e-3) + (1e-5 + 2e-3))
    assert copy_seconds([], link, 2e6) == 0.0


def test_sim_step_adds_copy_time_to_the_cost_model():
    class Flat:
        def step_time(self, f):
            return 0.5

    state = state_of(Request("a", 0.0, 8, 2, prompt_token_ids=tuple(range(8))))
    state.status = Status.RUNNING
    batch = Batch([Chunk.next(state, 8)], copies=(BlockCopy("swap_in", 0, 0),))
    ex = CostModelExecutor(Flat(), host_link=Link(1e9, 0.0), host_block_bytes=1e6)
    assert ex.execute(batch).duration_s == pytest.approx(0.5 + 1e-3)
    with pytest.raises(RuntimeError, match="no host link"):
        CostModelExecutor(Flat()).execute(batch)


def test_swap_out_keeps_computed_tokens_and_swap_in_copies_them_back():
    host = HostTier(8, 4, LRUEviction(), spill=False)
    kv = KVCacheManager(8, 4, LRUEviction(), host=host)
    s = state_of(Request("a", 0.0, 10, 4, prompt_token_ids=tuple(range(10))))
    assert kv.admit(s, 10, 0.0)
    s.num_computed_tokens = 10
    kv.register_computed(s, 0.0)  # blocks 0, 1 are full prompt blocks: published on the device
    table = list(kv.block_table("a"))
    assert kv.swap_out(s, 1.0)
    assert s.num_computed_tokens == 10 and kv.num_blocks_held("a") == 0 and kv.lookup(s) == 10
    out = host.take_copies()
    assert [(c.kind, c.device_block) for c in out] == [("swap_out", b) for b in table]
    kv.check_invariants()
    assert kv.admit(s, 1, 2.0)  # the two published blocks are still cached on the device: only the third comes back
    assert s.num_computed_tokens == 10 and kv.block_table("a")[:2] == table[:2]
    back = host.take_copies()
    assert [(c.kind, c.host_block) for c in back] == [("swap_in", out[2].host_block)]
    assert host.stats.swap_outs == host.stats.swap_ins == 1
    kv.free(s, 3.0)
    kv.check_invariants()
    assert host.num_free_blocks == 8


def test_swap_needs_host_room_and_ending_a_swapped_request_frees_its_host_blocks():
    host = HostTier(2, 4, LRUEviction())
    kv = KVCacheManager(8, 4, LRUEviction(), host=host)
    s = state_of(Request("a", 0.0, 12, 2))
    assert kv.admit(s, 12, 0.0)
    s.num_computed_tokens = 12
    assert not kv.swap_out(s, 1.0) and kv.num_blocks_held("a") == 3  # 3 blocks, room for 2: nothing happened
    s.num_computed_tokens = 8
    assert kv.swap_out(s, 1.0) and host.num_free_blocks == 0
    kv.free(s, 2.0)  # e.g. it timed out while waiting
    kv.check_invariants()
    assert host.num_free_blocks == 2 and host.swapped("a") is None


def test_evicted_prefix_spills_to_host_and_a_later_hit_loads_it():
    host = HostTier(8, 4, LRUEviction())
    kv = KVCacheManager(3, 4, LRUEviction(), host=host)
    ids = tuple(range(9))
    a = state_of(Request("a", 0.0, 9, 1, prompt_token_ids=ids))
    assert kv.admit(a, 9, 0.0)
    a.num_computed_tokens = 9
    kv.register_computed(a, 0.0)
    kv.free(a, 0.0)
    other = state_of(Request("x", 1.0, 12, 1))  # takes every device block: the two cached ones spill
    assert kv.admit(other, 12, 1.0)
    assert [c.kind for c in host.take_copies()] == ["spill", "spill"]
    kv.free(other, 1.0)
    b = state_of(Request("b", 2.0, 9, 1, prompt_token_ids=ids))
    c = state_of(Request("c", 2.0, 9, 1, prompt_token_ids=ids, tenant="t2"))
    assert kv.lookup(b) == 8 and kv.lookup(c) == 0  # the host cache is salted by tenant like the device's
    assert kv.admit(b, 1, 2.0) and b.num_computed_tokens == 8
    assert [c.kind for c in host.take_copies()] == ["load", "load"]
    assert host.stats.host_hit_admissions == 1 and host.stats.load_blocks == 2
    assert kv.lookup(state_of(Request("d", 3.0, 9, 1, prompt_token_ids=ids))) == 8  # published on the device again
    kv.check_invariants()


def pressure_requests(n: int = 6) -> list[Request]:
    return [Request(f"r{i}", 0.001 * i, 40, 24, prompt_token_ids=tuple(range(100 * i, 100 * i + 40)))
            for i in range(n)]


def test_swap_saves_the_recompute_under_kv_pressure():
    """Same requests, a pool too small for all of them: recompute prefills victims again, swap copies them back."""
    reqs = pressure_requests()
    limits = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    (res_r, rep_r, _), (res_s, rep_s, ex_s) = (
        run(reqs, SarathiScheduler, policy, num_blocks=14, host_blocks=64, spill=False, **limits)
        for policy in (RecomputePreemption(), SwapPreemption()))
    prefill = [sum(x.features.num_prefill_tokens for x in res.steps) for res in (res_r, res_s)]
    assert sum(s.num_preemptions for s in res_r.states) > 0 and sum(s.num_preemptions for s in res_s.states) > 0
    assert prefill[1] < prefill[0]
    stats = rep_s.kv.host.stats
    assert stats.swap_outs == stats.swap_ins > 0 and rep_r.kv.host.stats.swap_outs == 0
    assert stats.swap_out_blocks == sum(c.kind == "swap_out" for c in ex_s.copies)
    assert all(s.status is Status.FINISHED and s.num_output_tokens == 24 for s in res_s.states)


def test_cost_policy_compares_copy_and_recompute_times():
    p = CostPreemption(kv_bytes_per_token=1e6, host_link_bw=1e9, prefill_tokens_per_s=1e4, host_link_latency_s=0.0)
    assert p.swap_time(16, 16) == pytest.approx(2 * 16e-3) and p.recompute_time(16) == pytest.approx(1.6e-3)

    class View:
        block_size, num_free_host_blocks = 16, 100

    s = state_of(Request("a", 0.0, 64, 2))
    s.num_computed_tokens = 32
    assert p.mode(s, View()) == "recompute"  # 1 MB a token over 1 GB/s is slower than 10k tokens/s
    fast = CostPreemption(kv_bytes_per_token=1e3, host_link_bw=1e9, prefill_tokens_per_s=1e4)
    assert fast.mode(s, View()) == "swap"
    View.num_free_host_blocks = 1
    assert fast.mode(s, View()) == "recompute"  # no room for its 2 blocks


request_lists = st.lists(
    st.tuples(st.floats(0, 1), st.integers(1, 90), st.integers(1, 30), st.integers(0, 2), st.sampled_from("ab"),
              st.integers(0, 2)),
    min_size=1, max_size=16)


@given(request_lists, st.sampled_from([SarathiScheduler, VLLMPrefillFirstScheduler, PriorityScheduler]),
       st.sampled_from(["swap", "recompute", "cost"]), st.integers(8, 30), st.integers(1, 40), st.booleans(),
       st.booleans(), st.sampled_from([LRUEviction, LFUEviction]))
def test_invariants_under_random_load(spec, scheduler, mode, num_blocks, host_blocks, spill, prefix_caching,
                                      host_eviction):
    """Every step: refcounts and free lists of both tiers consistent, the copies bring back exactly the KV each
    chunk reads, nobody writes a shared block (so tenants never share). At the end: every request ended once,
    nothing is held in either tier."""
    reqs = [Request(f"r{i}", t, p, o, hash_ids=(g, 100 + i, 200 + i), tokens_per_hash_id=32, tenant=tenant,
                    priority=prio)
            for i, (t, p, o, g, tenant, prio) in enumerate(spec)]
    policy = {"swap": SwapPreemption(), "recompute": RecomputePreemption(),
              "cost": CostPreemption(kv_bytes_per_token=1.0, host_link_bw=1e3, prefill_tokens_per_s=100.0)}[mode]
    res, rep, ex = run(reqs, scheduler, policy, num_blocks, host_blocks, block_size=8, spill=spill,
                       host_eviction=host_eviction, prefix_caching=prefix_caching, max_num_batched_tokens=128,
                       max_num_seqs=4, max_model_len=256)
    assert sorted(s.id for s in res.states) == sorted(r.id for r in reqs)
    for s in res.states:
        assert s.status is Status.FINISHED and s.num_output_tokens == s.request.max_new_tokens or \
            s.status is Status.REJECTED and s.reason
    kv, host = rep.kv, rep.kv.host
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and not host.swapped_ids and not host.has_copies
    assert all(b.ref_count == 0 for b in host.blocks)
    st_ = host.stats
    assert st_.swap_ins <= st_.swap_outs  # a swapped-out request may end rejected without coming back
    assert st_.swap_out_blocks == sum(c.kind == "swap_out" for c in ex.copies)
    assert st_.swap_in_blocks == sum(c.kind == "swap_in" for c in ex.copies)
    assert st_.spill_blocks == sum(c.kind == "spill" for c in ex.copies) and (spill or not st_.spill_blocks)


class _WrongVictim(LRUEviction):
    def victim(self):
        super().victim()
        return 7


def test_a_host_eviction_victim_that_is_no_spilled_block_is_refused_naming_the_policy():
    from core.interfaces import Block

    host = HostTier(1, 4, _WrongVictim())
    for bid, h in ((0, 101), (1, 102)):
        blk = Block(bid, size=4)
        blk.hash = h
        if h == 101:
            host.spill(blk, bid, 0.0)
        else:
            with pytest.raises(RuntimeError, match=r"host eviction _WrongVictim\.victim\(\) returned 7, not the id "
                                                   "of an evictable spilled block"):
                host.spill(blk, bid, 1.0)
