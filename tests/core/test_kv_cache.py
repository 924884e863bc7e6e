"""KV cache manager: prefix-cache semantics (docs/architecture.md, "Prefix caching") and accounting invariants
under random load."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.host_tier import HostTier
from core.kv_cache import PREFIX_CACHE_MODES, VLLM, KVCacheManager
from core.prompt import block_hashes
from core.request import Request, RequestState, Status
from policies.eviction.lru import LRUEviction
from policies.schedulers.sarathi import SarathiScheduler
from tests.helpers import run_requests


def state_of(req: Request, block_size: int) -> RequestState:
    return RequestState(req, block_hashes=block_hashes(req, block_size))


def run_to_completion(kv: KVCacheManager, state: RequestState, now: float = 0.0) -> None:
    assert kv.admit(state, state.num_tokens - kv.lookup(state), now)
    state.num_computed_tokens = state.num_tokens
    kv.register_computed(state, now)
    kv.free(state, now)


def test_only_full_blocks_are_reused_and_last_token_is_recomputed():
    kv = KVCacheManager(16, 16, LRUEviction())
    ids = tuple(range(40))
    run_to_completion(kv, state_of(Request("a", 0, 40, 1, prompt_token_ids=ids), 16))
    # 40 shared tokens -> floor(40/16) = 2 full blocks reused
    assert kv.lookup(state_of(Request("b", 0, 45, 1, prompt_token_ids=ids + (1,) * 5), 16)) == 32
    # an identical 32-token prompt: a full hit would leave nothing to compute; reuse n-1 rounded down = 16
    run_to_completion(kv, state_of(Request("c", 0, 32, 1, prompt_token_ids=ids[:32]), 16))
    assert kv.lookup(state_of(Request("d", 0, 32, 1, prompt_token_ids=ids[:32]), 16)) == 16
    # a prompt that diverges inside the first block shares nothing
    assert kv.lookup(state_of(Request("e", 0, 40, 1, prompt_token_ids=(9,) + ids[1:]), 16)) == 0
    kv.check_invariants()


def test_tenants_never_share_blocks():
    kv = KVCacheManager(16, 16, LRUEviction())
    ids = tuple(range(64))
    run_to_completion(kv, state_of(Request("a", 0, 64, 1, prompt_token_ids=ids, tenant="t1"), 16))
    assert kv.lookup(state_of(Request("b", 0, 64, 1, prompt_token_ids=ids, tenant="t2"), 16)) == 0
    assert kv.lookup(state_of(Request("c", 0, 64, 1, prompt_token_ids=ids, tenant="t1"), 16)) == 48


def test_hash_ids_share_exactly_like_tokens():
    # two requests whose first content block (hash id 7, 64 tokens) is equal share 64 // 16 = 4 blocks
    a = Request("a", 0, 100, 1, hash_ids=(7, 8), tokens_per_hash_id=64)
    b = Request("b", 0, 100, 1, hash_ids=(7, 9), tokens_per_hash_id=64)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:4] == hb[:4] and not set(ha[4:]) & set(hb[4:])


def test_evicted_blocks_are_reused_lru_first():
    kv = KVCacheManager(4, 4, LRUEviction())
    run_to_completion(kv, state_of(Request("old", 0, 9, 1, prompt_token_ids=tuple(range(9))), 4), now=1.0)
    run_to_completion(kv, state_of(Request("new", 0, 9, 1, prompt_token_ids=tuple(range(100, 109))), 4), now=2.0)
    # the pool (4 blocks) holds 2 cached blocks of each; a 5-token unique request needs 2 blocks: the old ones go
    s = state_of(Request("x", 0, 5, 1), 4)
    assert kv.admit(s, 5, 3.0)
    assert kv.lookup(state_of(Request("n2", 0, 9, 1, prompt_token_ids=tuple(range(100, 109))), 4)) == 8
    assert kv.lookup(state_of(Request("o2", 0, 9, 1, prompt_token_ids=tuple(range(9))), 4)) == 0
    kv.check_invariants()


class _Victim(LRUEviction):
    """Gives up ``choice`` (or what it returns for the real victim) instead of the real victim."""

    def __init__(self, choice) -> None:
        super().__init__()
        self.choice = choice

    def victim(self):
        return self.choice(super().victim())


@pytest.mark.parametrize(("choice", "shown"), [(lambda bid: None, "None"), (lambda bid: 10**6, "1000000"),
                                               (lambda bid: -1, "-1"), (lambda bid: float(bid), ".0")])
def test_an_eviction_victim_that_is_no_evictable_block_is_refused_naming_the_policy(choice, shown):
    policy = _Victim(lambda bid: bid)
    kv = KVCacheManager(4, 4, policy)
    run_to_completion(kv, state_of(Request("old", 0, 9, 1, prompt_token_ids=tuple(range(9))), 4), now=1.0)
    run_to_completion(kv, state_of(Request("new", 0, 9, 1, prompt_token_ids=tuple(range(100, 109))), 4), now=2.0)
    policy.choice = choice
    with pytest.raises(RuntimeError, match=rf"eviction _Victim\.victim\(\) returned \S*{shown}\S*, not the id of an "
                                           "evictable cached block"):
        kv.admit(state_of(Request("x", 0, 5, 1), 4), 5, 3.0)


# ---- vllm mode: vLLM v1's block pool ------------------------------------------------------------------------
def test_vllm_mode_publishes_blocks_when_scheduled():
    ids = tuple(range(8))
    for mode, hit in ((VLLM, 8), ("prompt", 0)):
        kv = KVCacheManager(16, 4, LRUEviction(), prefix_cache_mode=mode)
        assert kv.admit(state_of(Request("a", 0, 8, 1, prompt_token_ids=ids), 4), 8, 0.0)  # not computed yet
        # vLLM: a request admitted later in the same step reuses them (its KV is written in the same forward pass)
        assert kv.lookup(state_of(Request("b", 0, 10, 1, prompt_token_ids=ids + (1, 2)), 4)) == hit


def test_vllm_mode_caches_generated_tokens_blocks():
    kv = KVCacheManager(16, 4, LRUEviction(), prefix_cache_mode=VLLM)
    a = state_of(Request("a", 0, 6, 9, prompt_token_ids=tuple(range(6))), 4)
    assert kv.admit(a, 6, 0.0)
    a.num_computed_tokens = 6
    for t in (5, 6, 7, 8, 9):  # decode steps: the block of tokens 4..8 (prompt tail + 2 outputs) fills first
        a.add_token(t, 0.0)
        assert kv.allocate(a, a.num_tokens - a.num_computed_tokens, 0.0)
        a.num_computed_tokens = a.num_tokens
    resumed = Request("b", 0, 13, 1, prompt_token_ids=tuple(range(6)) + (5, 6, 7, 8, 9, 1, 1))
    assert kv.lookup(state_of(resumed, 4)) == 8  # blocks [0, 4) and [4, 8); [8, 11) is not full
    kv.free(a, 1.0)
    kv.check_invariants()


def test_vllm_mode_keeps_copies_and_a_lookup_takes_the_first_cached():
    kv = KVCacheManager(16, 4, LRUEviction(), prefix_cache_mode=VLLM)
    ids = tuple(range(12))
    a = state_of(Request("a", 0, 12, 1, prompt_token_ids=ids), 4)
    b = state_of(Request("b", 0, 12, 1, prompt_token_ids=ids), 4)
    assert kv.admit(a, 4, 0.0)  # a's first chunk: block 0
    assert kv.admit(b, 8, 0.0)  # b hits block 0 and computes blocks 1, 2 itself
    a.num_computed_tokens = 4
    assert kv.allocate(a, 8, 1.0)  # a computes its own copies of blocks 1, 2: both copies stay cached
    kv.check_invariants()
    first = kv.block_table("a")[:1] + kv.block_table("b")[1:]
    kv.free(b, 2.0)  # b's copies become evictable; a lookup still takes them (cached first), not a's in use
    c = state_of(Request("c", 0, 13, 1, prompt_token_ids=ids + (1,)), 4)
    free = kv.num_free_blocks
    assert kv.admit(c, 1, 3.0)
    assert kv.block_table("c")[:3] == first
    assert kv.num_free_blocks == free - 2 - 1  # b's two evictable copies reclaimed, one new block
    kv.check_invariants()


def test_vllm_mode_refuses_a_host_tier():
    with pytest.raises(ValueError, match="kv.prefix_cache_mode=vllm"):
        KVCacheManager(16, 4, LRUEviction(), host=HostTier(8, 4, LRUEviction()), prefix_cache_mode=VLLM)


def test_admit_checks_that_fit_tokens_would_fit():
    kv = KVCacheManager(4, 4, LRUEviction())
    s = state_of(Request("a", 0, 20, 1), 4)
    assert not kv.admit(s, 4, 0.0, fit_tokens=20)  # 5 blocks would not fit; nothing taken
    assert kv.num_free_blocks == 4
    assert kv.admit(s, 4, 0.0, fit_tokens=16) and kv.num_free_blocks == 3  # only the chunk's block is taken


request_lists = st.lists(
    st.tuples(st.floats(0, 2), st.integers(1, 120), st.integers(1, 30), st.integers(0, 3), st.sampled_from("ab")),
    min_size=1, max_size=25)


@pytest.mark.parametrize("mode", PREFIX_CACHE_MODES)
@given(request_lists, st.sampled_from([4, 16]), st.integers(8, 40), st.sampled_from([16, 64, 256]),
       st.booleans())
def test_accounting_invariants_under_random_load(mode, spec, block_size, num_blocks, budget, prefix_caching):
    reqs = [Request(f"r{i}", t, p, o, hash_ids=(g, 100 + i, 200 + i, 300 + i), tokens_per_hash_id=32, tenant=tenant)
            for i, (t, p, o, g, tenant) in enumerate(spec)]
    checks = []

    def step_time(f):
        checks.append(f)
        return 0.01 + 1e-4 * f.num_batched_tokens

    res, reps = run_requests(reqs, SarathiScheduler, step_time=step_time, num_blocks=num_blocks, block_size=block_size,
                         prefix_caching=prefix_caching, prefix_cache_mode=mode, max_num_batched_tokens=budget,
                         max_num_seqs=8, max_model_len=4096)
    # every request ends in exactly one terminal status, and counts add up
    assert sorted(s.id for s in res.states) == sorted(r.id for r in reqs)
    assert all(s.status.terminal for s in res.states)
    for s in res.states:
        if s.status is Status.FINISHED:
            assert s.num_output_tokens == s.request.max_new_tokens
            assert len(s.token_times) == s.num_output_tokens
            assert s.request.arrival_s <= s.first_scheduled_s <= s.first_token_s <= s.finish_s
        else:
            assert s.status is Status.REJECTED and s.reason
    # budgets held in every step
    assert all(f.num_batched_tokens <= budget and f.num_seqs <= 8 for f in checks)
    # at the end every block is free or cached-evictable; refcounts match block tables
    kv = reps[0].kv
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    # tenants never share: blocks of different tenants have different hashes
    by_tenant = {}
    for s in res.states:
        by_tenant.setdefault(s.request.tenant, set()).update(s.block_hashes)
    if len(by_tenant) == 2:
        assert not by_tenant["a"] & by_tenant["b"]


@given(request_lists)
def test_same_input_same_timeline(spec):
    reqs = [Request(f"r{i}", t, p, o, hash_ids=(g, 100 + i, 200 + i, 300 + i), tokens_per_hash_id=32)
            for i, (t, p, o, g, _) in enumerate(spec)]

    def timeline():
        res, _ = run_requests(reqs, SarathiScheduler, num_blocks=12, block_size=16, max_num_batched_tokens=64,
                          max_num_seqs=4, step_time=lambda f: 0.003 + 1e-5 * f.num_batched_tokens)
        return [(s.id, s.status, s.first_token_s, s.finish_s, tuple(s.token_times), s.num_preemptions)
                for s in res.states], [(x.start_s, x.duration_s, x.features) for x in res.steps]

    assert timeline() == timeline()


def test_a_million_block_pool_is_cheap_and_hands_out_blocks_in_id_order():
    """Blocks are created on first use: a 1e6-block pool costs a list slot per block (was ~170 MB, 1.7 s)."""
    import time
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    kv = KVCacheManager(1_000_000, 16, LRUEviction())
    elapsed = time.perf_counter() - t0
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and used < 20e6, (elapsed, used)
    assert kv.num_free_blocks == 1_000_000 and len(kv.blocks) == 1_000_000
    a = state_of(Request("a", 0.0, 40, 2), 16)
    b = state_of(Request("b", 0.0, 20, 2), 16)
    assert kv.admit(a, 40, 0.0) and kv.admit(b, 20, 0.0)
    assert kv.block_table("a") == [0, 1, 2] and kv.block_table("b") == [3, 4]
    kv.free(a, 1.0)
    c = state_of(Request("c", 0.0, 16 * 3, 2), 16)
    assert kv.admit(c, 16, 1.0)
    assert kv.block_table("c") == [5]  # never-used blocks first, then freed ones in order (one deque's order)
    kv.check_invariants()
    assert kv.blocks[999_999].ref_count == 0 and kv.blocks[-1].id == 999_999
