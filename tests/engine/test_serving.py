"""The engine served through the shared replica core and driver: greedy outputs are token-identical to
transformers under every scheduler, chunk size, prefix caching on/off and forced preemption; prefix hits skip
compute; tenants never share KV; bad requests are rejected while the rest are served."""

from __future__ import annotations

import pytest
import torch

from core.kv_cache import PROMPT, VLLM, KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from engine.loader import load_model
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.lpm import LPMScheduler
from policies.schedulers.orca import OrcaScheduler
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.static import StaticScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from policies.schedulers.vllm_v1 import VLLMv1Scheduler
from sim.clock import run_virtual
from tests.engine.checkpoints import TINY, tiny_checkpoint
from tests.helpers import ListWorkload

BLOCK = 4
NEW = 6
WHOLE = 512


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(tmp_path_factory, request):
    """A tiny checkpoint (Llama or Qwen2 layout), its loaded model, requests with shared prefixes, and HF's greedy
    outputs."""
    hf, path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    spec = ModelSpec.from_pretrained(path)
    model = load_model(path, spec)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, TINY["vocab_size"], (13,), generator=g).tolist()  # shared, not block-aligned
    prompts = [system + torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (3, 9, 1, 14)]
    prompts += [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 21)]
    reqs = [Request(f"r{i}", 0.002 * i, len(p), NEW, prompt_token_ids=tuple(p)) for i, p in enumerate(prompts)]
    expected = {}
    with torch.no_grad():
        for r in reqs:
            out = hf.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=NEW, do_sample=False)
            expected[r.id] = out[0, r.prompt_len:].tolist()
    return spec, model, reqs, expected


def serve(setup, scheduler, budget, num_blocks=64, prefix_caching=True, requests=None, prefix_cache_mode=PROMPT):
    spec, model, reqs, _ = setup
    kv = KVCacheManager(num_blocks, BLOCK, LRUEviction(), prefix_caching, prefix_cache_mode=prefix_cache_mode)
    replica = Replica(0, scheduler, kv, SchedulerLimits(budget, 8, spec.max_model_len))
    executor = build_engine_executor(spec, kv_manager=kv, model=model)
    result = run_virtual(ServingLoop([replica], [executor], RoundRobinRouter(), ListWorkload(requests or reqs)))
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    return {s.id: s for s in result.states}, result


def assert_matches_hf(states, expected):
    for rid, tokens in expected.items():
        assert states[rid].status is Status.FINISHED, states[rid].reason
        assert states[rid].output_token_ids == tokens, rid


@pytest.mark.parametrize("budget", [1, 7, 64, WHOLE])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks of 4 tokens forces preemption
def test_sarathi_any_chunk_size_matches_hf(setup, budget, prefix_caching, num_blocks):
    states, res = serve(setup, SarathiScheduler(), budget, num_blocks, prefix_caching)
    assert_matches_hf(states, setup[3])
    if budget > 1:  # mixed steps: prefill chunks and decodes in one forward
        assert any(f.num_prefill_tokens and f.num_decode_seqs for f in (s.features for s in res.steps))


@pytest.mark.parametrize("budget", [7, 64])
def test_outputs_survive_recompute_preemption(setup, budget):
    """Everything arrives at once into a 14-block pool: running requests outgrow it and are preempted
    (independent of measured step times), and recomputed outputs still match transformers."""
    spec, model, reqs, expected = setup
    burst = [Request(r.id, 0.0, r.prompt_len, NEW, prompt_token_ids=r.prompt_token_ids) for r in reqs]
    states, _ = serve(setup, SarathiScheduler(), budget, num_blocks=14, requests=burst)
    assert sum(s.num_preemptions for s in states.values()) > 0
    assert_matches_hf(states, expected)


@pytest.mark.parametrize("scheduler", [StaticScheduler, OrcaScheduler, VLLMPrefillFirstScheduler,
                                       PriorityScheduler, LPMScheduler], ids=lambda c: c.__name__)
@pytest.mark.parametrize("num_blocks", [64, 14])
def test_every_scheduler_matches_hf(setup, scheduler, num_blocks):
    states, _ = serve(setup, scheduler(), 64, num_blocks)
    assert_matches_hf(states, setup[3])


@pytest.mark.parametrize("mode", [PROMPT, VLLM])
@pytest.mark.parametrize("num_blocks", [64, 14])
def test_vllm_v1_matches_hf_with_either_prefix_cache_mode(setup, mode, num_blocks):
    """Everything at once: in vllm mode later requests reuse blocks an earlier one computes in the same step, and
    preempted ones resume from their generated tokens' cached blocks (14 blocks) -- the KV read is still right."""
    spec, model, reqs, expected = setup
    burst = [Request(r.id, 0.0, r.prompt_len, NEW, prompt_token_ids=r.prompt_token_ids) for r in reqs]
    states, _ = serve(setup, VLLMv1Scheduler(long_prefill_token_threshold=5), 64, num_blocks, requests=burst,
                      prefix_cache_mode=mode)
    assert_matches_hf(states, expected)
    assert (sum(s.num_preemptions for s in states.values()) > 0) == (num_blocks == 14)
    if mode == VLLM:
        assert sum(s.num_cached_tokens for s in states.values()) >= 12  # same-step hits on the shared prompt


def test_prefix_hits_skip_compute_with_the_same_outputs(setup):
    on, res_on = serve(setup, SarathiScheduler(), 64, prefix_caching=True)
    off, res_off = serve(setup, SarathiScheduler(), 64, prefix_caching=False)
    computed_on = sum(s.features.num_batched_tokens for s in res_on.steps)
    computed_off = sum(s.features.num_batched_tokens for s in res_off.steps)
    cached = sum(s.num_cached_tokens for s in on.values())
    assert cached >= 12  # later requests of the shared-system-prompt group reuse its 3 full blocks
    assert computed_off - computed_on == cached
    assert {k: s.output_token_ids for k, s in on.items()} == {k: s.output_token_ids for k, s in off.items()}


def test_tenants_never_share_kv(setup):
    spec, model, reqs, expected = setup
    twin = [Request(f"{t}-{r.id}", r.arrival_s + (0.5 if t == "b" else 0), r.prompt_len, NEW,
                    prompt_token_ids=r.prompt_token_ids, tenant=t) for t in ("a", "b") for r in reqs[:2]]
    states, _ = serve(setup, SarathiScheduler(), 64, requests=twin)
    assert all(s.num_cached_tokens == 0 for rid, s in states.items() if rid.startswith("b-r0"))
    for rid, s in states.items():
        assert s.output_token_ids == expected[rid.split("-")[1]]


def test_bad_requests_are_rejected_and_the_rest_served(setup):
    spec, model, reqs, expected = setup
    too_long = Request("too_long", 0.0, spec.max_model_len, NEW, prompt_token_ids=(1,) * spec.max_model_len)
    too_big_for_pool = Request("pool", 0.0, 60, NEW, prompt_token_ids=(2,) * 60)
    states, _ = serve(setup, SarathiScheduler(), 64, num_blocks=14, requests=[too_long, too_big_for_pool, *reqs])
    assert states["too_long"].status is Status.REJECTED and "max_model_len" in states["too_long"].reason
    assert states["pool"].status is Status.REJECTED and "KV blocks" in states["pool"].reason
    assert_matches_hf({k: v for k, v in states.items() if k in expected}, expected)
