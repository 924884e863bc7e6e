"""Parallel deployments in the simulator: collectives (measured tables, link model), MoE expert load, the pipeline's
stage reservations, per-device pool sizing, and TP / PP / DP x EP runs end to end (every request accounted, no
block leaked, fast-forward on and off byte-identical)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core import arithmetic as ar
from core.specs import HardwareSpec, ModelSpec
from experiments.build import build_loop
from experiments.config import KVConfig, ParallelConfig, QuantSpec, RunConfig, conf_option, num_kv_blocks, shared_data
from sim.clock import run_virtual
from sim.cost.base import decode_features, prefill_features
from sim.cost.comm import Comm, Curve, read_tables
from sim.cost.moe import MoELoad, expected_max_binomial
from sim.cost.roofline import RooflineCostModel
from sim.pipeline import Pipeline
from tests.sim.test_fast_forward import compose_cfg, run_both

H100 = HardwareSpec.from_mapping(conf_option("hardware", "h100"))
LLAMA2_70B = ModelSpec.from_config(conf_option("model", "llama2_70b"))
QWEN3_MOE = ModelSpec.from_config(conf_option("model", "qwen3_30b_a3b"))
NETWORK = shared_data("gpu-measurements", "vidur", "network")


# ---- collectives --------------------------------------------------------------------------------------------------
def test_curve_interpolates_floors_and_extends():
    c = Curve((100.0, 200.0, 300.0), (1.0, 2.0, 4.0))
    assert c(50) == 1.0 and c(150) == 1.5 and c(300) == 4.0
    assert c(400) == pytest.approx(4.0 + 100 * 2.0 / 100)  # the last segment's slope (the tail: one segment)


def test_measured_tables_are_the_files_medians():
    curves = read_tables(NETWORK / "h100_dgx")
    assert {w for (name, w) in curves if name == "all_reduce"} == {2, 4, 8}
    comm = Comm.of(H100, NETWORK)
    assert comm.profile == "h100_dgx"
    # rows 0 of the file: 8 workers, 2048 bytes, median 0.037 ms
    assert comm.all_reduce_s(2048, 8) == pytest.approx(0.037e-3)
    assert comm.all_reduce_s(67108864, 2) == pytest.approx(0.245e-3)
    assert comm.all_reduce_s(1e6, 1) == 0.0


def test_link_model_where_no_table():
    hw = HardwareSpec("x", 1e15, 1e12, 80e9, interconnect_bw=100e9, interconnect_latency_s=5e-6)
    comm = Comm.of(hw, NETWORK)  # no network_profile: the link everywhere
    assert comm.all_reduce_s(1e6, 4) == pytest.approx(6 * 5e-6 + 6 / 4 * 1e6 / 100e9)
    assert comm.send_recv_s(1e6) == pytest.approx(5e-6 + 1e6 / 100e9)
    assert comm.all_gather_s(1e6, 4) == pytest.approx(3 * (5e-6 + 1e6 / 100e9))  # each rank receives 3 x 1 MB
    assert Comm.of(H100, NETWORK).all_reduce_s(1e6, 16) == pytest.approx(30 * 5e-6 + 30 / 16 * 1e6 / 450e9)


# ---- MoE load -----------------------------------------------------------------------------------------------------
def test_expected_busiest_group_by_hand_and_by_draws():
    assert expected_max_binomial(1, 0.5, 2) == pytest.approx(0.75)  # 1 - P(both 0) = 1 - 1/4
    # P(max >= 1) = 1 - 1/16, P(max >= 2) = 1 - P(both <= 1) = 1 - (3/4)^2: E = 15/16 + 7/16
    assert expected_max_binomial(2, 0.5, 2) == pytest.approx(15 / 16 + 7 / 16)
    rng = np.random.default_rng(0)
    draws = rng.binomial(800, 1 / 8, size=(20000, 8)).max(axis=1).mean()
    assert expected_max_binomial(800, 1 / 8, 8) == pytest.approx(draws, rel=0.01)
    load = MoELoad(128, 8, ep=8)
    assert load.busiest_pairs(100) == pytest.approx(expected_max_binomial(800, 1 / 8, 8))
    assert load.busiest_pairs(100) > 100  # above the mean of 800 / 8
    assert MoELoad(128, 8).busiest_pairs(100) == 800.0  # one group: every pair
    assert MoELoad(128, 8, ep=8, imbalance=1.5).busiest_pairs(100) == 150.0
    assert load.experts_touched(1) == pytest.approx(8 / 8)  # one token: its k experts spread over 8 groups
    assert load.experts_touched(10**6) == pytest.approx(16.0)  # every local expert
    with pytest.raises(ValueError, match="moe_imbalance"):
        MoELoad(8, 2, 2, imbalance=0.5)


def test_expert_parallel_cost_model():
    """ep = tp within one dp rank: the tp ranks hold every token, so the experts' outputs combine in the tp
    all-reduce as without ep; with dp ranks each MoE layer all-gathers the ranks' activations and reduce-scatters
    the outputs (vLLM's default allgather_reducescatter exchange), by hand on the measured DGX-H100 link."""
    tp2 = RooflineCostModel(QWEN3_MOE, H100, tp=2, network_dir=str(NETWORK))
    ep2 = RooflineCostModel(QWEN3_MOE, H100, tp=2, ep=2, network_dir=str(NETWORK))
    f = decode_features(64, 1000)
    b_tp, b_ep = tp2.breakdown(f), ep2.breakdown(f)
    assert b_tp["all_to_all"] == b_ep["all_to_all"] == 0.0 and b_ep["allreduce"] == b_tp["allreduce"]
    assert sum(b_ep.values()) == pytest.approx(ep2.step_time(f))
    # the busiest group's expected pairs: the expert FLOPs of ep=2 exceed half of the one group's
    assert ep2.ops(f)["moe"].flops > 0.5 * 2 * tp2.ops(f)["moe"].flops / 2
    dp_ep = RooflineCostModel(QWEN3_MOE, H100, dp=2, ep=2, network_dir=str(NETWORK))
    row = QWEN3_MOE.hidden_size * 2
    exchange = dp_ep.comm_times(f)["all_to_all"]
    layers = QWEN3_MOE.num_layers
    assert exchange == pytest.approx(2 * layers * (H100.interconnect_latency_s + 64 * row / H100.interconnect_bw))
    assert dp_ep.comm_times(f)["allreduce"] == 0.0  # tp 1: no tp all-reduce; the MoE layers exchange instead
    with pytest.raises(ValueError, match="parallel.ep"):
        RooflineCostModel(LLAMA2_70B, H100, tp=2, ep=2)


def test_dp_ranks_meet_at_the_moe_layers():
    cm = RooflineCostModel(QWEN3_MOE, H100, dp=2, ep=2, network_dir=str(NETWORK))
    a, b = decode_features(32, 500), decode_features(8, 500)
    both = cm.group_step_time([a, b])
    assert both == pytest.approx(sum(cm.stage_times(a, 40)) + cm.overhead_s)  # the slowest rank, all 40 tokens
    assert cm.group_step_time([a, a]) > both > cm.group_step_time([a, decode_features(0, 0)])
    assert cm.group_step_time([decode_features(0, 0)] * 2) == cm.overhead_s


# ---- pipeline -----------------------------------------------------------------------------------------------------
def test_pipeline_reservations_by_hand():
    p = Pipeline(2)
    assert p.run(0.0, [1.0, 2.0]) == 3.0  # stage 0 in [0, 1], stage 1 in [1, 3]
    assert p.run(0.0, [1.0, 2.0]) == 5.0  # waits for stage 0 until 1, stage 1 until 3
    assert p.wait_s == 1.0 + 1.0
    assert p.run(10.0, [1.0, 1.0], overhead_s=0.5) == 12.5
    assert p.busy_s == [3.0, 5.0] and p.idle_s() == [9.5, 7.5]


def test_stages_split_the_one_stage_step():
    one = RooflineCostModel(LLAMA2_70B, H100, tp=4, network_dir=str(NETWORK))
    two = RooflineCostModel(LLAMA2_70B, H100, tp=4, pp=2, network_dir=str(NETWORK))
    f = prefill_features(512)
    stages = two.stage_times(f)
    send = two.comm.send_recv_s(512 * 8192 * 2)
    assert len(stages) == 2 and send > 0
    assert sum(stages) == pytest.approx(one.step_time(f) - one.overhead_s + send, rel=1e-9)
    assert ar.stage_layers(LLAMA2_70B, 3) == [range(0, 27), range(27, 54), range(54, 80)]


# ---- pool per device ----------------------------------------------------------------------------------------------
def test_kv_pool_per_device_by_hand():
    kv, q = KVConfig(), QuantSpec()
    w, kv_tok = ar.weight_bytes(LLAMA2_70B), ar.kv_bytes_per_token(LLAMA2_70B)  # 80 layers, 8 KV heads
    assert w > 80e9 * 0.9  # 138 GB: no single device holds it
    with pytest.raises(ValueError, match="does not fit"):
        num_kv_blocks(kv, q, LLAMA2_70B, H100)
    tp4 = num_kv_blocks(kv, q, LLAMA2_70B, H100, ParallelConfig(tp=4))
    per_device = ar.weight_bytes_per_device(LLAMA2_70B, tp=4)
    assert per_device == pytest.approx(w / 4, rel=1e-3)  # norms replicated: a hair above a quarter
    assert tp4 == math.floor((80e9 * 0.9 - per_device) / (kv_tok / 4 * 16))
    pp2 = num_kv_blocks(kv, q, LLAMA2_70B, H100, ParallelConfig(tp=2, pp=2))
    assert pp2 == pytest.approx(tp4, rel=0.01)  # half the layers of half the heads: about the same
    moe = ar.weight_bytes_per_device(QWEN3_MOE, tp=1, moe_ranks=4)
    assert moe < ar.weight_bytes(QWEN3_MOE) / 2  # experts over 4 ranks, attention whole on each


# ---- end to end ---------------------------------------------------------------------------------------------------
RUNS = {
    "tp4": ["model=llama2_70b", "parallel.tp=4"],
    "tp2_pp2": ["model=llama2_70b", "parallel.tp=2", "parallel.pp=2"],
    "moe_tp2_ep2": ["model=qwen3_30b_a3b", "parallel.tp=2", "parallel.ep=2"],
    "moe_dp2_ep2": ["model=qwen3_30b_a3b", "parallel.dp=2", "parallel.ep=2"],
    "mixtral_tp4_ep4": ["model=mixtral_8x7b", "parallel.tp=4", "parallel.ep=4"],
    "mixtral_tp2_pp2": ["model=mixtral_8x7b", "parallel.tp=2", "parallel.pp=2"],
    "mla_dp2_ep2": ["model=deepseek_v2_lite", "parallel.dp=2", "parallel.ep=2"],
    "mla_tp2_pp3": ["model=deepseek_v2_lite", "parallel.tp=2", "parallel.pp=3"],
}
COMMON = ["hardware=h100", "cost_model=roofline", "workload.num_requests=60", "workload.arrival.rate_rps=30",
          "kv.num_blocks=400", "replicas=2"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_parallel_runs_account_for_every_request(name):
    run = RunConfig.from_config(compose_cfg([*COMMON, *RUNS[name]]))
    loop = build_loop(run)
    res = run_virtual(loop)
    par = run.parallel
    assert len(loop.replicas) == 2 * par.pp * par.dp
    assert len(res.states) == 60 and all(s.status.name == "FINISHED" for s in res.states)
    for r in loop.replicas:
        r.kv.check_invariants()
        assert not r.kv._tables  # no request holds a block
    used = {rec.replica for rec in res.steps}
    assert used == set(range(len(loop.replicas)))  # every virtual engine / rank ran


@pytest.mark.parametrize("name", ["tp4", "tp2_pp2", "moe_tp2_ep2", "moe_dp2_ep2", "mixtral_tp4_ep4", "mla_dp2_ep2"])
def test_parallel_runs_fast_forward_identical(tmp_path, name):
    run_both(tmp_path, [*COMMON, *RUNS[name]])


def test_refused_combinations():
    with pytest.raises(ValueError, match="parallel.pp > 1 with parallel.dp > 1"):
        build_loop(RunConfig.from_config(compose_cfg([*COMMON, "model=qwen3_30b_a3b", "parallel.pp=2",
                                                      "parallel.dp=2", "parallel.ep=2"])))
    with pytest.raises(ValueError, match="cost_model LinearCostModel"):  # no stage_times: not a StagedCostModel
        build_loop(RunConfig.from_config(compose_cfg(["hardware=h100", "model=llama2_70b", "cost_model=linear",
                                                      "parallel.pp=2", "kv.num_blocks=100"])))


PROFILED = NETWORK.parent.parent / "llmservingsim"
PROFILED_RUNS = {  # the published RTX PRO 6000 bundles: TP 1 tables for pp and dp x ep, TP 2 for tp x pp
    "llama_pp2": ["model=llama3_1_8b", "parallel.pp=2"],
    "llama_tp2_pp2": ["model=llama3_1_8b", "parallel.tp=2", "parallel.pp=2"],
    "qwen_moe_dp2_ep2": ["model=qwen3_30b_a3b", "parallel.dp=2", "parallel.ep=2"],
    "qwen_moe_tp2_ep2": ["model=qwen3_30b_a3b", "parallel.tp=2", "parallel.ep=2"],
}


@pytest.mark.skipif(not PROFILED.is_dir(), reason="shared/data/gpu-measurements/llmservingsim not present")
@pytest.mark.parametrize("name", sorted(PROFILED_RUNS))
def test_profiled_parallel_runs_account_for_every_request(name):
    """cost_model=profiled runs pipeline stages and lockstep dp ranks from the published tables end to end."""
    run = RunConfig.from_config(compose_cfg(["hardware=rtxpro6000", "cost_model=profiled", "scheduler=vllm_v1",
                                             "workload.num_requests=40", "workload.arrival.rate_rps=20",
                                             "kv.num_blocks=400", "replicas=1", *PROFILED_RUNS[name]]))
    loop = build_loop(run)
    res = run_virtual(loop)
    par = run.parallel
    assert len(loop.replicas) == par.pp * par.dp
    assert len(res.states) == 40 and all(s.status.name == "FINISHED" for s in res.states)
    for r in loop.replicas:
        r.kv.check_invariants()
        assert not r.kv._tables
    assert {rec.replica for rec in res.steps} == set(range(len(loop.replicas)))
    cost = loop.executors[0].cost_model
    assert cost.pp == par.pp and cost.dp == par.dp and cost.ep == par.ep
    assert dict(cost.beyond) == {} and cost.priced > 0  # every step inside the tables' grid

