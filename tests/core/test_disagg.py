"""PD disaggregation (core.disagg) on the simulated clock: request flow and timestamps against hand arithmetic,
decode admission under the decode pool's KV limit (the wait is measured), the prefill side's prefix cache,
fast-forward equivalence, and the placement plugins."""

from __future__ import annotations

import math

import pytest

from core.disagg import PDServingLoop
from core.interfaces import KVTransport, Placement, ReplicaView
from core.kv_cache import KVCacheManager
from core.links import Link
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from policies.eviction.lru import LRUEviction
from policies.placement.kv_aware import KVAwarePlacement
from policies.placement.least_loaded import LeastLoadedPlacement
from policies.placement.random import RandomPlacement
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from sim.cost.linear import LinearCostModel
from sim.executor import CostModelExecutor
from sim.transfer import LinkTransport
from tests.helpers import FormulaExecutor, ListWorkload

STEP = 0.01  # every step lasts this long (FormulaExecutor)
BYTES_PER_TOKEN = 1000.0
LINK = Link(bandwidth_bytes_s=1e6, latency_s=0.002)  # 1 ms per token of KV + 2 ms


def pd_loop(requests, num_prefill=1, num_decode=1, num_blocks=64, decode_blocks=None, block_size=4,
            placement=None, executors=None, **limits):
    pools = [num_blocks] * num_prefill + [decode_blocks or num_blocks] * num_decode
    reps = [Replica(i, SarathiScheduler(), KVCacheManager(n, block_size, LRUEviction()), SchedulerLimits(**limits))
            for i, n in enumerate(pools)]
    exs = executors or [FormulaExecutor(lambda f: STEP) for _ in reps]
    loop = PDServingLoop(reps, exs, RoundRobinRouter(), ListWorkload(requests), num_prefill=num_prefill,
                         placement=placement or LeastLoadedPlacement(),
                         transport=LinkTransport(LINK, BYTES_PER_TOKEN))
    return loop, reps


def test_request_flow_and_times_follow_the_link_arithmetic():
    req = Request("a", 0.0, 10, 4, prompt_token_ids=tuple(range(10)))
    loop, reps = pd_loop([req])
    (state,) = run_virtual(loop).states
    (t,) = loop.transfers
    transfer = 10 * BYTES_PER_TOKEN / 1e6 + 0.002  # the prompt's KV over the link
    assert (t.prefill, t.decode, t.num_tokens) == (0, 1, 10)
    assert t.ready_s == pytest.approx(STEP) and t.start_s == t.ready_s  # nothing queued, decode pool free
    assert t.transfer_s == pytest.approx(transfer) and t.kv_wait_s == 0 and t.link_wait_s == 0
    # TTFT includes the transfer; then 3 decode steps on the decode replica
    assert state.first_token_s == pytest.approx(STEP + transfer)
    assert state.finish_s == pytest.approx(STEP + transfer + 3 * STEP)
    assert state.status is Status.FINISHED and state.replica == 1 and state.num_output_tokens == 4
    assert list(state.token_times) == pytest.approx([STEP + transfer + k * STEP for k in range(4)])
    for r in reps:
        r.kv.check_invariants()
        assert r.kv.num_used_blocks == 0  # every block free or cached-evictable
    # the prefill replica freed the blocks the normal way: its two full prompt blocks stay cached
    assert reps[0].kv.lookup(loop.transfers[0].state) == 8
    assert reps[1].kv.lookup(loop.transfers[0].state) == 0  # nothing published on the decode side


def test_single_token_requests_finish_on_the_prefill_replica_without_a_transfer():
    loop, reps = pd_loop([Request("a", 0.0, 6, 1)])
    (state,) = run_virtual(loop).states
    assert state.status is Status.FINISHED and state.replica == 0 and not loop.transfers
    assert state.first_token_s == pytest.approx(STEP)


def test_a_transfer_waits_for_decode_kv_and_the_wait_is_recorded():
    # decode pool: 4 blocks of 4 tokens; each request needs 3 blocks (10 prompt tokens) and grows to 4 (13 tokens)
    reqs = [Request(r, 0.0, 10, 4) for r in "ab"]
    loop, reps = pd_loop(reqs, decode_blocks=4)
    states = {s.id: s for s in run_virtual(loop).states}
    a, b = loop.transfers
    assert a.kv_wait_s == 0 and b.kv_wait_s > 0
    assert b.start_s == pytest.approx(states["a"].finish_s)  # b's KV fits once a has ended and freed its blocks
    assert states["b"].first_token_s == pytest.approx(b.start_s + b.transfer_s)
    assert all(s.status is Status.FINISHED for s in states.values())
    assert loop.metrics()["num_kv_waits"] == 1
    for r in reps:
        r.kv.check_invariants()


def test_decode_seats_bound_admission():
    reqs = [Request(f"r{i}", 0.0, 5, 6) for i in range(4)]
    loop, reps = pd_loop(reqs, max_num_seqs=2)
    states = run_virtual(loop).states
    assert all(s.status is Status.FINISHED for s in states)
    assert sum(t.kv_wait_s > 0 for t in loop.transfers) >= 1  # a seat was waited for


def test_a_prefill_replica_waits_for_its_sending_kv_instead_of_rejecting():
    # prefill pool: 6 blocks; decode pool: 4 blocks (one request at a time); the prefill side keeps each request's
    # 3 blocks until its transfer ends, so the third request finds the prefill pool full while nothing runs there
    reqs = [Request(f"r{i}", 0.0, 10, 3) for i in range(4)]
    loop, reps = pd_loop(reqs, num_blocks=6, decode_blocks=4)
    states = run_virtual(loop).states
    assert [s.status for s in states] == [Status.FINISHED] * 4
    for r in reps:
        r.kv.check_invariants()


def test_link_is_a_fifo_queue_per_prefill_replica():
    reqs = [Request(f"r{i}", 0.0, 40, 50) for i in range(3)]  # all prefilled in one step, long decodes
    loop, _ = pd_loop(reqs, num_decode=3, max_num_batched_tokens=2048)
    run_virtual(loop)
    ts = loop.transfers
    assert [t.ready_s for t in ts] == pytest.approx([STEP] * 3)
    for prev, t in zip(ts, ts[1:], strict=False):  # one at a time, in prefill-completion order
        assert t.start_s == pytest.approx(prev.end_s)
    assert sorted(t.decode for t in ts) == [1, 2, 3]  # least loaded spreads them (incoming counts as load)


def test_two_prefill_links_transfer_in_parallel():
    reqs = [Request(f"r{i}", 0.0, 40, 3) for i in range(2)]
    loop, _ = pd_loop(reqs, num_prefill=2, num_decode=2)
    run_virtual(loop)
    a, b = loop.transfers
    assert a.prefill != b.prefill and a.start_s == b.start_s and a.decode != b.decode


def test_fast_forward_gives_the_per_step_run():
    reqs = [Request(f"r{i}", 0.003 * i, 7 + 5 * i, 20 + 3 * i) for i in range(12)]
    cost = LinearCostModel(c0_s=1e-3, per_prefill_token_s=1e-4, per_decode_seq_s=2e-4)
    runs = []
    for fast in (True, False):
        loop, _ = pd_loop(reqs, num_decode=2, num_blocks=40,
                          executors=[CostModelExecutor(cost) for _ in range(3)])
        loop.fast_forward = fast
        result = run_virtual(loop)
        runs.append(([(s.id, list(s.token_times), s.replica) for s in result.states], list(result.steps),
                     [(t.start_s, t.end_s, t.decode) for t in loop.transfers], loop.fast_forwarded_steps))
    assert runs[0][:3] == runs[1][:3]
    assert runs[0][3] > 0 and runs[1][3] == 0


def test_pd_loop_needs_both_roles():
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        pd_loop([], num_prefill=1, num_decode=0)


def test_link_checks_its_values():
    with pytest.raises(ValueError, match="link.bandwidth_bytes_s"):
        Link(0.0)
    with pytest.raises(ValueError, match="link.latency_s"):
        Link(1e9, -1.0)
    assert Link(1e9, 1e-3).seconds(2e9) == pytest.approx(2.001)


def view(i, waiting=0, running=0, free=10):
    return ReplicaView(i, waiting, running, free, 100, 16, lambda: (0, 0), lambda r: 0)


def test_placements():
    req = Request("a", 0.0, 4, 4)
    views = [view(0, waiting=2, free=50), view(1, running=1, free=5), view(2, running=1, free=20)]
    assert LeastLoadedPlacement().place(req, views) == 2  # fewest outstanding; tie -> most free blocks
    assert KVAwarePlacement().place(req, views) == 0
    picks = [RandomPlacement(seed=3).place(req, views) for _ in range(2)]
    assert picks[0] == picks[1]
    rng = RandomPlacement(seed=1)
    assert {rng.place(req, views) for _ in range(50)} == {0, 1, 2}
    for p in (LeastLoadedPlacement(), KVAwarePlacement(), RandomPlacement()):
        assert isinstance(p, Placement)
    assert isinstance(LinkTransport(LINK, 1.0), KVTransport)


def test_metrics_section():
    reqs = [Request(r, 0.0, 10, 4) for r in "ab"]
    loop, _ = pd_loop(reqs, decode_blocks=4)
    run_virtual(loop)
    m = loop.metrics(kv_bytes_per_token=BYTES_PER_TOKEN)
    assert m["num_transfers"] == 2 and m["transfer_tokens"] == 20 and m["transfer_bytes"] == 20 * BYTES_PER_TOKEN
    assert m["transfer_s"]["p50"] == pytest.approx(0.012)
    waits = sorted(t.kv_wait_s for t in loop.transfers)
    assert m["transfer_kv_wait_s"]["p99"] == waits[-1] and m["transfer_kv_wait_s"]["p50"] == waits[0]
    assert not math.isnan(m["transfer_link_wait_s"]["mean"])


def test_a_request_no_decode_pool_can_hold_is_rejected_with_a_reason():
    reqs = [Request("big", 0.0, 20, 10), Request("small", 0.0, 6, 3)]  # 29 tokens need 8 blocks; decode has 6
    loop, reps = pd_loop(reqs, decode_blocks=6)
    states = {s.id: s for s in run_virtual(loop).states}
    assert states["big"].status is Status.REJECTED and "decode pool" in states["big"].reason
    assert states["small"].status is Status.FINISHED
