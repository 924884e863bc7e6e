"""PD disaggregation on the real engine: the KV really moves between two replicas' tensors, and greedy outputs are
token-identical to transformers and to the colocated engine (chunked prefills, prefix hits on the prefill side, a
decode pool that makes transfers wait, int8 KV with its scales); transfer times are measured."""

from __future__ import annotations

import pytest
import torch

from core.disagg import PDServingLoop
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from engine.loader import load_model
from engine.transfer import TorchKVTransport
from policies.eviction.lru import LRUEviction
from policies.placement.least_loaded import LeastLoadedPlacement
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from tests.engine.checkpoints import TINY, tiny_checkpoint
from tests.helpers import ListWorkload

BLOCK = 4
NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf, path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    spec = ModelSpec.from_pretrained(path)
    model = load_model(path, spec)
    g = torch.Generator().manual_seed(11)
    system = torch.randint(0, TINY["vocab_size"], (13,), generator=g).tolist()  # shared: prefix hits
    prompts = [system + torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (3, 9, 14)]
    prompts += [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (5, 21, 2)]
    reqs = [Request(f"r{i}", 0.002 * i, len(p), NEW, prompt_token_ids=tuple(p)) for i, p in enumerate(prompts)]
    with torch.no_grad():
        expected = {r.id: hf.generate(torch.tensor([r.prompt_token_ids]), max_new_tokens=NEW, do_sample=False)
                    [0, r.prompt_len:].tolist() for r in reqs}
    return spec, model, reqs, expected


def serve(setup, pd: tuple[int, int] | None, budget=64, pools=(64,), kv_dtype="auto"):
    """Run the requests on a colocated replica (pd None) or a (prefill, decode) cluster; returns the loop and the
    outputs by request id."""
    spec, model, reqs, _ = setup
    n = 1 if pd is None else sum(pd)
    sizes = [pools[min(i, len(pools) - 1)] for i in range(n)]
    kvs = [KVCacheManager(s, BLOCK, LRUEviction()) for s in sizes]
    reps = [Replica(i, SarathiScheduler(), kv, SchedulerLimits(budget, 8, spec.max_model_len))
            for i, kv in enumerate(kvs)]
    exs = [build_engine_executor(spec, kv_manager=kv, model=model, kv_dtype=kv_dtype) for kv in kvs]
    if pd is None:
        loop = ServingLoop(reps, exs, RoundRobinRouter(), ListWorkload(reqs))
    else:
        loop = PDServingLoop(reps, exs, RoundRobinRouter(), ListWorkload(reqs), num_prefill=pd[0],
                             placement=LeastLoadedPlacement(), transport=TorchKVTransport([e.runner for e in exs]))
    result = run_virtual(loop)
    for kv in kvs:
        kv.check_invariants()
        assert kv.num_used_blocks == 0
    assert all(s.status is Status.FINISHED for s in result.states)
    return loop, {s.id: s.output_token_ids for s in result.states}


@pytest.mark.parametrize(("pd", "budget"), [((1, 1), 64), ((1, 2), 8), ((2, 1), 5)])
def test_pd_outputs_match_transformers_and_colocated(setup, pd, budget):
    _, expected = setup[2], setup[3]
    loop, outputs = serve(setup, pd, budget)
    assert outputs == expected
    assert outputs == serve(setup, None, budget)[1]
    assert len(loop.transfers) == len(expected)
    assert all(t.transfer_s > 0 for t in loop.transfers)  # a measured copy
    for state in (t.state for t in loop.transfers):
        assert state.first_token_s == next(t.end_s for t in loop.transfers if t.state is state)


def test_prefix_hits_stay_on_the_prefill_side(setup):
    loop, outputs = serve(setup, (1, 1))
    states = {t.state.id: t.state for t in loop.transfers}
    assert states["r2"].num_cached_tokens == 12  # 13 shared tokens: 3 whole blocks of 4 reused on the prefill replica
    assert outputs == setup[3]


def test_transfers_wait_for_a_small_decode_pool(setup):
    # decode pool of 8 blocks (32 tokens): the 34-token request fills most of it, so others wait for its end
    loop, outputs = serve(setup, (1, 1), pools=(64, 8))
    assert outputs == setup[3]
    assert any(t.kv_wait_s > 0 for t in loop.transfers)


def test_int8_kv_moves_with_its_scales(setup):
    assert serve(setup, (1, 1), kv_dtype="int8")[1] == serve(setup, None, kv_dtype="int8")[1]


def test_copy_moves_exactly_the_blocks(setup):
    spec, model = setup[0], setup[1]
    kvs = [KVCacheManager(6, BLOCK, LRUEviction()) for _ in range(2)]
    runners = [build_engine_executor(spec, kv_manager=kv, model=model).runner for kv in kvs]
    g = torch.Generator().manual_seed(0)
    for src, dst in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        # the pools start uninitialised: a NaN there would make torch.equal fail on an exact copy
        src.k.copy_(torch.randn(src.k.shape, generator=g)), src.v.copy_(torch.randn(src.v.shape, generator=g))
        dst.k.zero_(), dst.v.zero_()
    seconds = TorchKVTransport(runners).transfer(0, 1, [4, 1], [0, 5], 7)
    assert seconds > 0
    for a, b in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        assert torch.equal(b.k[0], a.k[4]) and torch.equal(b.v[5], a.v[1])
        assert not b.k[1:5].any()  # nothing else written
