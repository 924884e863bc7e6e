"""The step-time breakdown of a run: groups by hand, the TP-1 route's split, and a profiled TP 2 run end to end."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from core.output import read_step_features
from experiments.build import CONF_DIR
from experiments.calibration.breakdown import breakdown_report, format_report, grouped, tp1_route
from experiments.config import RunConfig, shared_data

try:
    PROFILES = shared_data("gpu-measurements", "llmservingsim")
except FileNotFoundError:  # pragma: no cover
    PROFILES = None


def test_parts_group_by_what_they_are():
    parts = {"qkv_proj": 1.0, "layernorm": 0.5, "moe": 2.0, "attention": 3.0, "skew": 0.25, "lm_head": 0.5,
             "sampler": 0.125, "allreduce": 0.75, "send_recv": 0.25, "kernels": 0.0625, "overhead": 0.1}
    assert grouped(parts) == {"dense": 1.5, "moe": 2.0, "attention": 3.25, "head": 0.625, "collectives": 1.0,
                              "launches": 0.0625, "overhead": 0.1}


def test_tp1_route_splits_sharded_rows_and_keeps_stable_ones():
    tp2 = {"qkv_proj": 1.0, "layernorm": 0.5, "sampler": 0.2, "allreduce": 9.0, "overhead": 0.0, "moe": 0.0}
    tp1 = {"qkv_proj": 1.8, "layernorm": 0.5, "sampler": 0.2, "allreduce": 0.0, "overhead": 0.0, "moe": 0.0}
    r = tp1_route(tp2, tp1, 2)
    assert set(r) == {"qkv_proj", "layernorm", "sampler", "total"}  # one collective model: not compared
    assert r["total"]["tp_tables_s"] == 1.7 and r["total"]["tp1_split_s"] == pytest.approx(1.6)
    assert r["qkv_proj"] == {"tp_tables_s": 1.0, "tp1_split_s": 0.9, "ratio": 0.9}
    assert r["layernorm"]["ratio"] == 1.0 and r["sampler"]["tp1_split_s"] == 0.2


@pytest.mark.skipif(PROFILES is None, reason="shared/data/gpu-measurements/llmservingsim not present")
def test_a_profiled_tp2_run_breaks_down_into_its_step_times(tmp_path):
    from experiments.run import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["cost_model=profiled", "model=llama3_1_8b", "hardware=rtxpro6000",
                                           "parallel.tp=2", "scheduler=vllm_v1", "workload.num_requests=20",
                                           "kv.num_blocks=2000", "output.plots=false"])
    run(RunConfig.from_config(cfg), tmp_path)
    r = breakdown_report(tmp_path, tp1=True)
    _, durations, _ = read_step_features(tmp_path / "steps.csv")
    assert r["step_time_s"] == pytest.approx(durations.sum(), rel=1e-6)  # the parts sum to the run's step times
    assert sum(r["shares"].values()) == pytest.approx(1.0)
    assert r["groups_s"]["collectives"] > 0 and r["metrics"]["num_completed"] == 20
    route = r["tp1_route"]
    assert route["layernorm"]["ratio"] == pytest.approx(1.0)  # tp2's norms are tp1's copies
    assert 0.8 < route["gate_up_proj"]["ratio"] < 1.25  # half-width GEMMs: about half the full one
    assert "| collectives |" in format_report(r) and "| gate_up_proj |" in format_report(r)
