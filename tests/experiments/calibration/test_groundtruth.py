"""A recorded GPU vLLM run (shared/data/gpu-groundtruth/llmservingsim) as compare's measured side: the reader against
the raw files, the settings it derives, and the end-to-end prediction of the development case."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from core.metrics import summarize
from core.specs import ModelSpec
from experiments.build import CONF_DIR
from experiments.calibration.groundtruth import (
    VLLM_RESERVED_BYTES,
    derived_kv_blocks,
    is_groundtruth,
    kv_pool,
    measured_states,
    read_groundtruth,
    read_peer,
    settings,
)
from experiments.config import shared_data


def _run() -> Path:
    try:
        return shared_data("gpu-groundtruth", "llmservingsim", "RTXPRO6000", "Llama-3.1-8B")
    except FileNotFoundError:
        return Path("shared/data/gpu-groundtruth/absent")


RUN = _run()
pytestmark = pytest.mark.skipif(not is_groundtruth(RUN), reason="shared/data/gpu-groundtruth not present")


def compare_cfg(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("compare", overrides=[f"compare.measured={RUN}", *overrides])


def raw_rows() -> list[dict]:
    return [json.loads(line) for line in (RUN / "vllm_requests.jsonl").read_text().splitlines() if line.strip()]


def llama() -> ModelSpec:
    from omegaconf import OmegaConf

    return ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "llama3_1_8b.yaml")))


def test_the_reader_joins_requests_with_their_prompts_on_the_engine_clock():
    """Client arrivals moved onto the engine's clock by the smallest receipt delay; receipt (queued_ts), first and
    last token on that clock; TTFT by hand from the receipt, as the recording defines it."""
    gt = read_groundtruth(RUN)
    assert len(gt.requests) == 300 and gt.workload.name == "sharegpt-llama-3.1-8b-300-sps10.jsonl"
    arrivals = [r.arrival_s for r in gt.requests]
    assert min(arrivals) == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:], strict=False))
    raw = raw_rows()
    offset = min(r["queued_ts"] - r["arrival_time"] for r in raw)
    t0 = min(r["arrival_time"] for r in raw) + offset
    r0, g0 = raw[5], gt.requests[5]
    assert g0.id == "bench-5" and len(g0.prompt_token_ids) == r0["input_toks"] == 399
    assert g0.arrival_s == pytest.approx(r0["arrival_time"] + offset - t0, abs=1e-6)
    assert g0.received_s == pytest.approx(r0["queued_ts"] - t0, abs=1e-9)
    delays = [r.received_s - r.arrival_s for r in gt.requests]
    assert min(delays) == pytest.approx(0.0, abs=1e-6) and max(delays) < 0.2  # at most about a step in flight
    assert g0.first_token_s - g0.received_s == pytest.approx(r0["first_token_ts"] - r0["queued_ts"], abs=1e-9)
    assert (g0.last_token_s - g0.first_token_s) / (g0.output_tokens - 1) == pytest.approx(
        (r0["last_token_ts"] - r0["first_token_ts"]) / (r0["output_toks"] - 1))


def test_without_client_arrivals_the_receipts_are_the_arrivals(tmp_path):
    import shutil

    for f in RUN.iterdir():
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(read_groundtruth(RUN).workload, tmp_path)
    rows = [{k: v for k, v in r.items() if k != "arrival_time"} for r in raw_rows()]
    (tmp_path / "vllm_requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gt = read_groundtruth(tmp_path)
    assert all(r.arrival_s == r.received_s for r in gt.requests) and gt.requests[0].received_s == 0.0


def test_llmservingsims_own_tree_reads_the_same(tmp_path):
    """bench/examples/<GPU>/<model>/{vllm/meta.json, vllm/requests.jsonl, vllm/timeseries.csv, config.json,
    validation/summary.txt} with the dataset at workloads/ of the checkout's top: the same run."""
    import shutil

    from experiments.calibration.groundtruth import BENCH_LAYOUT, file_of

    run = tmp_path / "bench" / "examples" / "RTXPRO6000" / "Llama-3.1-8B"
    for flat, nested in BENCH_LAYOUT.items():
        (run / nested).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RUN / flat, run / nested)
    flat_gt = read_groundtruth(RUN)
    (tmp_path / "workloads").mkdir()
    shutil.copy(flat_gt.workload, tmp_path / "workloads" / flat_gt.workload.name)
    assert is_groundtruth(run) and file_of(run, "vllm_meta.json") == run / "vllm" / "meta.json"
    gt = read_groundtruth(run)
    assert gt.requests == flat_gt.requests and gt.workload == tmp_path / "workloads" / flat_gt.workload.name
    assert read_peer(gt.file("validation_summary.txt")) == read_peer(RUN / "validation_summary.txt")
    assert not is_groundtruth(tmp_path)


def test_the_measured_metrics_are_the_peers_vllm_column():
    """Same definitions as LLMServingSim's validation: its table's vLLM numbers come back (0.1 ms rounding)."""
    measured = summarize(measured_states(read_groundtruth(RUN)), percentile_method="linear")
    peer = read_peer(RUN / "validation_summary.txt")
    for metric in ("ttft_s", "tpot_s", "e2e_s"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert measured[metric][stat] == pytest.approx(peer[metric][stat]["vllm"], abs=1e-4), (metric, stat)
    assert peer["ttft_s"]["p50"] == pytest.approx({"vllm": 9.4427, "sim": 8.6339, "rel_error": -0.086})


def test_the_kv_pool_is_recorded_or_derived_as_vllm_sizes_it():
    m = llama()
    # 0.9 x 96 GB - 16.06 GB of bf16 weights - vLLM's reserve, in blocks of 16 tokens x 128 KiB
    by_hand = int((0.9 * 96e9 - 8_030_261_248 * 2 - VLLM_RESERVED_BYTES) // (16 * 131072))
    assert derived_kv_blocks(m, 1, 96e9) == by_hand == 32949
    assert derived_kv_blocks(m, 2, 96e9) == int((0.9 * 96e9 - 8_030_261_248 - VLLM_RESERVED_BYTES) // (16 * 65536))
    gt = read_groundtruth(RUN)
    blocks, size, how = kv_pool(gt, m, 1, 96e9)
    assert (blocks, size) == (by_hand, 16) and how.startswith("derived")
    recorded = dataclasses.replace(gt, meta={**gt.meta, "kv_cache": {"num_gpu_blocks": 2588, "block_size": 16}})
    assert kv_pool(recorded, m, 1, 96e9)[:2] == (2588, 16)
    device = dataclasses.replace(gt, meta={**gt.meta, "hardware": {"device_total_memory_bytes": 25_250_627_584}})
    assert kv_pool(device, m, 1, 96e9)[0] == derived_kv_blocks(m, 1, 25_250_627_584)


def test_settings_come_from_the_run():
    gt = read_groundtruth(RUN)
    overrides, how = settings(gt, compare_cfg())
    for o in ("model=llama3_1_8b", "hardware=rtxpro6000", "scheduler=vllm_v1", "kv.prefix_cache_mode=vllm",
              "cost_model=profiled",
              "parallel.tp=1", "scheduler.max_num_seqs=128", "scheduler.max_num_batched_tokens=2048",
              "kv.block_size=16", "kv.prefix_caching=true", f"kv.num_blocks={how['kv_blocks']}"):
        assert o in overrides
    switched, _ = settings(gt, compare_cfg("compare.groundtruth.scheduler=vllm_prefill_first",
                                           "compare.groundtruth.overrides=['kv.num_blocks=9000']"))
    assert "scheduler=vllm_prefill_first" in switched and switched[-1] == "kv.num_blocks=9000"
    assert not any(o.startswith("kv.prefix_cache_mode") for o in switched)  # vLLM's cache semantics go with vllm_v1


def test_a_recorded_scheduler_config_reaches_vllm_v1():
    gt = read_groundtruth(RUN)
    resolved = {"scheduler_config": {"long_prefill_token_threshold": 512, "max_num_partial_prefills": 1,
                                     "enable_chunked_prefill": True}}
    rec = dataclasses.replace(gt, meta={**gt.meta, "resolved_config": resolved})
    overrides, _ = settings(rec, compare_cfg())
    assert "scheduler.long_prefill_token_threshold=512" in overrides
    assert "scheduler.async_scheduling=true" in overrides  # vLLM 0.19's default
    old = dataclasses.replace(gt, meta={**gt.meta, "vllm_version": "0.11.1rc2"})
    assert "scheduler.async_scheduling=false" in settings(old, compare_cfg())[0]
    sc_off = {"scheduler_config": {"async_scheduling": False}}
    off = dataclasses.replace(gt, meta={**gt.meta, "resolved_config": sc_off})
    assert "scheduler.async_scheduling=false" in settings(off, compare_cfg())[0]
    assert "scheduler.enable_chunked_prefill=true" in overrides
    many = dataclasses.replace(gt, meta={**gt.meta, "resolved_config": {"scheduler_config": {
        "max_num_partial_prefills": 4}}})
    with pytest.raises(ValueError, match="max_num_partial_prefills=4"):
        settings(many, compare_cfg())


def test_cuda_graphs_and_expert_parallelism_come_from_the_run():
    """enforce_eager: every step pays its launches; a recorded capture ceiling is used as is; none: the option's
    vLLM default from the scheduler limits. A DP x EP run of an MoE model is dp attention ranks meeting at the
    experts (ep = tp x dp), balanced by load; a release-tagged model id matches its family's option."""
    gt = read_groundtruth(RUN)
    base, _ = settings(gt, compare_cfg())
    assert not any(o.startswith("cost_model.cuda_graph_max_tokens") for o in base)
    assert "parallel.dp=1" in base and "parallel.ep=1" in base and not any(o.startswith("router=") for o in base)
    eager = dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": {**gt.engine, "enforce_eager": True}})
    assert "cost_model.cuda_graph_max_tokens=0" in settings(eager, compare_cfg())[0]
    resolved = {"compilation_config": {"max_cudagraph_capture_size": 128}}
    capped = dataclasses.replace(gt, meta={**gt.meta, "resolved_config": resolved})
    assert "cost_model.cuda_graph_max_tokens=128" in settings(capped, compare_cfg())[0]
    moe_kwargs = {**gt.engine, "model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "data_parallel_size": 2,
                  "enable_expert_parallel": True}
    moe = dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": moe_kwargs})
    overrides, how = settings(moe, compare_cfg())
    for o in ("model=qwen3_30b_a3b", "parallel.tp=1", "parallel.dp=2", "parallel.ep=2", "router=least_outstanding"):
        assert o in overrides
    assert "weights 32.07 GB" in how["kv_blocks_how"]  # replicated attention + half the experts on each device
    with pytest.raises(ValueError, match="has no experts"):
        settings(dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": {**gt.engine, "data_parallel_size": 2,
                                                                           "enable_expert_parallel": True}}),
                 compare_cfg())
    with pytest.raises(ValueError, match="without expert parallelism"):
        settings(dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": {**gt.engine, "data_parallel_size": 2}}),
                 compare_cfg())


def test_a_model_without_a_conf_option_comes_from_the_published_config(tmp_path, monkeypatch):
    """A recording of a model conf/model does not name (Llama-3.1-70B here) takes the config.json published beside
    the recordings (shared/data's model-configs/); with the option hidden, the development case simulates exactly as
    with it (same shapes: the same metrics to the byte)."""
    from experiments.calibration import groundtruth
    from experiments.calibration.compare import compare

    gt = read_groundtruth(RUN)
    big = dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": {**gt.engine, "model": "meta-llama/Llama-3.1-70B"}})
    overrides, how = settings(big, compare_cfg())
    assert "model=checkpoint" in overrides and how["model"] == "Llama-3.1-70B"
    path = Path(next(o for o in overrides if o.startswith("model.path="))[len("model.path="):])
    assert path.name == "Llama-3.1-70B.json" and ModelSpec.from_pretrained(path).num_layers == 80
    with pytest.raises(ValueError, match="nor is there a configs/model/acme/Unknown-1B.json"):
        settings(dataclasses.replace(gt, meta={**gt.meta, "engine_kwargs": {**gt.engine, "model": "acme/Unknown-1B"}}),
                 compare_cfg())
    compare(compare_cfg(), tmp_path / "option")
    named = groundtruth.option_named

    def no_model_options(group: str, name: str) -> str:
        if group == "model":
            raise ValueError(f"no conf/model option named like {name!r}")
        return named(group, name)

    monkeypatch.setattr(groundtruth, "option_named", no_model_options)
    compare(compare_cfg(), tmp_path / "file")
    assert (tmp_path / "option" / "sim" / "requests.csv").read_bytes() == \
        (tmp_path / "file" / "sim" / "requests.csv").read_bytes()


def test_the_development_case_is_predicted_from_the_profiles(tmp_path):
    """The 300-request RTX PRO 6000 run simulated with its own requests and settings (~3 s): TPOT within 2%, TTFT
    p50 / p90 within 10% (-9.9% / -4.8% measured; without the eager steps' kernel launches -12.4% / -7.1%)."""
    from experiments.calibration.compare import compare

    summary = compare(compare_cfg(), tmp_path)
    err = {(r["metric"], r["percentile"]): r["rel_error"] for r in summary["errors"]}
    for stat in ("p50", "p90"):
        assert abs(err[("tpot_s", stat)]) < 0.02, stat
    assert abs(err[("ttft_s", "p90")]) < 0.10 and abs(err[("ttft_s", "p50")]) < 0.10
    assert "LLMServingSim" in (tmp_path / "errors.md").read_text()
    metrics = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert metrics["cost_model"]["beyond_grid"] == {} and metrics["num_completed"] == 300
    diag = json.loads((tmp_path / "diagnostics.json").read_text())
    assert diag["timeseries"]["running_recorded_vs_requests_mae"] < 1.0  # the timeseries shares the engine clock
    # unqueued requests, both sides from the receipt: vLLM's async scheduling puts them behind the step the receipt
    # found starting (~20 ms earlier without it, below); -6 ms left: the profiles' prefill is ~10% below the run's
    free = diag["unqueued"]
    assert free["requests"] > 50 and abs(free["ttft_diff_p50_s"]) < 0.01
    # the saturated phase (128 running, 37 s): full decode steps agree (28.5 ms both); a prompt token joining one
    # adds 44 us in vLLM's log, 51 us simulated
    fit = diag["saturated_fit"]
    assert fit["seconds"] > 30 and fit["running"] == 128
    assert fit["sim"]["decode_step_s"] == pytest.approx(fit["measured"]["decode_step_s"], rel=0.02)
    assert 1.0 < fit["sim"]["per_prompt_token_s"] / fit["measured"]["per_prompt_token_s"] < 1.3


def test_the_saturated_fit_recovers_a_step_and_a_prompt_token_by_hand():
    """1 s = a x gen / running + b x prompt, exactly, for seconds made from a = 30 ms, b = 40 us."""
    import numpy as np

    from experiments.calibration.groundtruth import saturated_fit

    prompt = np.array([0.0, 2000.0, 5000.0, 800.0, 3000.0, 0.0])
    steps = (1.0 - 40e-6 * prompt) / 0.030
    fit = saturated_fit(steps * 128, prompt, 128)
    assert fit["decode_step_s"] == pytest.approx(0.030, rel=1e-9)
    assert fit["per_prompt_token_s"] == pytest.approx(40e-6, rel=1e-9)


def test_without_async_scheduling_unqueued_requests_start_a_step_early(tmp_path):
    from experiments.calibration.compare import compare

    compare(compare_cfg("compare.groundtruth.overrides=['scheduler.async_scheduling=false']"), tmp_path)
    free = json.loads((tmp_path / "diagnostics.json").read_text())["unqueued"]
    assert -0.03 < free["ttft_diff_p50_s"] < -0.01


