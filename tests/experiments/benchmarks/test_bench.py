"""Benchmarks (``make bench`` / ``pytest -m bench``): print speed ratios measured in one run; never in CI."""

import pytest


@pytest.mark.bench
def test_simulator_speed_on_azure_conv():
    from experiments.benchmarks.sim import main

    out = main(["--limit", "4000"])
    print(f"simulated seconds per wall second: {out['sim_s_per_wall_s']:.1f} (goal >= 60)")
    assert out["requests"] == 4000


@pytest.mark.bench
def test_engine_vs_transformers():
    from experiments.benchmarks.engine import main

    for extra in ([], ["--varied"]):
        out = main(["--repeats", "2", *extra])
        for b in (1, 8, 32):
            r = out[f"batch_{b}"]
            print(f"{out['workload']}, batch {b}: engine / transformers throughput {r['speedup_vs_hf']:.2f}x "
                  f"(goal >= 2x); outside the forward pass {r['outside_forward_share']:.1%}")


def test_gpu_benchmark_smoke_on_cpu(tmp_path):
    """The GPU benchmark's code paths, on CPU with torch kernels and the tiny model (seconds)."""
    import json

    from experiments.benchmarks.gpu import main

    main(["--device", "cpu", "--kernels", "torch", "--model", "tiny", "--hardware", "cpu", "--dtype", "float32",
          "--quick", "--reps", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_gpu.json").read_text())
    kinds = [r["kind"] for r in result["steps"]]
    assert kinds.count("decode") == 2 and kinds.count("prefill") == 1
    assert all(r["fraction_of_bandwidth_roofline"] > 0 for r in result["steps"] if r["kind"] == "decode")
    assert (tmp_path / "steps.csv").read_text().splitlines()[0].startswith("replica,start_s,duration_s")
    moe = result["grouped_gemm"]  # the Triton rows run under the interpreter here (tests/conftest.py)
    ops = {r["op"] for r in moe}
    assert {"grouped_gemm_gate_up", "grouped_gemm_down", "grouped_gemm_gate_up_silu", "grouped_gemm_gate_up_bm128",
            "moe_route_permute_combine"} <= ops
    assert all(r["tflops"] > 0 and r["speedup"] > 0 for r in moe if r["op"].startswith("grouped_gemm"))
    assert (tmp_path / "grouped_gemm.csv").read_text().startswith("op,")


def test_gpu_check_report_shows_the_grouped_gemm_rows():
    from experiments.benchmarks.gpu_check import markdown

    row = {"op": "grouped_gemm_down", "shape": "qwen3_30b_a3b T=16", "baseline": "cublas_loop", "baseline_ms": 0.5,
           "ms": 0.1, "speedup": 5.0, "tflops": 1.5, "fraction_of_bandwidth_roofline": 0.4}
    bench = {"kernels": [], "steps": [], "grouped_gemm": [row]}
    report = {"device": "H200", "torch": "2", "started": "now", "seconds": 1.0, "ok": True,
              "sections": {"bench": {"status": "ok", "seconds": 1.0, "result": bench}}}
    text = markdown(report)
    assert "### MoE grouped GEMM" in text
    assert "| grouped_gemm_down | qwen3_30b_a3b T=16 | cublas_loop | 0.5 | 0.1 | 5 | 1.5 | 0.4 |" in text


@pytest.mark.bench
def test_http_serving_vs_offline_engine():
    from experiments.benchmarks.serve import main

    out = main(["--requests", "32"])
    print(f"tokens/s through HTTP / offline engine: {out['http_over_offline']:.2f}x (goal >= 0.9x); "
          f"loadgen send lag p99 {out['send_lag_p99_ms']:.1f} ms")


def test_engine_benchmark_smoke():
    """bench_engine's code paths on a tiny model: with one repeat each reported ratio is the quotient of the rates
    reported next to it (rounded to 3 places), and the roofline comes from the measured probe."""
    from experiments.benchmarks.engine import main

    out = main(["--batches", "1,3", "--waves", "1", "--prompt", "8", "--output", "4", "--repeats", "1",
                "--hidden", "64", "--layers", "2", "--vocab", "512"])
    assert out["probe"]["read_gb_s"] > 0 and out["probe"]["gemm_gflop_s"] > 0
    for b in (1, 3):
        r = out[f"batch_{b}"]
        for ratio, num, den in (("speedup_vs_hf", "engine_tok_s", "hf_tok_s"),
                                ("max_speedup_vs_hf", "roofline_tok_s", "hf_tok_s"),
                                ("engine_roofline_fraction", "engine_tok_s", "roofline_tok_s")):
            assert r[ratio] == pytest.approx(r[num] / r[den], rel=2e-3, abs=1e-3), ratio
        assert r["roofline_tok_s"] > 0 and r["decode_floor_ms"] > 0
        assert r["engine_steps"] == 4  # one prefill step, then one decode step per remaining output token


def test_the_screened_floor_reads_the_int8_lm_head():
    """With the greedy screen the bench's floor counts the LM head's int8 copy (a quarter of its fp32 bytes, int8
    multiply-adds at four times the fp32 rate); everything else is the roofline's."""
    from core.batch import StepFeatures
    from core.specs import HardwareSpec, ModelSpec
    from experiments.benchmarks.engine import _step_floor
    from sim.cost.roofline import RooflineCostModel

    spec = ModelSpec(name="m", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64,
                     intermediate_size=1408, vocab_size=32000, dtype="float32")
    roof = RooflineCostModel(spec, HardwareSpec("cpu", peak_flops=1e11, mem_bw=2e10, mem_bytes=1e9), 1.0, 1.0, 0.0)
    decode = StepFeatures(num_seqs=8, num_batched_tokens=8, num_decode_seqs=8, kv_tokens_read=8 * 130,
                          max_context_len=130)
    head = roof.ops(decode)["lm_head"]
    fp32_head = max(head.flops / 1e11, head.bytes / 2e10)  # bandwidth-bound at batch 8
    int8_head = max(head.flops / 4e11, (head.bytes - 3 * 32000 * 512) / 2e10)
    assert _step_floor(roof, decode, False) == roof.step_time(decode)
    assert _step_floor(roof, decode, True) == pytest.approx(roof.step_time(decode) - fp32_head + int8_head)
    assert _step_floor(roof, StepFeatures(), True) == roof.step_time(StepFeatures())


def test_moe_benchmark_smoke():
    """bench_moe's code paths on a tiny MoE model: each reported ratio is the quotient of the rates next to it."""
    from experiments.benchmarks.moe import main

    for arch in ("qwen3_moe", "mixtral"):
        out = main(["--arch", arch, "--batches", "1,3", "--waves", "1", "--prompt", "8", "--output", "4",
                    "--repeats", "1", "--hidden", "64", "--layers", "2", "--vocab", "512", "--expert-width", "32"])
        for b in (1, 3):
            r = out[f"batch_{b}"]
            assert r["speedup_vs_hf"] == pytest.approx(r["engine_tok_s"] / r["hf_tok_s"], rel=2e-3, abs=1e-3)
            assert r["engine_decode_tok_s"] == pytest.approx(1e3 * b / r["decode_step_ms"], rel=2e-3)


@pytest.mark.bench
def test_moe_engine_vs_transformers():
    from experiments.benchmarks.moe import main

    out = main(["--repeats", "2"])
    for b in (1, 8, 32):
        r = out[f"batch_{b}"]
        print(f"MoE batch {b}: engine / transformers throughput {r['speedup_vs_hf']:.2f}x")


@pytest.mark.bench
def test_gateway_prefix_aware_vs_round_robin_measured_and_simulated():
    from experiments.benchmarks.gateway import main

    out = main(["--groups", "8", "--requests", "96", "--rate", "3", "--blocks", "80"])
    for side in ("measured #0 win", "simulated win"):
        print(f"{side}: {out[side]}")
    assert out["measured"]["round_robin"][0]["completed"] == 96
