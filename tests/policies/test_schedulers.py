"""Each scheduler's defining behaviour on hand-built scenarios with hand-computed timelines."""

import pytest

from core.kv_cache import KVCacheManager
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from policies.eviction.lru import LRUEviction
from policies.schedulers.lpm import LPMScheduler
from policies.schedulers.orca import OrcaScheduler
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.static import StaticScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from tests.helpers import run_requests

STEP = 0.01  # every step takes 10 ms, so times count steps


def by_id(res):
    return {s.id: s for s in res.states}


# ---- static ------------------------------------------------------------------------------------------------
def test_static_admits_nobody_mid_batch():
    reqs = [Request("A", 0.0, 10, 5), Request("B", 0.0, 10, 20), Request("C", 0.005, 10, 2)]
    res, _ = run_requests(reqs, StaticScheduler, step_time=lambda f: STEP, max_num_batched_tokens=64, max_num_seqs=4)
    s = by_id(res)
    # step 1 prefills A and B; B needs 19 more decode steps, so the batch ends at 0.20 although A left at 0.05
    assert s["A"].finish_s == pytest.approx(0.05) and s["B"].finish_s == pytest.approx(0.20)
    # C (arrived at 0.005, a seat free from 0.05) starts only with the next batch: prefill + 1 decode
    assert s["C"].first_scheduled_s == pytest.approx(0.20) and s["C"].finish_s == pytest.approx(0.22)
    # iteration-level Orca takes C at the first step boundary after its arrival
    orca = by_id(run_requests(reqs, OrcaScheduler, step_time=lambda f: STEP, max_num_batched_tokens=64,
                              max_num_seqs=4)[0])
    assert orca["C"].first_scheduled_s == pytest.approx(0.01)


def test_static_prefills_an_oversized_batch_over_several_steps_in_lockstep():
    reqs = [Request(x, 0.0, 40, 3) for x in "ABC"]
    res, _ = run_requests(reqs, StaticScheduler, step_time=lambda f: STEP, max_num_batched_tokens=64, max_num_seqs=4,
                      keep_batches=True)
    # 3 x 40 prompt tokens, 64 per step: one whole prompt per step, no decode until all three are prefilled
    shapes = [(b.features.num_prefill_tokens, b.features.num_decode_seqs) for b in res.batches]
    assert shapes == [(40, 0), (40, 0), (40, 0), (0, 3), (0, 3)]
    assert all(s.first_scheduled_s == 0.0 for s in res.states)  # one batch, formed at once


def test_static_reserves_kv_for_the_whole_request():
    limits = SchedulerLimits(max_num_batched_tokens=64)
    rep = Replica(0, StaticScheduler(), KVCacheManager(16, 4, LRUEviction()), limits)
    rep.add(Request("A", 0.0, 10, 23), 0.0)
    batch = rep.schedule(0.0)
    # prompt 10 + 23 outputs - 1 = 32 tokens -> 8 blocks of 4, though the step only computes 10 tokens
    assert len(rep.kv.block_table("A")) == 8 and batch.features.num_batched_tokens == 10


# ---- orca --------------------------------------------------------------------------------------------------
def test_orca_never_splits_a_prompt_and_mixes_prefill_with_decode():
    reqs = [Request("A", 0.0, 8, 10), Request("B", 0.005, 30, 2), Request("C", 0.005, 30, 2)]
    res, _ = run_requests(reqs, OrcaScheduler, step_time=lambda f: STEP, max_num_batched_tokens=32, max_num_seqs=8,
                      keep_batches=True)
    # every chunk completes its sequence: prefills are whole prompts
    assert all(ch.samples for b in res.batches for ch in b.chunks)
    # step 2 (t=0.01): A's decode + B's whole 30-token prompt = 31 <= 32; C (30) no longer fits: next step
    assert [(ch.state.id, ch.num_tokens) for ch in res.batches[1].chunks] == [("A", 1), ("B", 30)]
    assert by_id(res)["C"].first_scheduled_s == pytest.approx(0.02)
    # Sarathi would have split C's prompt into the leftover budget
    sar, _ = run_requests(reqs, SarathiScheduler, step_time=lambda f: STEP, max_num_batched_tokens=32, max_num_seqs=8,
                      keep_batches=True)
    assert not all(ch.samples for b in sar.batches for ch in b.chunks)


def test_orca_without_reservation_preempts_and_with_it_never_does():
    reqs = [Request(f"r{i}", 0.0, 8, 24) for i in range(4)]  # lifetime 31 tokens = 8 blocks of 4 each
    kwargs = dict(num_blocks=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    paged, _ = run_requests(reqs, lambda: OrcaScheduler(reserve=False), **kwargs)
    reserved, _ = run_requests(reqs, OrcaScheduler, **kwargs)
    assert sum(s.num_preemptions for s in paged.states) > 0
    assert sum(s.num_preemptions for s in reserved.states) == 0
    assert all(s.status is Status.FINISHED for s in paged.states + reserved.states)


# ---- vllm_prefill_first ------------------------------------------------------------------------------------
def test_vllm_prefill_first_never_mixes_and_pauses_decodes_for_new_prompts():
    reqs = [Request("A", 0.0, 8, 6), Request("B", 0.0, 8, 6), Request("C", 0.015, 8, 3)]
    res, _ = run_requests(reqs, VLLMPrefillFirstScheduler, step_time=lambda f: STEP, max_num_batched_tokens=64,
                      max_num_seqs=8, keep_batches=True)
    for b in res.batches:
        assert b.features.num_decode_seqs in (0, len(b))
    s = by_id(res)
    # steps: [0,.01] prefill A,B | [.01,.02] decode A,B | [.02,.03] prefill C alone | then decodes of all three
    assert s["C"].first_token_s == pytest.approx(0.03)
    assert s["A"].token_times[:3] == pytest.approx([0.01, 0.02, 0.04])


# ---- priority ----------------------------------------------------------------------------------------------
def test_priority_serves_priority_then_deadline_then_arrival():
    reqs = [Request("low", 0.0, 8, 4, priority=1),
            Request("late_deadline", 0.0, 8, 4, ttft_deadline_s=5.0),
            Request("no_deadline", 0.0, 8, 4),
            Request("early_deadline", 0.001, 8, 4, ttft_deadline_s=1.0)]
    res, _ = run_requests(reqs, PriorityScheduler, max_num_seqs=1)
    order = [s.id for s in sorted(res.states, key=lambda s: s.first_scheduled_s)]
    # all but early_deadline wait at t=0.01 (it arrives during the first step, which runs late_deadline)
    assert order == ["late_deadline", "early_deadline", "no_deadline", "low"]


def test_priority_preempts_the_least_important_not_the_newest():
    # L (unimportant) runs alone first; H (important) joins later and is the newest. 6 blocks of 4 tokens
    # cannot hold both lifetimes (4 + 15 tokens each), so a decode eventually finds no block.
    reqs = [Request("L", 0.0, 4, 16, priority=1), Request("H", 0.015, 4, 16, priority=0)]
    kwargs = dict(num_blocks=6, block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    s = by_id(run_requests(reqs, PriorityScheduler, **kwargs)[0])
    assert s["L"].num_preemptions >= 1 and s["H"].num_preemptions == 0
    assert s["H"].finish_s < s["L"].finish_s
    fcfs = by_id(run_requests(reqs, SarathiScheduler, **kwargs)[0])  # the default victim is the newest: H
    assert fcfs["H"].num_preemptions >= 1 and fcfs["L"].num_preemptions == 0


def test_priority_request_takes_the_seat_of_a_less_important_one():
    reqs = [Request("L", 0.0, 8, 50, priority=1), Request("H", 0.015, 8, 3, priority=0)]
    s = by_id(run_requests(reqs, PriorityScheduler, step_time=lambda f: STEP, max_num_seqs=1)[0])
    # H arrives during step 2 and is admitted at t=0.02 by preempting L; prefill + 2 decodes
    assert s["H"].first_scheduled_s == pytest.approx(0.02) and s["H"].finish_s == pytest.approx(0.05)
    assert s["L"].num_preemptions == 1 and s["L"].status is Status.FINISHED


# ---- lpm ---------------------------------------------------------------------------------------------------
def lpm_requests():
    """W warms the cache with content blocks 1,2,3; then X, Y, Z arrive together sharing 0, 1 and 2 blocks."""
    def req(rid, t, ids):
        return Request(rid, t, 48, 2, hash_ids=ids, tokens_per_hash_id=16)
    return [req("W", 0.0, (1, 2, 3)), req("X", 1.0, (5, 6, 7)), req("Y", 1.0, (1, 8, 9)), req("Z", 1.0, (1, 2, 9))]


@pytest.mark.parametrize("threshold, expected", [(128, ["Z", "Y", "X"]), (0, ["X", "Y", "Z"])])
def test_lpm_admits_longest_cached_prefix_first_unless_the_queue_is_long(threshold, expected):
    res, _ = run_requests(lpm_requests(), lambda: LPMScheduler(fcfs_threshold=threshold), max_num_seqs=1)
    s = by_id(res)
    later = sorted((s[x] for x in "XYZ"), key=lambda st: st.first_scheduled_s)
    assert [st.id for st in later] == expected
    # hits with 16-token blocks: Z reuses 2 blocks, Y 1, X none
    assert (s["Z"].num_cached_tokens, s["Y"].num_cached_tokens, s["X"].num_cached_tokens) == (32, 16, 0)


# ---- non-chunking schedulers never deadlock on a prompt over the token budget ------------------------------
@pytest.mark.parametrize("factory", [StaticScheduler, OrcaScheduler, lambda: OrcaScheduler(reserve=False),
                                     lambda: StaticScheduler(reserve=False), VLLMPrefillFirstScheduler])
def test_prompt_over_the_token_budget_is_rejected_and_the_rest_finish(factory):
    reqs = [Request("a", 0.0, 10, 5), Request("huge", 0.0, 100, 5), Request("b", 0.0, 10, 5)]
    res, reps = run_requests(reqs, factory, max_num_batched_tokens=64, max_num_seqs=4)
    s = by_id(res)
    assert s["a"].status is Status.FINISHED and s["b"].status is Status.FINISHED
    assert s["huge"].status is Status.REJECTED and "could not schedule" in s["huge"].reason
    reps[0].kv.check_invariants()
    assert reps[0].kv.num_used_blocks == 0


def test_lpm_rejects_negative_threshold():
    with pytest.raises(ValueError, match="fcfs_threshold"):
        LPMScheduler(fcfs_threshold=-1)
