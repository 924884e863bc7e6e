"""The published-profile cost model (sim/cost/profiled.py) against the tables' own rows, hand sums and synthetic
tables with known interpolation errors."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir

from core.batch import StepFeatures
from core.specs import HardwareSpec, ModelSpec
from experiments.build import CONF_DIR, build_executors, build_replicas
from experiments.config import RunConfig, shared_data
from sim.cost.base import decode_features
from sim.cost.moe import MoELoad
from sim.cost.profile_tables import (
    ABOVE,
    BELOW,
    GRID,
    AttentionPoint,
    AttentionTable,
    Curve,
    activated_experts,
    attention_held_out,
    curve_held_out,
    equivalent_chunk,
    find_profile,
    held_out_errors,
    load_tables,
)
from sim.cost.profiled import OperatorProfileCostModel

try:
    ROOT = shared_data("gpu-measurements", "llmservingsim")
except FileNotFoundError:
    ROOT = Path("/nonexistent")
PRO = ROOT / "RTXPRO6000" / "meta-llama" / "Llama-3.1-8B" / "bf16"
needs_data = pytest.mark.skipif(not PRO.is_dir(), reason="shared/data/gpu-measurements/llmservingsim not present")
US = 1e-6


def conf(group: str, name: str) -> dict:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={name}"])
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg[group], resolve=True)


def llama() -> ModelSpec:
    return ModelSpec.from_mapping(conf("model", "llama3_1_8b"))


def hw(name: str = "rtxpro6000") -> HardwareSpec:
    return HardwareSpec.from_mapping(conf("hardware", name))


def rows_of(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def dense_row(d: Path, layer: str, tokens: int) -> float:
    return next(float(r["time_us"]) for r in rows_of(d / "dense.csv") if r["layer"] == layer
                and int(r["tokens"]) == tokens) * US


def seq_row(d: Path, layer: str, seqs: int) -> float:
    return next(float(r["time_us"]) for r in rows_of(d / "per_sequence.csv") if r["layer"] == layer
                and int(r["sequences"]) == seqs) * US


def attn_row(d: Path, pc: int, kp: int, nd: int, kd: int) -> float:
    return next(float(r["time_us"]) for r in rows_of(d / "attention.csv")
                if (int(r["prefill_chunk"]), int(r["kv_prefill"]), int(r["n_decode"]), int(r["kv_decode"]))
                == (pc, kp, nd, kd)) * US


# ---- interpolation --------------------------------------------------------------------------------------------------
@needs_data
def test_attention_rows_come_back_exactly():
    table = load_tables(str(PRO.resolve()), 1).attention
    rows = rows_of(PRO / "tp1" / "attention.csv")
    for r in rows[::97]:  # ~200 rows across every slice kind, both grids
        q = AttentionPoint(float(r["prefill_chunk"]), float(r["kv_prefill"]), int(r["n_decode"]), float(r["kv_decode"]))
        value, _, status = table.lookup(q)
        assert status == GRID
        assert value == pytest.approx(float(r["time_us"]) * US, rel=1e-12)


@needs_data
def test_attention_is_monotone_between_rows():
    """Along each axis, values between two profiled rows lie between them and move one way."""
    table = load_tables(str(PRO.resolve()), 1).attention
    d = PRO / "tp1"
    cases = [  # (row a, row b, axis that varies)
        ((0, 0, 64, 1024), (0, 0, 64, 2048), 3), ((0, 0, 32, 2048), (0, 0, 64, 2048), 2),
        ((512, 1024, 8, 256), (512, 2048, 8, 256), 1), ((512, 0, 8, 256), (1024, 0, 8, 256), 0),
    ]
    for a, b, axis in cases:
        va, vb = attn_row(d, *a), attn_row(d, *b)
        got = []
        for w in np.linspace(0, 1, 9):
            q = [float(x) for x in a]
            q[axis] = a[axis] + w * (b[axis] - a[axis])
            got.append(table.lookup(AttentionPoint(q[0], q[1], int(q[2]), q[3]))[0])
        assert got[0] == pytest.approx(va) and got[-1] == pytest.approx(vb)
        assert np.all(np.diff(got) >= 0) if vb >= va else np.all(np.diff(got) <= 0), (a, b, got)


def test_curve_is_exact_on_rows_and_linear_between():
    c = Curve.of([4, 1, 2], [40.0, 10.0, 20.0])
    assert [float(c.at(x)) for x in (1, 2, 4)] == [10.0, 20.0, 40.0]
    assert float(c.at(3)) == 30.0


def test_equivalent_chunk_keeps_tokens_and_pairs():
    n, c = 30, 100  # one chunk of 30 after 100 cached: itself
    assert equivalent_chunk(n, n * c + n * (n + 1) // 2) == (30.0, 100.0)
    # chunks (40 after 10) and (20 after 500): 60 tokens, the same pairs
    pairs = 40 * 10 + 40 * 41 // 2 + 20 * 500 + 20 * 21 // 2
    pc, kp = equivalent_chunk(60, pairs)
    assert pc == 60 and 60 * kp + 60 * 61 / 2 == pytest.approx(pairs)
    # two fresh chunks of 50: fewer pairs than one of 100, so the fresh chunk with their pairs (2 x 1275)
    pc, kp = equivalent_chunk(100, 2 * 50 * 51 // 2)
    assert kp == 0 and pc * (pc + 1) / 2 == pytest.approx(2 * 1275)


# ---- outside the grid -----------------------------------------------------------------------------------------------
@needs_data
def test_beyond_the_grid_scales_the_edge_by_the_roofline_and_is_counted():
    cm = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    table = cm.tables.attention
    edge = AttentionPoint(0.0, 0.0, 64, 16384.0)
    far = AttentionPoint(0.0, 0.0, 64, 30000.0)
    value, clamped, status = table.lookup(far)
    assert status == ABOVE and clamped == edge and value == table.lookup(edge)[0]
    got = cm._attention_at(far)
    per_kv = 2 * 8 * 128 * 2  # K and V of one layer's 8 KV heads, bf16, per token
    bw = hw().mem_bw * cm.roofline.bw_eff  # decode attention is memory-bound in the roofline
    ratio = (per_kv * 64 * 30001 / bw) / (per_kv * 64 * 16385 / bw)
    assert got == pytest.approx(value * ratio, rel=1e-9)
    assert cm.beyond["attention"] == 1
    # dense rows beyond 2048 tokens: scaled from the edge, continuous there
    assert cm.dense_time(2049) == pytest.approx(cm.dense_time(2048), rel=2e-3) and cm.beyond["dense"] == 1
    assert cm.coverage()["beyond_grid"] == {"attention": 1, "dense": 1}


@needs_data
def test_below_the_grid_holds_the_smallest_row():
    cm = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    tiny = cm.tables.attention.lookup(AttentionPoint(0.0, 0.0, 4, 5.0))
    assert tiny[2] == BELOW and tiny[0] == pytest.approx(attn_row(PRO / "tp1", 0, 0, 4, 16))
    cm.step_time(decode_features(4, 6))  # 4 decodes with 5 tokens of history
    assert cm.below["attention"] == 1 and not cm.beyond


# ---- composition ----------------------------------------------------------------------------------------------------
PER_LAYER = {"layernorm": 2, "qkv_proj": 1, "rotary_emb": 1, "o_proj": 1, "gate_up_proj": 1, "act_fn": 1,
             "down_proj": 1}


@needs_data
def test_a_decode_step_is_the_sum_of_its_rows():
    """4 decodes at 1024 tokens of history: every dense row at 4 tokens (embedding and final norm once, the rest
    per layer, layernorm twice), 32 x the attention row (0, 0, 4, 1024), LM head and sampler at 4 sequences."""
    d = PRO / "tp1"
    cm = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    f = decode_features(4, 1025)
    dense = dense_row(d, "embedding", 4) + dense_row(d, "final_layernorm", 4)
    dense += 32 * sum(k * dense_row(d, name, 4) for name, k in PER_LAYER.items())
    want = dense + 32 * attn_row(d, 0, 0, 4, 1024) + seq_row(d, "lm_head", 4) + seq_row(d, "sampler", 4)
    assert cm.step_time(f) == pytest.approx(want, rel=1e-12)
    assert sum(cm.breakdown(f).values()) == pytest.approx(want, rel=1e-12)
    assert cm.breakdown(f)["skew"] == 0.0  # equal contexts: nothing to correct


@needs_data
def test_a_mixed_step_interpolates_dense_rows_by_tokens():
    """A 512-token chunk after 1024 cached tokens plus 4 decodes at 1024: 516 tokens lie between the dense rows at
    512 and 528; attention is the row (512, 1024, 4, 1024); 5 sequences for the LM head."""
    d = PRO / "tp1"
    cm = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    f = StepFeatures(num_seqs=5, num_batched_tokens=516, num_prefill_seqs=1, num_prefill_tokens=512,
                     attention_pairs=512 * 1024 + 512 * 513 // 2, prefill_kv_tokens=1536, num_decode_seqs=4,
                     kv_tokens_read=4 * 1025, max_context_len=1536, max_decode_context=1025, min_decode_context=1025)

    def at516(name: str) -> float:
        a, b = dense_row(d, name, 512), dense_row(d, name, 528)
        return a + (516 - 512) / 16 * (b - a)

    dense = at516("embedding") + at516("final_layernorm") + 32 * sum(k * at516(n) for n, k in PER_LAYER.items())
    want = dense + 32 * attn_row(d, 512, 1024, 4, 1024) + seq_row(d, "lm_head", 5) + seq_row(d, "sampler", 5)
    # 516 tokens: above vLLM's CUDA-graph ceiling (512 without scheduler limits), so the step runs eagerly and
    # launches its 32 x 12 + 1 + 4 kernels at hardware.kernel_launch_s (4 us) each
    launches = (32 * 12 + 5) * 4e-6
    assert cm.breakdown(f)["kernels"] == pytest.approx(launches, rel=1e-12)
    assert cm.step_time(f) == pytest.approx(want + launches, rel=1e-9)
    graphed = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), cuda_graph_max_tokens=1024)
    assert graphed.step_time(f) == pytest.approx(want, rel=1e-9)


@needs_data
def test_uneven_decodes_add_the_buckets_alpha_of_the_mean_to_max_gap():
    d = PRO / "tp1"
    cm = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    # 8 decodes: 6 with 511 tokens of history, 2 with 2047 (contexts 512 and 2048)
    f = StepFeatures(num_seqs=8, num_batched_tokens=8, num_decode_seqs=8, kv_tokens_read=6 * 512 + 2 * 2048,
                     max_context_len=2048, max_decode_context=2048, min_decode_context=512)
    mean_kd = (6 * 512 + 2 * 2048) / 8 - 1
    rate = (mean_kd - 511) / (2047 - 511)  # 0.25
    alphas = {(r["pc"], r["n_label"], r["skew_rate_label"], r["kv_big_label"], r["kp_label"]): float(r["alpha"])
              for r in rows_of(d / "skew_fit.csv")}
    meta = yaml.safe_load((PRO / "meta.yaml").read_text())
    alpha = alphas.get(("0", "n<=8", "sr<=40%", "kvB<=4k", "kp=0"), meta["skew_fit"]["per_tp"][1]["alpha_default"])
    assert 0.15 < rate <= 0.4
    table = cm.tables.attention
    t_mean = table.lookup(AttentionPoint(0.0, 0.0, 8, mean_kd))[0]
    t_max = table.lookup(AttentionPoint(0.0, 0.0, 8, 2047.0))[0]
    assert cm.breakdown(f)["skew"] == pytest.approx(32 * alpha * (t_max - t_mean), rel=1e-12)
    assert cm.breakdown(f)["attention"] == pytest.approx(32 * t_mean, rel=1e-12)
    off = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), skew=False)
    assert off.step_time(f) == pytest.approx(cm.step_time(f) - 32 * alpha * (t_max - t_mean), rel=1e-12)


@needs_data
def test_tp2_prices_per_rank_rows_plus_link_allreduces():
    """The RTX PRO 6000 has no NCCL table: two all-reduces per layer on its PCIe link, by hand."""
    cm1 = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    cm2 = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), tp=2)
    f = decode_features(16, 1025)
    b1, b2 = cm1.breakdown(f), cm2.breakdown(f)
    assert b2["gate_up_proj"] < 0.6 * b1["gate_up_proj"]  # half-width shards
    assert b2["layernorm"] == b1["layernorm"]  # TP-stable rows are tp1's copies
    hidden_bytes = 16 * 4096 * 2
    # ring over 2 ranks: 2 (2 - 1) hops x 20 us + 2 (2 - 1) / 2 x bytes / 16 GB/s, twice per layer, 32 layers
    assert hw().interconnect_bw == 16e9 and hw().interconnect_latency_s == 20e-6
    want = 2 * 32 * (2 * 20e-6 + hidden_bytes / 16e9)
    assert b2["allreduce"] == pytest.approx(want, rel=1e-12) and b1["allreduce"] == 0.0
    assert cm2.step_time(f) == pytest.approx(sum(b2.values()), rel=1e-9)


@needs_data
def test_a_measured_nccl_table_prices_the_profiled_allreduce():
    """With hardware.network_profile naming a measured table, the profiled model's all-reduce is comm.py's lookup,
    and that is the table's median linear between its two bracketing sizes."""
    network = shared_data("gpu-measurements", "vidur", "network")
    h = HardwareSpec.from_mapping({**conf("hardware", "rtxpro6000"), "network_profile": "h100_dgx"})
    cm = OperatorProfileCostModel(llama(), h, data_dir=str(ROOT), tp=2, network_dir=str(network))
    nbytes = 16 * 4096 * 2  # 131072: between the measured 124928 and 133120 bytes at 2 workers
    rows = {float(r["size"]): float(r["time_stats.all_reduce.median"]) * 1e-3
            for r in rows_of(network / "h100_dgx" / "all_reduce.csv")
            if r["rank"] == "0" and r["num_workers"] == "2" and r["devices_per_node"] == "2"}
    lo, hi = 124928.0, 133120.0
    by_hand = rows[lo] + (rows[hi] - rows[lo]) * (nbytes - lo) / (hi - lo)
    assert cm.comm.all_reduce_s(nbytes, 2) == pytest.approx(by_hand, rel=1e-12)
    assert cm.breakdown(decode_features(16, 1025))["allreduce"] == pytest.approx(2 * 32 * by_hand, rel=1e-12)
    link = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), tp=2)
    assert link.breakdown(decode_features(16, 1025))["allreduce"] != cm.breakdown(decode_features(16, 1025))[
        "allreduce"]


# ---- pipeline stages and data-parallel ranks with experts --------------------------------------------------------
@needs_data
def test_pipeline_stages_split_the_rows_by_hand():
    """pp = 2 on Llama-3.1-8B: stage 0 runs the embedding and 16 layers and sends 4 tokens' activations over the
    PCIe link; stage 1 the other 16 layers, the final norm, LM head and sampler. Without the send they sum to the
    pp = 1 step."""
    d = PRO / "tp1"
    one = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT))
    two = OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), pp=2)
    f = decode_features(4, 1025)
    layer = sum(k * dense_row(d, name, 4) for name, k in PER_LAYER.items()) + attn_row(d, 0, 0, 4, 1024)
    send = 20e-6 + 4 * 4096 * 2 / 16e9
    s0, s1 = two.stage_times(f)
    assert s0 == pytest.approx(dense_row(d, "embedding", 4) + 16 * layer + send, rel=1e-12)
    assert s1 == pytest.approx(16 * layer + dense_row(d, "final_layernorm", 4) + seq_row(d, "lm_head", 4)
                               + seq_row(d, "sampler", 4), rel=1e-12)
    assert s0 + s1 - send == pytest.approx(one.step_time(f), rel=1e-12)
    assert two.step_time(f) == pytest.approx(s0 + s1 + two.overhead_s, rel=1e-12)
    assert sum(two.breakdown(f).values()) == pytest.approx(two.step_time(f), rel=1e-12)
    assert two.breakdown(f)["send_recv"] == pytest.approx(send, rel=1e-12)
    assert two.stage_times(decode_features(0, 0)) == [0.0, 0.0]


QWEN_MOE = ROOT / "RTXPRO6000" / "Qwen" / "Qwen3-30B-A3B-Instruct-2507" / "bf16"


def qwen_moe() -> ModelSpec:
    return ModelSpec.from_mapping(conf("model", "qwen3_30b_a3b"))


@needs_data
def test_dp_ranks_with_experts_meet_at_the_moe_blocks():
    """dp = 2, ep = 2 on Qwen3-30B-A3B (128 experts, top 8): each rank holds 64 whole experts (tp x dp / ep = 1
    device per expert) and waits for the busier group: its pairs / 8 tokens over the experts of a group the 40
    tokens of both ranks touch, in moe.csv, at full width (ep / dp = 1). Each rank pays its own attention and dense
    rows; each MoE layer all-gathers the ranks' activations and reduce-scatters the outputs over the PCIe link."""
    m = qwen_moe()
    cm = OperatorProfileCostModel(m, hw(), data_dir=str(ROOT), dp=2, ep=2)
    load = MoELoad(128, 8, 2)
    x, experts = load.busiest_pairs(40) / 8, 128 / 2 * (1 - (1 - 8 / 128) ** 40)
    assert cm.moe_time(40) == pytest.approx(cm.tables.moe.at(x, experts), rel=1e-12)
    assert 40 / 2 < x < 40  # the busier of two groups gets more than half the pairs
    a, b = decode_features(30, 513), decode_features(10, 513)
    both = cm.group_step_time([a, b])
    assert both == pytest.approx(sum(cm.stage_times(a, 40)) + cm.overhead_s, rel=1e-12)  # the slower rank
    assert cm.group_step_time([a, decode_features(0, 0)]) < both
    assert cm.group_step_time([decode_features(0, 0)] * 2) == cm.overhead_s
    row = 2048 * 2
    parts = cm.stage_parts(a, 40)[0]
    assert parts["all_to_all"] == pytest.approx(2 * 48 * (20e-6 + 30 * row / 16e9), rel=1e-12)
    assert parts["allreduce"] == 0.0 and parts["send_recv"] == 0.0
    assert parts["moe"] == pytest.approx(48 * cm.moe_time(40), rel=1e-12)
    one = OperatorProfileCostModel(m, hw(), data_dir=str(ROOT))
    assert parts["attention"] == pytest.approx(one.breakdown(a)["attention"], rel=1e-12)  # its own batch only


@needs_data
def test_moe_time_at_one_group_is_the_tables_block():
    """ep = dp = 1 (pp = 2 takes the staged path): the block at the step's tokens and expected activated experts,
    as the pp = 1 step prices it."""
    m = qwen_moe()
    one = OperatorProfileCostModel(m, hw(), data_dir=str(ROOT))
    two = OperatorProfileCostModel(m, hw(), data_dir=str(ROOT), pp=2)
    f = decode_features(24, 200)
    assert two.moe_time(24) == pytest.approx(one.breakdown(f)["moe"] / 48, rel=1e-12)
    assert sum(two.stage_times(f)) - two.breakdown(f)["send_recv"] == pytest.approx(one.step_time(f), rel=1e-12)


@needs_data
def test_parallel_degrees_are_checked():
    with pytest.raises(ValueError, match="parallel.ep=2 needs an MoE model"):
        OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), dp=2, ep=2)
    with pytest.raises(ValueError, match="parallel.pp=33 stages > model.num_layers=32"):
        OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), pp=33)
    with pytest.raises(ValueError, match="parallel.dp"):
        OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), dp=0)


# ---- finding the tables ---------------------------------------------------------------------------------------------
@needs_data
def test_tables_are_found_by_normalised_names_and_errors_say_what_exists():
    assert find_profile("rtxpro6000", "llama3_1_8b", "bf16", ROOT) == PRO
    assert find_profile("RTX4090", "Llama-3.1-8B", "bf16", ROOT).parent.parent.parent.name == "RTX4090"
    with pytest.raises(ValueError, match=r"hardware.name='h100'.*available: \['RTX4090', 'RTXPRO6000'\]"):
        find_profile("h100", "llama3_1_8b", "bf16", ROOT)
    with pytest.raises(ValueError, match=r"model.name='llama3_8b'.*Qwen/Qwen3-32B"):
        find_profile("rtxpro6000", "llama3_8b", "bf16", ROOT)
    with pytest.raises(ValueError, match=r"tp=4: no tp4/.*\['tp1', 'tp2'\]"):
        OperatorProfileCostModel(llama(), hw(), data_dir=str(ROOT), tp=4)
    assert load_tables(str(PRO.resolve()), 1) is load_tables(str(PRO.resolve()), 1)  # parsed once per folder


@needs_data
def test_a_profile_of_other_shapes_is_refused():
    other = ModelSpec.from_mapping({**llama().to_dict(), "intermediate_size": 11008})
    with pytest.raises(ValueError, match="profiles other shapes"):
        OperatorProfileCostModel(other, hw(), profile=str(PRO))


@needs_data
def test_the_conf_option_instantiates_on_both_gpus():
    for gpu in ("rtxpro6000", "rtx4090"):
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["cost_model=profiled", "model=llama3_1_8b", f"hardware={gpu}",
                                               "kv.num_blocks=64"])
        run = RunConfig.from_config(cfg)  # the run builder fills in cost_model.data_dir
        cm = build_executors(run, build_replicas(run))[0].cost_model
        assert 0.005 < cm.step_time(decode_features(8, 512)) < 0.05


# ---- held-out error ------------------------------------------------------------------------------------------------
def test_curve_held_out_error_is_the_known_chord_error():
    """y = x^2 at x = 0..10: holding back x = 2, 4, 6, 8, linear interpolation from x -+ 1 gives x^2 + 1."""
    x = np.arange(11.0)
    errs = curve_held_out(Curve.of(x, x**2 + 0.0), every=2)
    assert errs == pytest.approx([1 / 4, 1 / 16, 1 / 36, 1 / 64])


def _synthetic_attention(t) -> np.ndarray:
    pcs, kps, nds, kds = [0, 16, 32, 64, 128], [0, 16, 32, 64, 128, 256], [0, 1, 2, 4, 8], [16, 32, 64, 128, 256]
    rows = []
    for pc in pcs:
        for kp in (kps if pc else [0]):
            for nd in nds:
                for kd in (kds if nd else [0]):
                    if pc or nd:
                        rows.append((pc, kp, nd, kd, t(pc, kp, nd, kd)))
    return np.array(rows, dtype=float)


def test_attention_held_out_is_exact_for_work_linear_kernels():
    """A kernel costing a + b x pairs + c x decode KV read: exact along every axis in pairs coordinates; the
    prefill-chunk axis in plain tokens is not (fresh chunks cost ~pc^2)."""
    rows = _synthetic_attention(lambda pc, kp, nd, kd: 5.0 + 0.01 * (pc * kp + pc * (pc + 1) / 2) + 0.3 * nd * (kd + 1))
    for axis in range(4):
        errs = attention_held_out(rows, axis)
        assert errs and max(map(abs, errs)) < 1e-12, axis
    linear = attention_held_out(rows, 0, pc_coordinate="linear")
    assert max(linear) > 0.01 and min(linear) >= -1e-12  # the chord over a convex cost: too high


def test_attention_lookup_rejects_unknown_coordinates():
    with pytest.raises(ValueError, match="pc_coordinate"):
        AttentionTable(_synthetic_attention(lambda *a: 1.0), "log")


@needs_data
def test_held_out_report_covers_every_table():
    errors = held_out_errors(PRO, tp=1)
    for key in ("dense (all rows)", "per_sequence lm_head", "attention kv_decode", "attention prefill_chunk",
                "skew (alpha table, in-sample)"):
        assert errors[key]["rows"] > 0 and errors[key]["median"] < 0.1, key
    assert errors["skew (alpha table, in-sample)"]["p90"] < errors["skew (no correction)"]["p90"]


# ---- MoE (synthetic bundle: no MoE ModelSpec yet) -------------------------------------------------------------------
def _bundle(tmp_path: Path, model: ModelSpec, moe: bool) -> Path:
    root = tmp_path / "GPU" / "org" / model.name / "bf16"
    d = root / "tp1"
    d.mkdir(parents=True)
    meta = {"tp_degrees": [1], "skew_fit": {"enabled": False},
            "engine_effective": {"hf_overrides": {"num_attention_heads": model.num_heads,
                                                  "num_key_value_heads": model.num_kv_heads,
                                                  "intermediate_size": model.intermediate_size,
                                                  "vocab_size": model.vocab_size}}}
    (root / "meta.yaml").write_text(yaml.safe_dump(meta))
    toks = [1, 2, 4, 8, 16, 32, 64]
    layers = ["embedding", "layernorm", "qkv_proj", "o_proj", "final_layernorm"] + ([] if moe else ["gate_up_proj"])
    (d / "dense.csv").write_text("layer,tokens,time_us\n" + "".join(f"{n},{t},{i + 1 + t / 8}\n"
                                                                   for i, n in enumerate(layers) for t in toks))
    (d / "per_sequence.csv").write_text("layer,sequences,time_us\n" + "".join(f"{n},{s},{k * (5 + s)}\n"
                                        for k, n in ((1, "lm_head"), (2, "sampler")) for s in (1, 2, 4, 8, 16)))
    rows = _synthetic_attention(lambda pc, kp, nd, kd: 1.0 + 0.001 * (pc * (kp + pc) + nd * kd))
    (d / "attention.csv").write_text("prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n"
                                     + "".join(",".join(f"{v:g}" for v in r) + "\n" for r in rows))
    if moe:
        (d / "moe.csv").write_text("tokens,activated_experts,time_us\n" + "".join(
            f"{t},{e},{10 + e + t}\n" for t in toks for e in (2, 4, 8) if e <= 2 * t))
    return root


def test_moe_blocks_by_tokens_and_expected_distinct_experts(tmp_path):
    model = ModelSpec(name="toy", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=1000)
    root = _bundle(tmp_path, model, moe=True)
    with pytest.raises(ValueError, match="num_experts"):
        OperatorProfileCostModel(model, hw(), profile=str(root))
    cm = OperatorProfileCostModel(model, hw(), profile=str(root), num_experts=8, experts_per_token=2)
    e = 8 * (1 - (1 - 2 / 8) ** 4)  # 4 tokens routed to 2 of 8 experts each: 5.27 distinct expected
    assert float(activated_experts(4, 8, 2)) == pytest.approx(e)
    moe_us = 10 + 4 + (4 + (e - 4) / (8 - 4) * (8 - 4))  # linear between the 4- and 8-expert rows at 4 tokens
    b = cm.breakdown(decode_features(4, 17))
    assert b["moe"] == pytest.approx(3 * moe_us * US)
    assert "gate_up_proj" not in b  # a MoE bundle has no dense MLP rows
    assert cm.step_time(decode_features(4, 17)) == pytest.approx(sum(b.values()))


def test_moe_at_tp2_without_its_own_table_takes_tp1s_over_tp(tmp_path):
    """The bundles profile the MoE block at TP 1 only: at TP 2 each rank holds half of every expert's width, so the
    block costs TP 1's time / 2 (the model's moe section gives the routing)."""
    from core.specs import MoESpec

    model = ModelSpec(name="toy", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=1000, moe=MoESpec(num_experts=8, top_k=2,
                                                                           intermediate_size=32))
    root = _bundle(tmp_path, model, moe=True)
    tp2 = root / "tp2"
    tp2.mkdir()
    for name in ("dense.csv", "per_sequence.csv", "attention.csv"):
        (tp2 / name).write_text((root / "tp1" / name).read_text())
    meta = yaml.safe_load((root / "meta.yaml").read_text())
    over = meta["engine_effective"]["hf_overrides"]
    meta["tp_degrees"] = [1, 2]
    meta["engine_effective"]["hf_overrides"] = {k: v // 2 for k, v in over.items()}
    (root / "meta.yaml").write_text(yaml.safe_dump(meta))
    one = OperatorProfileCostModel(model, hw(), profile=str(root), tp=1)  # routing from model.moe
    two = OperatorProfileCostModel(model, hw(), profile=str(root), tp=2)
    f = decode_features(4, 17)
    assert two.breakdown(f)["moe"] == pytest.approx(one.breakdown(f)["moe"] / 2)
    assert two.coverage()["moe_from"] == "tp1/moe.csv / 2" and "moe_from" not in one.coverage()


@pytest.mark.slow
@needs_data
def test_every_published_model_and_tp_prices_a_run(tmp_path):
    """Each profiled (GPU, model, TP) of shared/data runs a short vllm_v1 simulation: the model names match the
    bundles (Qwen3-30B-A3B's is its Instruct-2507 fine-tune), MoE at TP 2 is priced, nothing leaves the grid. TP 2
    halves each rank's weights: faster decodes for the dense models; the 3B-active MoE's decodes are faster only on
    a free link (over the presets' PCIe link its 96 all-reduces a step cost more than the halved weights save)."""
    from experiments.run import run

    free_link = ("hardware.interconnect_bw=1e15", "hardware.interconnect_latency_s=0")
    cases = [("rtx4090", "llama3_1_8b", 1, ())] + [("rtxpro6000", m, tp, ()) for m in ("llama3_1_8b", "qwen3_32b",
                                                                                      "qwen3_30b_a3b")
                                                    for tp in (1, 2)] + [("rtxpro6000", "qwen3_30b_a3b", 2, free_link)]
    tpot = {}
    for gpu, model, tp, extra in cases:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["cost_model=profiled", f"model={model}", f"hardware={gpu}",
                                               f"parallel.tp={tp}", "scheduler=vllm_v1", "kv.prefix_cache_mode=vllm",
                                               "kv.num_blocks=4096", "workload.num_requests=20", "output.plots=false",
                                               *extra])
        m = run(RunConfig.from_config(cfg), tmp_path / f"{gpu}-{model}-{tp}-{len(extra)}")
        assert m["num_completed"] == 20 and m["cost_model"]["beyond_grid"] == {}, (gpu, model, tp)
        tpot[(gpu, model, tp, extra)] = m["tpot_s"]["p50"]
    for model in ("llama3_1_8b", "qwen3_32b"):
        assert tpot[("rtxpro6000", model, 2, ())] < tpot[("rtxpro6000", model, 1, ())], model
    moe = {k[2:]: v for k, v in tpot.items() if k[1] == "qwen3_30b_a3b"}
    assert moe[(2, free_link)] < moe[(1, ())] < moe[(2, ())]


def test_vllm_cuda_graph_ceiling_follows_its_default_rule():
    """min(2 x max_num_seqs, 512), never above max_num_batched_tokens; 512 without limits."""
    from sim.cost.profiled import vllm_cuda_graph_max_tokens

    assert vllm_cuda_graph_max_tokens(128, 2048) == 256
    assert vllm_cuda_graph_max_tokens(None, None) == 512
    assert vllm_cuda_graph_max_tokens(300, 200) == 200
    assert vllm_cuda_graph_max_tokens(16, None) == 32
