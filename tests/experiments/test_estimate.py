"""The estimate tool: hand-checked numbers from estimate(), the Hydra entry point, and the CLI once."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from core.specs import HardwareSpec, ModelSpec
from experiments.estimate import estimate, format_table, main, run
from sim.cost.base import as_model_spec

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = ModelSpec("llama3_8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA2_70B = ModelSpec("llama2_70b", 80, 8192, 64, 8, 128, 28672, 32000, dtype="float16")
H100 = HardwareSpec("h100", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, interconnect_bw=450e9)


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="estimate", overrides=list(overrides))


def test_llama3_8b_on_h100_by_hand():
    r = estimate(LLAMA3_8B, H100, batch_sizes=[1, 256], context=2048, prefill_len=2048)
    assert r["weight_bytes"] == 2 * 8_030_261_248
    assert r["kv_bytes_per_token"] == 131072
    assert r["ridge_point"] == pytest.approx(295.22, abs=0.01)
    budget = 0.9 * 80e9 - 2 * 8_030_261_248
    assert r["memory"]["max_concurrent_seqs"] == math.floor(budget / (2048 * 131072)) == 208
    b1, b256 = r["decode"]
    assert b1["bound"] == "memory" and b1["fits"] and not b256["fits"]
    assert b1["time_lower_bound_s"] == pytest.approx(2 * 8.03e9 / 3.35e12, rel=0.08)  # ~ weights / bandwidth
    assert b1["kv_bytes"] == 2048 * 131072 and b256["kv_bytes"] == 256 * 2048 * 131072
    assert b1["tokens_per_s_max"] == pytest.approx(1 / b1["time_lower_bound_s"])
    assert b256["tokens_per_s_max"] == pytest.approx(256 / b256["time_lower_bound_s"])
    assert r["prefill"]["bound"] == "compute" and r["prefill"]["intensity"] > r["ridge_point"]
    assert r["prefill"]["flops"] == pytest.approx(2048 * 2 * 6.98e9, rel=0.05)
    # default efficiencies are 1 and overhead 0: the estimate is the lower bound
    assert b1["time_est_s"] == b1["time_lower_bound_s"]


def test_quantised_weights_speedup_and_kv8_capacity():
    r = estimate(LLAMA3_8B, H100, weight_bits=4, kv_bits=8, batch_sizes=[1, 32, 256], context=8192)
    speedups = [d["quant_speedup"] for d in r["decode"]]
    assert speedups[0] > speedups[1] > speedups[2] > 1.0
    assert r["weight_bytes"] < 0.4 * r["weight_bytes_16bit"]
    mem = r["memory"]
    # int8 KV per token: K and V x 32 layers x 8 heads x (128 int8 + one float32 scale) = 67584 B, not 65536
    assert mem["max_concurrent_seqs"] == math.floor(mem["kv_budget_bytes"] / (8192 * 2 * 32 * 8 * (128 + 4)))
    assert mem["kv_capacity_gain"] == pytest.approx(2 * 128 / (128 + 4))  # 1.94x, not 2x
    assert "W4 speed-up" in format_table(r) and "vs 16-bit KV" in format_table(r)


def test_70b_needs_tensor_parallelism_to_fit():
    assert not estimate(LLAMA2_70B, H100)["memory"]["weights_fit"]
    r = estimate(LLAMA2_70B, H100, tp=4)
    assert r["memory"]["weights_fit"] and r["weight_bytes_per_device"] == r["weight_bytes"] / 4
    assert "DO NOT FIT" in format_table(estimate(LLAMA2_70B, H100))


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"batch_sizes": []}, "batch_sizes"), ({"batch_sizes": [0]}, "batch_sizes"), ({"context": 0}, "context"),
    ({"prefill_len": -5}, "prefill_len"), ({"memory_fraction": 0}, "memory_fraction"),
    ({"weight_bits": 2}, "weight_bits"), ({"tp": 0}, "tp"), ({"compute_eff": -0.5}, "compute_eff"),
])
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        estimate(LLAMA3_8B, H100, **kwargs)


def test_main_prints_table_and_json(capsys):
    main(_compose("model=tiny", "hardware=cpu", "estimate.batch_sizes=[1,4]"))
    out = capsys.readouterr().out
    assert "tiny on cpu" in out and "tok/s est" in out
    main(_compose("estimate.json=true", "quant.weight_bits=4", "parallel.tp=2"))
    r = json.loads(capsys.readouterr().out)
    assert (r["model"], r["hardware"], r["tp"], r["weight_bits"]) == ("llama3_8b", "h100", 2, 4)
    assert [d["batch_size"] for d in r["decode"]] == [1, 8, 32, 128, 256]
    # the configured efficiencies (roofline.yaml) make the estimate slower than the bound
    assert all(d["time_est_s"] > d["time_lower_bound_s"] for d in r["decode"])


@pytest.mark.parametrize(("override", "key"), [
    ("+estimate.foo=1", "foo"), ("cost_model=linear", "cost_model._target_"), ("+cost_model.speed=2", "speed"),
    ("estimate.json=3", "estimate.json"),
])
def test_run_rejects_bad_config(override, key):
    with pytest.raises(ValueError, match=key):
        run(_compose(override))


def test_cli_smoke():
    cmd = [sys.executable, "-m", "experiments.estimate", "model=tiny", "hardware=cpu", "estimate.json=true",
           "estimate.batch_sizes=[2]"]
    ok = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["decode"][0]["batch_size"] == 2
    bad = subprocess.run(cmd + ["cost_model.kv_bits=4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "kv_bits=4" in bad.stderr


def test_compute_share_shows_compute_bound_linear_layers_inside_a_memory_bound_step():
    r = estimate(LLAMA3_8B, H100, weight_bits=4, batch_sizes=[1, 1024], context=128)
    small, big = r["decode"]
    assert small["compute_share"] == 0.0  # batch 1: every op group streams bytes
    # 1024 tokens over 4-bit weights: ~3600 FLOP/B in the linear layers, far above the 295 ridge point
    assert big["compute_share"] > 0.5
    assert 0.75 < r["prefill"]["compute_share"] < 1.0  # the rest: memory-bound norms and elementwise ops


def test_moe_model_reports_total_and_active_params(capsys):
    main(_compose("model=deepseek_v2_lite", "estimate.batch_sizes=[1]", "estimate.json=true"))
    r = json.loads(capsys.readouterr().out)
    assert r["params"] == 15_706_484_224 and r["active_params"] == 2_661_150_208  # tests/core/test_arithmetic.py
    assert r["kv_bytes_per_token"] == (512 + 64) * 27 * 2  # MLA: the latent and its RoPE key
    assert "2.66 G active per token" in format_table(r)
    assert "active" not in format_table(estimate(LLAMA3_8B, H100, batch_sizes=[1])).split("|")[0]


def test_pipeline_split_per_device_by_hand():
    """Llama-3-8B at tp 2 x pp 2 on 80 GB: a stage holds 16 layers of 218,103,808 linear parameters (half per
    device) and their 2 x 4096 norm weights; the first stage half the embedding, the last half the LM head and the
    final norm; KV per token per device: K and V x 16 layers x 4 of 8 KV heads x 128 x 2 bytes."""
    r = estimate(LLAMA3_8B, H100, tp=2, pp=2, block_size=16)
    par = r["parallel"]
    s0, s1 = par["stages"]
    layers = 2 * (16 * 218_103_808 // 2 + 16 * 8192)
    half_vocab = 2 * 128256 * 4096 // 2
    assert (s0["layers"], s1["layers"]) == ([0, 16], [16, 32])
    assert s0["weight_bytes_per_device"] == layers + half_vocab == 4_015_259_648
    assert s1["weight_bytes_per_device"] == layers + half_vocab + 2 * 4096 == 4_015_267_840
    assert s0["kv_bytes_per_token_per_device"] == s1["kv_bytes_per_token_per_device"] == 2 * 16 * 4 * 128 * 2
    assert s1["kv_bytes_per_block_per_device"] == 16 * 32768
    assert s1["kv_blocks_per_device"] == (72e9 - 4_015_267_840) // (16 * 32768) == 129_670
    assert par["kv_blocks_per_device"] == 129_670 and par["kv_blocks_per_virtual_engine"] == 64_835
    assert par["devices"] == 4 and par["kv_pools"] == 1
    text = format_table(r)
    assert "deployment tp=2 pp=2 dp=1 ep=1: 4 devices" in text and "64835 per virtual engine" in text
    assert "deployment" not in format_table(estimate(LLAMA3_8B, H100))  # one device: no split


def test_memory_line_is_the_deployments_fullest_stage():
    """Llama-2-70B at tp 2 x pp 2 on 80 GB: a device of the last stage holds 40 layers of 855,638,016 linear
    parameters and 2 x 8192 norm weights (half per device), half the LM head and the final norm, and 40 layers x
    2 x 4 KV heads x 128 x 2 bytes of KV per token; one device holding all 80 layers at tp 2 would leave ~3 GB."""
    mem = estimate(LLAMA2_70B, H100, tp=2, pp=2, context=2048)["memory"]
    last = 2 * (40 * 855_638_016 // 2 + 40 * 16384) + 2 * 32000 * 8192 // 2 + 2 * 8192
    assert last == 34_488_991_744 and mem["kv_budget_bytes"] == 72e9 - last
    assert mem["max_concurrent_seqs"] == (72e9 - last) // (2048 * 40 * 2 * 4 * 128 * 2) == 223
    assert estimate(LLAMA2_70B, H100, pp=2)["memory"]["weights_fit"]  # ~69 GB a stage, not 138 GB
    assert not estimate(LLAMA2_70B, H100)["memory"]["weights_fit"]


def test_tied_embeddings_under_pipeline_by_hand():
    """Llama-3.2-1B (tied embeddings) at tp 2 x pp 2: the first stage holds half the table as its embedding, and the
    last half a copy of it as its LM head (vLLM's last rank builds the table again); 8 layers of 60,817,408 linear
    parameters and 2 x 2048 norm weights each, split per device, and the final norm on the last stage. One stage
    only (pp 1) keeps the one shared table."""
    m = ModelSpec("llama3_2_1b", 16, 2048, 32, 8, 64, 8192, 128256, tie_word_embeddings=True)
    s0, s1 = estimate(m, H100, tp=2, pp=2)["parallel"]["stages"]
    layers = 2 * (8 * 60_817_408 // 2 + 8 * 4096)
    half_vocab = 2 * 128256 * 2048 // 2
    assert s0["weight_bytes_per_device"] == layers + half_vocab == 749_273_088
    assert s1["weight_bytes_per_device"] == layers + half_vocab + 2 * 2048 == 749_277_184
    whole = estimate(m, H100)["parallel"]["stages"][0]["weight_bytes_per_device"]
    assert whole == estimate(m, H100)["weight_bytes"] == 2 * (16 * (60_817_408 + 4096) + 128256 * 2048 + 2048)


def test_data_parallel_experts_split_by_hand():
    """Qwen3-30B-A3B at dp 2 x ep 2: each device keeps the attention and routers whole and half of the 48 layers x
    128 experts x 3 x 2048 x 768 routed parameters (64 experts per ep group, each on one device); two pools."""
    m = as_model_spec(_compose("model=qwen3_30b_a3b").model)
    one = estimate(m, H100)["parallel"]
    dp2 = estimate(m, H100, dp=2, ep=2)["parallel"]
    routed_bytes = 48 * 128 * 3 * 2048 * 768 * 2
    assert one["stages"][0]["weight_bytes_per_device"] - dp2["stages"][0]["weight_bytes_per_device"] \
        == routed_bytes / 2
    assert dp2["stages"][0]["kv_bytes_per_token_per_device"] == one["stages"][0]["kv_bytes_per_token_per_device"]
    assert dp2["experts_per_group"] == 64 and dp2["devices_per_expert"] == 1 and dp2["kv_pools"] == 2
    assert dp2["kv_blocks_per_device"] > one["kv_blocks_per_device"]
    with pytest.raises(ValueError, match="parallel.ep"):
        estimate(LLAMA3_8B, H100, dp=2, ep=2)


def test_the_cli_config_carries_the_deployment():
    r = run(_compose("model=llama3_8b", "parallel.tp=2", "parallel.pp=2", "estimate.block_size=32"))
    assert r["parallel"]["pp"] == 2 and r["parallel"]["block_size"] == 32
    assert r["parallel"]["stages"][0]["kv_bytes_per_block_per_device"] == 32 * 32768
