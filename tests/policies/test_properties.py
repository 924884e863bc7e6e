"""Every scheduler x every eviction policy on random workloads: budgets, terminal states, KV invariants,
no starvation. Small KV pools force preemption; shared hash_ids and tenants exercise the prefix cache."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.kv_cache import PROMPT, VLLM, KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from policies.eviction.cost_aware import CostAwareEviction
from policies.eviction.fifo import FIFOEviction
from policies.eviction.lfu import LFUEviction
from policies.eviction.lru import LRUEviction
from policies.schedulers.lpm import LPMScheduler
from policies.schedulers.orca import OrcaScheduler
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.static import StaticScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from policies.schedulers.vllm_v1 import VLLMv1Scheduler
from sim.clock import run_virtual
from tests.helpers import FormulaExecutor, ListWorkload

# name -> (factory, chunked): a non-chunking scheduler needs a prompt (or a recompute) whole in one step
SCHEDULERS = {
    "sarathi": (SarathiScheduler, True),
    "static": (StaticScheduler, False),
    "static_paged": (lambda: StaticScheduler(reserve=False), False),
    "orca": (OrcaScheduler, False),
    "orca_paged": (lambda: OrcaScheduler(reserve=False), False),
    "vllm_prefill_first": (VLLMPrefillFirstScheduler, False),
    "priority": (PriorityScheduler, True),
    "lpm": (lambda: LPMScheduler(fcfs_threshold=4), True),  # small threshold: both orders get exercised
    "vllm_v1": (VLLMv1Scheduler, True),
    "vllm_v1_threshold": (lambda: VLLMv1Scheduler(long_prefill_token_threshold=24), True),
}
KV_MODES = {"vllm_v1": VLLM}  # scheduler -> its pool's prefix-cache mode, where not the default (prompt)
EVICTIONS = {"lru": LRUEviction, "lfu": LFUEviction, "fifo": FIFOEviction,
             "cost_aware": lambda: CostAwareEviction(a=1.0, b=0.01)}
BLOCK = 8


class CountingWorkload(ListWorkload):
    def __init__(self, requests):
        super().__init__(requests)
        self.terminal_calls: list[str] = []

    def on_finish(self, state, now):
        self.terminal_calls.append(state.id)
        return None


request_specs = st.lists(
    st.tuples(st.floats(0, 0.2), st.integers(1, 80), st.integers(1, 40), st.integers(0, 2), st.sampled_from("ab"),
              st.integers(0, 2), st.sampled_from([None, 0.05, 1.0])),
    min_size=1, max_size=16)


@pytest.mark.parametrize("eviction", list(EVICTIONS))
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@given(spec=request_specs, num_blocks=st.integers(10, 24), budget=st.sampled_from([32, 96, 256]),
       max_seqs=st.sampled_from([1, 3, 8]))
def test_invariants_on_random_workloads(scheduler, eviction, spec, num_blocks, budget, max_seqs):
    factory, chunked = SCHEDULERS[scheduler]
    reqs = [Request(f"r{i}", t, p, o, hash_ids=(g, 100 + i, 200 + i, 300 + i), tokens_per_hash_id=32, tenant=tenant,
                    priority=prio, ttft_deadline_s=deadline)
            for i, (t, p, o, g, tenant, prio, deadline) in enumerate(spec)]
    limits = SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=4096)
    kv = KVCacheManager(num_blocks, BLOCK, EVICTIONS[eviction](), prefix_cache_mode=KV_MODES.get(scheduler, PROMPT))
    rep = Replica(0, factory(), kv, limits)
    workload = CountingWorkload(reqs)
    res = run_virtual(ServingLoop([rep], [FormulaExecutor(lambda f: 0.002 + 1e-5 * f.num_batched_tokens)], None,
                               workload))  # one replica: the router is never asked

    # budgets held in every step (the replica also raises on a violation)
    assert all(s.features.num_batched_tokens <= budget and s.features.num_seqs <= max_seqs for s in res.steps)
    # every request terminal exactly once
    assert sorted(workload.terminal_calls) == sorted(r.id for r in reqs)
    assert all(s.status.terminal for s in res.states)
    # KV invariants; nothing held at the end
    rep.kv.check_invariants()
    assert rep.kv.num_used_blocks == 0
    for s in res.states:
        r = s.request
        fits_pool = rep.kv.blocks_for(r.prompt_len + r.max_new_tokens - 1) <= num_blocks
        # a prompt and any recompute of it fit one step whole
        fits_step = chunked or r.prompt_len + r.max_new_tokens - 1 <= budget
        if fits_pool and fits_step:  # no starvation: it must finish
            assert s.status is Status.FINISHED, (s.id, s.status, s.reason)
        if s.status is Status.FINISHED:
            assert s.num_output_tokens == r.max_new_tokens and len(s.token_times) == r.max_new_tokens
            # 1e-12: SimPy's now = previous arrival + delay can land one ulp before arrival_s (see report)
            assert r.arrival_s <= s.first_scheduled_s + 1e-12 and s.first_scheduled_s <= s.first_token_s <= s.finish_s
        else:
            assert s.status is Status.REJECTED and s.reason
            if chunked:  # only requests that can never fit the pool are rejected
                assert not fits_pool
