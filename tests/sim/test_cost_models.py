"""Roofline and linear cost models against hand arithmetic; every conf option composes and instantiates."""

import math

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from core.batch import StepFeatures
from core.specs import HardwareSpec, ModelSpec
from experiments.config import CONF_DIR
from sim.cost import CostModel, LinearCostModel, RooflineCostModel, decode_features, prefill_features

CONF = CONF_DIR  # importing experiments.config registers the schemas conf/*.yaml defaults name
LLAMA3_8B = ModelSpec("llama3_8b", 32, 4096, 32, 8, 128, 14336, 128256)
H100 = HardwareSpec("h100", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, interconnect_bw=450e9)
LAYER_LINEAR = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q,o + k,v + gate/up/down
HEAD = 128256 * 4096


def ideal(**kw) -> RooflineCostModel:
    """Datasheet peaks, no overhead: the pure roofline."""
    return RooflineCostModel(LLAMA3_8B, H100, compute_eff=1.0, bw_eff=1.0, overhead_s=0.0, **kw)


def test_features_helpers_match_hand_counts():
    f = prefill_features(100, cached=50)
    assert f.attention_pairs == 100 * 50 + 100 * 101 // 2 and f.prefill_kv_tokens == 150
    assert f.num_prefill_tokens == f.num_batched_tokens == 100 and f.num_decode_seqs == 0
    d = decode_features(8, 1000)
    assert (d.num_decode_seqs, d.num_batched_tokens, d.kv_tokens_read) == (8, 8, 8000)


def test_decode_batch1_is_weight_bandwidth_bound():
    cm = ideal()
    streamed = 2 * (32 * LAYER_LINEAR + HEAD)  # all weights but the embedding table, 16-bit
    f = decode_features(1, 1)
    assert cm.step_time(f) == pytest.approx(streamed / 3.35e12, rel=0.005)
    ops = cm.ops(f)
    assert ops["linear"].intensity < 989 / 3.35  # below the ridge point
    assert cm.op_time(ops["linear"]) == pytest.approx(2 * 32 * LAYER_LINEAR / 3.35e12)


def test_ridge_point_is_where_linear_layers_turn_compute_bound():
    # 16-bit linear layers do 2 FLOPs per weight per token and read 2 bytes per weight: intensity = tokens.
    ridge = 989e12 / 3.35e12  # 295.2
    cm = ideal()
    for n, bound in ((math.floor(ridge), "memory"), (math.ceil(ridge), "compute")):
        c = cm.ops(prefill_features(n))["linear"]
        assert c.intensity == pytest.approx(n)
        memory_time = c.bytes / 3.35e12
        assert (cm.op_time(c) > memory_time) == (bound == "compute")


def test_large_prefill_is_compute_bound():
    n = 8192
    cm = ideal()
    flops = 2 * 32 * LAYER_LINEAR * n + 4 * 32 * 128 * 32 * n * (n + 1) / 2 + 2 * HEAD
    t = cm.step_time(prefill_features(n))
    assert t >= flops / 989e12
    assert t == pytest.approx(flops / 989e12, rel=0.15)  # the rest: memory-bound norms/elementwise
    b = cm.breakdown(prefill_features(n))
    assert b["linear"] == pytest.approx(2 * 32 * LAYER_LINEAR * n / 989e12)
    assert b["attention_prefill"] == pytest.approx(4 * 32 * 128 * 32 * n * (n + 1) / 2 / 989e12)


def test_efficiencies_and_overhead():
    f = decode_features(1, 1)
    slow = RooflineCostModel(LLAMA3_8B, H100, compute_eff=0.5, bw_eff=0.5, overhead_s=2e-3)
    assert slow.step_time(f) == pytest.approx(2 * ideal().step_time(f) + 2e-3)
    assert ideal().step_time(StepFeatures()) == 0.0
    assert slow.step_time(StepFeatures()) == 2e-3  # an empty step costs only the fixed overhead
    assert sum(slow.breakdown(f).values()) == slow.step_time(f)


def test_decode_kv_bytes_and_kv_bits():
    f = decode_features(4, 1000)
    assert ideal().ops(f)["attention_decode"].bytes == 4000 * 131072
    # int8 KV reads its float32 scale per token and KV head too: 2 x 32 layers x 8 heads x (128 + 4) B per token
    assert ideal(kv_bits=8).ops(f)["attention_decode"].bytes == 4000 * 2 * 32 * 8 * (128 + 4)
    assert ideal().ops(f)["attention_decode"].flops == 4000 * 4 * 32 * 128 * 32


def test_w4_speedup_approaches_one_as_kv_reads_dominate():
    w16, w4 = ideal(), ideal(weight_bits=4, group_size=128)
    speedups = [w16.step_time(f) / w4.step_time(f)
                for f in (decode_features(1, 128), decode_features(32, 2048), decode_features(256, 32768))]
    assert speedups[0] > 2.5  # weights: 15.0 GB -> 4.8 GB when almost nothing else is read
    assert speedups[0] > speedups[1] > speedups[2] > 1.0
    assert speedups[2] < 1.01


def test_tp2_halves_per_device_bytes_and_adds_allreduce():
    one, two = ideal(), ideal(tp=2)
    f = decode_features(16, 4096)
    o1, o2 = one.ops(f), two.ops(f)
    for group in ("linear", "attention_decode", "lm_head"):
        assert o2[group].bytes == pytest.approx(o1[group].bytes / 2)
        assert o2[group].flops == pytest.approx(o1[group].flops / 2)
    assert one.breakdown(f)["allreduce"] == 0.0
    # 2 all-reduces per layer of 16 tokens x 4096 x 2 bytes; ring: 2(tp-1)/tp of the bytes over 450 GB/s
    assert two.breakdown(f)["allreduce"] == pytest.approx(2 * 32 * (2 * 1 / 2) * 16 * 4096 * 2 / 450e9)
    assert two.kv_bytes_per_token == 65536


@pytest.mark.parametrize(("key", "value"), [
    ("compute_eff", 0.0), ("compute_eff", 1.5), ("bw_eff", -1), ("overhead_s", -1e-3), ("weight_bits", 3),
    ("kv_bits", 4), ("group_size", 0), ("tp", 0), ("tp", 3), ("compute_eff", "fast"), ("kernel_s", -1e-6),
    ("host_kernel_s", -1e-6),
])
def test_roofline_rejects_bad_values_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        RooflineCostModel(LLAMA3_8B, H100, **{key: value})


TINY = ModelSpec("tiny", 2, 256, 8, 4, 32, 512, 1000)  # 2 layers: the kernel count is 2 x 12 + 1 + 4 = 29


def test_kernel_launches_cost_the_same_at_every_tp_by_hand():
    """12 kernels per layer (norm, qkv, rope, cache write, attention, o_proj, add; norm, gate_up, SiLU-and-mul,
    down, add), an embedding, and final norm + LM head + 2 sampler kernels: 29 x kernel_s at tp 1 and at tp 4;
    everything else shrinks with tp."""
    k = 4e-6
    one, four = (RooflineCostModel(TINY, H100, overhead_s=0.0, kernel_s=k, tp=tp) for tp in (1, 4))
    for f in (decode_features(3, 100), prefill_features(64)):
        b1, b4 = one.breakdown(f), four.breakdown(f)
        assert one.kernels == four.kernels == [29]
        assert b1["kernels"] == b4["kernels"] == pytest.approx(29 * k)
        for group in ("linear", "attention_decode", "lm_head"):
            assert b4[group] <= b1[group] / 4 * (1 + 1e-12)
        assert b4["allreduce"] > 0 == b1["allreduce"]
        for m, b in ((one, b1), (four, b4)):
            assert sum(b.values()) == pytest.approx(m.step_time(f), rel=1e-12)
            assert m.step_time(f) - m.replace(kernel_s=0.0).step_time(f) == pytest.approx(29 * k)
    # decode runs stay bit-identical to the scalar step time
    f = decode_features(3, 100)
    from core.fast_forward import decode_features as next_decode
    assert four.decode_step_times(f, 5) == [four.step_time(next_decode(f, i)) for i in range(5)]
    # pp=2: one layer per stage, the embedding on the first, the head and sampler on the last
    two = RooflineCostModel(TINY, H100, overhead_s=0.0, kernel_s=k, pp=2)
    assert two.kernels == [13, 16]
    assert two.breakdown(f)["kernels"] == pytest.approx(29 * k)
    assert sum(two.stage_times(f)) == pytest.approx(two.step_time(f), rel=1e-12)
    assert RooflineCostModel(TINY, H100).breakdown(prefill_features(0))["kernels"] == 0.0


def test_kernel_s_defaults_to_the_hardware_preset():
    import dataclasses

    assert RooflineCostModel(TINY, H100).kernel_s == 0.0  # no preset value: nothing changes
    hw = dataclasses.replace(H100, kernel_launch_s=5e-6)
    assert RooflineCostModel(TINY, hw).kernel_s == 5e-6
    assert RooflineCostModel(TINY, hw, kernel_s=0.0).kernel_s == 0.0
    assert RooflineCostModel(TINY, hw).replace(bw_eff=0.5).kernel_s == 5e-6
    with pytest.raises(ValueError, match="kernel_launch_s"):
        dataclasses.replace(H100, kernel_launch_s=-1.0)


def test_fit_keeps_the_kernel_term_fixed():
    """fit_roofline prices the launches as a fixed term: it recovers efficiencies and overhead of a roofline
    with launches."""
    from sim.fit import fit_roofline

    truth = RooflineCostModel(LLAMA3_8B, H100, compute_eff=0.6, bw_eff=0.5, overhead_s=2e-4, kernel_s=4e-6)
    feats = [decode_features(b, c) for b in (1, 8, 64) for c in (128, 2048)] + \
        [prefill_features(n) for n in (128, 1024, 4096)]
    fitted, _ = fit_roofline(feats, [truth.step_time(f) for f in feats], LLAMA3_8B, H100, {"kernel_s": 4e-6},
                             loss="linear")
    assert fitted.kernel_s == 4e-6
    for key in ("compute_eff", "bw_eff", "overhead_s"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-3, abs=1e-7)


def test_host_term_overlaps_the_device_time_by_hand():
    """A stage lasts max(device, kernels x host_kernel_s), plus the overhead: TINY launches 29 kernels a step, so
    with host = 2 x device the step is 2 x device (half of it waiting on the host), with host = device / 2 the
    device alone."""
    dev = RooflineCostModel(TINY, H100, overhead_s=0.0, kernel_s=4e-6, tp=2)
    for f in (decode_features(3, 100), prefill_features(64)):
        d = dev.step_time(f)
        for host, step, wait in ((2 * d, 2 * d, d), (d / 2, d, 0.0)):
            m = dev.replace(host_kernel_s=host / 29, overhead_s=1e-3)
            assert m.host_s == [pytest.approx(host)]
            assert m.step_time(f) == pytest.approx(step + 1e-3, rel=1e-12)
            b = m.breakdown(f)
            assert b["host_wait"] == pytest.approx(wait, rel=1e-12, abs=1e-18)  # hidden: host - host_wait
            assert b["kernels"] == pytest.approx(29 * 4e-6)  # the device-side launches stay in the device time
            assert sum(b.values()) == pytest.approx(m.step_time(f), rel=1e-12)
            assert m.stage_times(f) == [pytest.approx(step, rel=1e-12)]
    empty = dev.replace(host_kernel_s=1.0)
    assert empty.step_time(prefill_features(0)) == 0.0 and empty.breakdown(prefill_features(0))["host_wait"] == 0.0
    # pp = 2: each stage's host issues its own kernels (13 and 16) and overlaps its own device time
    two = RooflineCostModel(TINY, H100, overhead_s=1e-3, kernel_s=4e-6, pp=2, host_kernel_s=1e-3)
    f = decode_features(3, 100)
    assert two.host_s == [pytest.approx(13e-3), pytest.approx(16e-3)]
    assert two.stage_times(f) == [pytest.approx(13e-3), pytest.approx(16e-3)]
    assert two.step_time(f) == pytest.approx(29e-3 + 1e-3)
    assert sum(two.breakdown(f).values()) == pytest.approx(two.step_time(f), rel=1e-12)


def test_host_term_zero_prices_the_device_alone_bit_for_bit():
    """host_kernel_s 0: the price is the sum of op groups + collectives + launches + overhead, exactly as before the
    host term, and breakdown has no host key."""
    m = RooflineCostModel(LLAMA3_8B, H100, tp=2, kernel_s=4e-6)
    assert m.host_kernel_s == 0.0 and m.host_s == [0.0]
    fr, br = m._flop_rate, m._byte_rate
    for f in (decode_features(1, 10), decode_features(64, 3000), prefill_features(2048), prefill_features(7, 100)):
        device = sum(max(fl / fr, by / br) for fl, by in m._groups(f)) + m._comm_s(f) + m._kernel_s
        assert m.step_time(f) == device + m.overhead_s
        assert "host_wait" not in m.breakdown(f) and sum(m.breakdown(f).values()) == m.step_time(f)


def test_host_term_decode_runs_stay_bit_identical_across_the_crossover():
    """A decode run whose KV reads grow from below the host term to above it: the vectorised run equals the
    scalar step times, bit for bit, on both sides."""
    from core.fast_forward import decode_features as next_decode

    dev = RooflineCostModel(LLAMA3_8B, H100, overhead_s=2e-4, kernel_s=4e-6)
    f = decode_features(64, 1000)
    times = dev.decode_step_times(f, 3000)
    m = dev.replace(host_kernel_s=(times[1500] - 2e-4) / dev.kernels[0])
    run = m.decode_step_times(f, 3000)
    assert run == [m.step_time(next_decode(f, i)) for i in range(3000)]
    waits = [m.breakdown(next_decode(f, i))["host_wait"] for i in (0, 2999)]
    assert waits[0] > 0 == waits[1]  # host-bound at first, device-bound at the end


def test_fits_with_the_host_term():
    """fit_roofline keeps a given host term and recovers the rest; fit_host_kernel_s recovers the host term."""
    from sim.fit import fit_host_kernel_s, fit_roofline

    truth = RooflineCostModel(LLAMA3_8B, H100, compute_eff=0.6, bw_eff=0.5, overhead_s=2e-4, kernel_s=4e-6,
                              host_kernel_s=40e-6)
    feats = [decode_features(b, c) for b in (1, 8, 64, 256) for c in (128, 2048)] + \
        [prefill_features(n) for n in (128, 1024, 4096)]
    y = [truth.step_time(f) for f in feats]
    assert sum(truth.breakdown(f)["host_wait"] > 0 for f in feats) >= 3  # some steps wait on the host
    fitted, _ = fit_roofline(feats, y, LLAMA3_8B, H100, {"kernel_s": 4e-6, "host_kernel_s": 40e-6}, loss="linear")
    assert fitted.host_kernel_s == 40e-6
    for key in ("compute_eff", "bw_eff", "overhead_s"):
        assert getattr(fitted, key) == pytest.approx(getattr(truth, key), rel=1e-3, abs=1e-7)
    assert fit_host_kernel_s(truth.replace(host_kernel_s=0.0), feats, y) == pytest.approx(40e-6, rel=2e-3)
    with pytest.raises(ValueError, match="pp = 1"):
        fit_host_kernel_s(truth.replace(pp=2), feats, y)


def test_tp_needs_an_interconnect():
    cpu = HardwareSpec("cpu", 1e11, 1.5e10, 16e9)
    with pytest.raises(ValueError, match="interconnect_bw"):
        RooflineCostModel(LLAMA3_8B, cpu, tp=2)


def test_roofline_accepts_mappings_and_dictconfigs():
    cfg = OmegaConf.create({"m": LLAMA3_8B.to_dict(), "h": {"name": "h100", "peak_flops": 989e12,
                                                             "mem_bw": 3.35e12, "mem_bytes": 80e9}})
    a = RooflineCostModel(cfg.m, cfg.h)
    b = RooflineCostModel(LLAMA3_8B.to_dict(), dict(cfg.h))
    assert a.model == b.model == LLAMA3_8B
    assert isinstance(a, CostModel)
    with pytest.raises(ValueError, match="unknown keys"):
        RooflineCostModel({**LLAMA3_8B.to_dict(), "layers": 3}, H100)


def test_linear_model_hand_arithmetic():
    cm = LinearCostModel(c0_s=1e-3, per_prefill_token_s=2e-5, per_decode_seq_s=3e-4, per_attention_pair_s=1e-9,
                         per_kv_token_read_s=4e-8)
    f = StepFeatures(num_seqs=5, num_batched_tokens=104, num_prefill_seqs=1, num_prefill_tokens=100,
                     num_decode_seqs=4, attention_pairs=5050, kv_tokens_read=2000, prefill_kv_tokens=100)
    assert cm.step_time(f) == pytest.approx(1e-3 + 100 * 2e-5 + 4 * 3e-4 + 5050 * 1e-9 + 2000 * 4e-8)
    assert cm.step_time(StepFeatures()) == 1e-3
    assert isinstance(cm, CostModel)


@pytest.mark.parametrize("key", ["c0_s", "per_prefill_token_s", "per_decode_seq_s", "per_attention_pair_s",
                                 "per_kv_token_read_s"])
def test_linear_rejects_negative_coefficients(key):
    with pytest.raises(ValueError, match=key):
        LinearCostModel(**{key: -1.0})


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_linear_file_round_trip(tmp_path, suffix):
    cm = LinearCostModel(1.5e-3, 2.25e-5, 3e-4, 1.1e-9, 4.7e-8)
    path = cm.to_file(tmp_path / f"calib{suffix}")
    assert LinearCostModel.from_file(path) == cm
    if suffix == ".yaml":  # the file is a ready conf/cost_model option
        assert instantiate(OmegaConf.load(path)) == cm


def test_linear_from_file_rejects_unknown_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("c0_s: 1.0e-3\nper_token_s: 2.0e-5\n")
    with pytest.raises(ValueError, match=r"per_token_s.*allowed"):
        LinearCostModel.from_file(path)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="estimate", overrides=list(overrides))


@pytest.mark.parametrize("model", [m for m in _options("model") if m != "checkpoint"])  # checkpoint: a path
def test_every_model_option_composes(model):
    cfg = _compose(f"model={model}")
    spec = ModelSpec.from_mapping(OmegaConf.to_container(cfg.model))
    assert spec.name == model


@pytest.mark.parametrize("hardware", _options("hardware"))
def test_every_hardware_option_composes(hardware):
    cfg = _compose(f"hardware={hardware}")
    assert HardwareSpec.from_mapping(OmegaConf.to_container(cfg.hardware)).name == hardware


@pytest.mark.parametrize("cost_model", _options("cost_model"))
@pytest.mark.parametrize(("model", "hardware"), [("tiny", "cpu"), ("llama2_70b", "h200")])
def test_every_cost_model_option_instantiates(cost_model, model, hardware, tmp_path):
    extra = []
    if cost_model == "calibrated":  # loads a calibrate output: give it one
        path = LinearCostModel(c0_s=1e-3, per_decode_seq_s=1e-4).to_file(tmp_path / "linear.yaml")
        extra = [f"cost_model.path={path}"]
    cfg = _compose(f"cost_model={cost_model}", f"model={model}", f"hardware={hardware}", *extra).cost_model
    if cost_model == "profiled":  # published GPU profiles: none for these; tests/sim/test_profiled.py has real ones
        with pytest.raises(Exception, match="no published GPU profile|no profile folder"):
            instantiate(cfg, data_dir=str(tmp_path))
        return
    cm = instantiate(cfg)
    assert isinstance(cm, CostModel)
    t = cm.step_time(decode_features(4, 256))
    assert 0 < t < 10


def test_all_models_instantiate_with_roofline_on_h100():
    for model in (m for m in _options("model") if m != "checkpoint"):  # checkpoint: model=DIR, tested below
        cm = instantiate(_compose(f"model={model}").cost_model)
        assert isinstance(cm, RooflineCostModel) and cm.model.name == model


def test_linear_prefill_context_term_by_hand():
    cm = LinearCostModel(c0_s=1e-3, per_prefill_token_s=1e-5, per_prefill_context_token_s=2e-6)
    # a 10-token chunk after 30 cached tokens: 1 ms + 10 x 10 us + 30 x 2 us
    assert cm.step_time(prefill_features(10, cached=30)) == pytest.approx(1e-3 + 1e-4 + 6e-5)
    assert cm.step_time(decode_features(4, 100)) == pytest.approx(1e-3)


def test_a_checkpoint_path_gives_the_cost_model_the_checkpoints_shapes(tmp_path):
    """model=DIR keeps the default group's other keys (name, sizes); every consumer must read config.json instead."""
    import json

    from experiments.build import CONF_DIR
    from sim.cost.base import as_model_spec

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
        "torch_dtype": "float32"}))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model.path={tmp_path}", "cost_model=roofline"])
    spec = as_model_spec(cfg.model)
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.name) == (512, 4, 32000, tmp_path.name)
    assert instantiate(cfg.cost_model).model.hidden_size == 512
