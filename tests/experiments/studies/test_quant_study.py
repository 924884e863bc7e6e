"""The quantisation study: roofline speed-up and capacity numbers against hand arithmetic, the quick study's files
and series, and the quality entry point on a checkpoint directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from core.specs import HardwareSpec, ModelSpec
from experiments.estimate import estimate
from experiments.studies.quant_quality import resolve_group_size, run_quality
from experiments.studies.quant_study import gpu_prediction, kv_capacity, study
from sim.cost.base import decode_features
from sim.cost.roofline import RooflineCostModel
from tests.engine.checkpoints import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]
LLAMA2_7B = ModelSpec("llama2_7b", 32, 4096, 32, 32, 128, 11008, 32000, dtype="float16")
H100 = HardwareSpec("h100", peak_flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, interconnect_bw=450e9)
LLAMA2_7B_PARAMS = 6_738_415_616  # published
SMALL_MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.intermediate_size=256", "model.num_heads=4",
               "model.num_kv_heads=2", "model.vocab_size=512"]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="quant_study", overrides=list(overrides))



def _llama2_7b_decode_bytes(weight_bits: int, context: int) -> float:
    """Bytes one batch-1 decode step streams, by hand: linear weights (4-bit: half a byte each + a 16-bit scale and
    a 16-bit zero point per 128, as kernels/w4a16.py stores them), the 16-bit LM head and its float32 logits, the
    context's fp16 K/V, and the per-layer norm / residual / SwiGLU / RoPE activation traffic (10d + 3F + 2(H + Hkv)Dh
    fp16 elements per layer)."""
    d, F, V, L = 4096, 11008, 32000, 32
    linear = L * (4 * d * d + 3 * d * F)
    linear_bytes = 2 * linear if weight_bits == 16 else linear * (0.5 + 4 / 128)
    head = 2 * V * d + 4 * V
    kv = context * 2 * L * 32 * 128 * 2
    elementwise = 2 * L * (10 * d + 3 * F + 2 * (32 + 32) * 128)
    return linear_bytes + head + kv + elementwise


@pytest.mark.parametrize("context", [1, 4096])
def test_llama2_7b_w4_batch1_speedup_is_the_bytes_ratio(context):
    """Batch-1 decode is memory-bound in every op group (4-bit linear layers: ~3.9 FLOP/B, far below H100's
    295 FLOP/B ridge), so the ideal roofline's speed-up is exactly the ratio of bytes streamed."""
    r = estimate(LLAMA2_7B, H100, weight_bits=4, group_size=128, batch_sizes=[1], context=context)
    want = _llama2_7b_decode_bytes(16, context) / _llama2_7b_decode_bytes(4, context)
    assert r["decode"][0]["quant_speedup"] == pytest.approx(want, rel=1e-9)
    if context == 1:  # nearly only weights move: the speed-up ~ the streamed-weight ratio, ~3.57x
        weights = (2 * 6_476_005_376 + 2 * 131_072_000) / (6_476_005_376 * 0.53125 + 2 * 131_072_000)
        assert want == pytest.approx(weights, rel=5e-3) and 3.5 < want < 3.6


def test_gpu_prediction_by_hand():
    """The study's GPU block: conf roofline efficiencies (bw 0.75, overhead 1 ms), the h100 preset's 4 us per
    kernel launch (32 layers x 12 + 5 kernels), and the W4 KV budget from the
    formula W·[(1 − f) + f·b/16 + 2f/G] (a 16-bit scale and zero point per group) with f = quantised share of the
    published parameter count."""
    cfg = _compose("study.gpu.model=llama2_7b", "study.gpu.batch_sizes=[1]", "study.gpu.batch_context=4096",
                   "study.gpu.contexts=[4096]", "study.gpu.context_batch=1")
    from engine.quality import QuantSetting

    g = gpu_prediction(cfg, [QuantSetting.parse("w4a16", 128)])
    rate = 3.35e12 * 0.75
    launches = (32 * 12 + 5) * 4e-6
    t16, t4 = (_llama2_7b_decode_bytes(b, 4096) / rate + launches + 1e-3 for b in (16, 4))
    assert g["batch"]["predicted_s"]["base"][0] == pytest.approx(t16, rel=1e-9)
    assert g["batch"]["speedup"]["w4a16"][0] == pytest.approx(t16 / t4, rel=1e-9)
    assert g["context"]["speedup"] == g["batch"]["speedup"]  # the same single shape
    w16 = 2 * LLAMA2_7B_PARAMS
    f = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) / LLAMA2_7B_PARAMS
    w4 = w16 * ((1 - f) + f * 4 / 16 + 2 * f / 128)
    cap = g["capacity"]["settings"]
    for name, weights in (("base", w16), ("w4a16", w4)):
        budget = 0.9 * 80e9 - weights
        assert cap[name]["kv_budget_bytes"] == pytest.approx(budget, rel=1e-12)
        assert cap[name]["max_seqs"] == [math.floor(budget / (4096 * 2 * 32 * 32 * 128 * 2))]


def test_int8_kv_capacity_by_hand():
    cfg = _compose("study.kv_memory_bytes=1e9", "study.capacity_contexts=[256,1024]")
    from experiments.config import RunConfig

    run = RunConfig.from_config(cfg)
    cap = kv_capacity(cfg, run.model, run.hardware)
    # tiny: 4 layers x (K, V) x 16 slots x 4 kv heads x 32 dims; float32 4 B, int8 1 B + a float32 scale per
    # slot and head (both backends size the pool with the scales counted)
    fp32, int8_engine = (2 * 4 * 16 * 4 * 32 * 4, 2 * 4 * 16 * 4 * (32 + 4))
    assert cap["auto"]["num_kv_blocks"]["blocks"] == cap["auto"]["engine_tensors"]["blocks"] == 10**9 // fp32
    assert cap["int8"]["num_kv_blocks"]["blocks"] == cap["int8"]["engine_tensors"]["blocks"] == 10**9 // int8_engine
    assert cap["gain"]["engine_tensors"] == pytest.approx((10**9 // int8_engine) / (10**9 // fp32))
    assert cap["token_gain"] == pytest.approx(32 * 4 / (32 + 4))  # float32 KV: 3.56x, not the 4x of the elements
    assert cap["int8"]["engine_tensors"]["max_seqs"] == [(10**9 // int8_engine) // 16, (10**9 // int8_engine) // 64]


def test_group_size_resolution():
    tiny = ModelSpec("tiny", 4, 256, 8, 4, 32, 688, 4096)
    assert resolve_group_size(tiny, None) == 16  # 688 = 16 x 43
    assert resolve_group_size(LLAMA2_7B, None) == 128 and resolve_group_size(LLAMA2_7B, 64) == 64
    for bad in (48, 0, 3, True, "16"):
        with pytest.raises(ValueError, match="quant_group_size"):
            resolve_group_size(tiny, bad)


def test_quick_study_writes_files_and_series(tmp_path):
    cfg = _compose("quick=true", *SMALL_MODEL)
    r = study(cfg, tmp_path)
    for name in ("quant_study.json", "summary.md", "quality.json", "quant_step_times.png", "quant_speedup.png"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "quant_study.json").read_text())["settings"] == r["settings"]
    settings = ["base", "w4a16", "kv_int8", "w4a16+kv_int8"]
    assert r["settings"] == settings and r["group_size"] == 128  # K = 128 (hidden, 4 heads x 32) and 256 (FFN)
    sizes = {"batch": [(1, 32), (4, 32)], "context": [(2, 16), (2, 64)]}
    cpu_model = RooflineCostModel(ModelSpec("tiny", 2, 128, 4, 2, 32, 256, 512, dtype="float32"),
                                  HardwareSpec("cpu", 1e11, 1.5e10, 4e9), compute_eff=0.7, bw_eff=0.75,
                                  overhead_s=1e-3)
    for sweep, shapes in sizes.items():
        e = r["cpu"][sweep]
        assert [tuple(s) for s in e["shapes"]] == shapes
        for n in settings:
            assert len(e["measured_s"][n]) == len(e["predicted_fit_s"][n]) == len(shapes)
            assert all(0 < t < 10 for t in e["measured_s"][n])
            assert all(m >= lo for m, lo in zip(e["measured_s"][n], e["measured_min_s"][n], strict=True))
        for n in settings[1:]:
            assert e["speedup_measured"][n] == pytest.approx([b / t for b, t in zip(e["measured_s"]["base"],
                                                                                    e["measured_s"][n], strict=True)])
        # the simulator's price of these batches = the roofline on the hand-built decode shapes
        assert e["predicted_conf_s"]["base"] == pytest.approx([cpu_model.step_time(decode_features(b, c))
                                                               for b, c in shapes])
    assert [len(r["gpu"]["batch"]["speedup"][n]) for n in settings[1:]] == [7] * 3
    assert [len(r["gpu"]["context"]["speedup"][n]) for n in settings[1:]] == [4] * 3
    assert [q["setting"] for q in r["quality"]["rows"]] == settings[1:]
    summary = (tmp_path / "summary.md").read_text()
    assert f"{r['cpu']['batch']['measured_s']['base'][0] * 1e3:.3g}" in summary
    assert "w4a16+kv_int8" in summary and "no GPU" in summary


def test_quality_entry_point_on_a_checkpoint(tmp_path):
    _, path = tiny_checkpoint(tmp_path / "ckpt")
    report = run_quality(_compose("quick=true", f"model.path={path}", "quant_group_size=32",
                                  "quant_settings=[w4a16]"))
    assert report.model == "ckpt" and [r.setting for r in report.rows] == ["w4a16"] and report.num_prompts == 2
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.quant_quality", "quick=true", f"model.path={path}",
           "quant_settings=[kv_int8]", f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    q = json.loads((out / "quality.json").read_text())
    assert q["model"] == "ckpt" and q["rows"][0]["setting"] == "kv_int8" and "top-1 agree" in done.stdout


@pytest.mark.parametrize(("override", "key"), [
    ("quant_group_size=48", "quant_group_size"), ("quant_settings=[fp8]", "fp8"), ("+study.foo=1", "foo"),
    ("quant_settings=[]", "quant_settings"), ("study.batch_sizes=[0]", "batch_sizes"),
    ("study.gpu.model=nope", "study.gpu.model"), ("cost_model=linear", "cost_model"),
])
def test_bad_config_is_named(tmp_path, override, key):
    """Checked before anything is timed (quick=true would replace study.batch_sizes, so it is left out)."""
    with pytest.raises(ValueError, match=key):
        study(_compose(*SMALL_MODEL, override), tmp_path)
