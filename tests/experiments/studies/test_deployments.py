"""The deployment search finds the optimum of a case built so that it is known by hand."""

from __future__ import annotations

import pytest

from core.specs import ModelSpec
from experiments.config import conf_option
from experiments.studies.deployments import Deployment, candidates, search
from tests.sim.test_fast_forward import compose_cfg

LLAMA3_8B = ModelSpec.from_config(conf_option("model", "llama3_8b"))


def test_candidates_use_exactly_the_gpus():
    got = candidates(LLAMA3_8B, 4, tps=(1, 2, 4), pps=(1, 2))
    assert {d.label for d in got} == {"4x_tp1", "2x_tp1_pp2", "2x_tp2", "1x_tp2_pp2", "1x_tp4"}
    assert all(d.devices == 4 for d in got)
    assert candidates(LLAMA3_8B, 4, tps=(1,), pps=(1,), dps=(1, 2, 4)) == [Deployment(4)]  # dense: replicas, no dp
    moe = ModelSpec.from_config(conf_option("model", "qwen3_30b_a3b"))
    labels = {d.label for d in candidates(moe, 4, tps=(1, 2), pps=(1,), dps=(1, 2))}
    assert {"2x_tp2", "2x_tp2_ep2", "2x_tp1_dp2", "2x_tp1_dp2_ep2", "1x_tp2_dp2_ep4"} <= labels


def test_search_finds_the_hand_known_optimum(tmp_path):
    """Every collective hop costs 50 ms (no measured tables), the SLO asks TPOT <= 40 ms: any tp > 1 (two
    all-reduces per layer, >= 100 ms each) and any pp > 1 (a 50 ms send per step) misses every request, while
    Llama-3-8B on one H100 decodes in ~7 ms. So the optimum of 4 GPUs is 4 replicas of TP 1, and it alone has
    goodput; per dollar it is goodput x 3600 / (4 x $6.155)."""
    cfg = compose_cfg(["model=llama3_8b", "hardware=h100", "cost_model=roofline", "hardware.network_profile=null",
                       "hardware.interconnect_latency_s=0.05", "workload.num_requests=40",
                       "workload.arrival.rate_rps=20", "slo.tpot_s=0.04", "slo.ttft_s=1.0", "output.progress=false"])
    rows = search(cfg, candidates(LLAMA3_8B, 4, tps=(1, 2, 4), pps=(1, 2)), tmp_path)
    best = rows[0]
    assert best["deployment"] == Deployment(replicas=4)
    assert best["goodput_rps"] > 0 and all(r["goodput_rps"] == 0 for r in rows[1:])
    assert len(rows) == 5
    assert best["goodput_per_dollar"] == pytest.approx(best["goodput_rps"] * 3600 / (4 * 6.155))
    assert best["goodput_rps_per_device"] == pytest.approx(best["goodput_rps"] / 4)


def test_search_trials_fill_replicas_and_skip_off_budget():
    from experiments.run import fill_replicas, off_budget

    base = ["model=llama3_8b", "hardware=h100", "cost_model=roofline", "+gpus=8", "replicas=auto"]
    cfg = fill_replicas(compose_cfg([*base, "parallel.tp=2", "parallel.pp=2"]))
    assert cfg.replicas == 2 and off_budget(cfg) is None
    assert "replicas=0" in off_budget(fill_replicas(compose_cfg([*base, "parallel.tp=8", "parallel.pp=2"])))
    assert "parallel.tp=3" in off_budget(fill_replicas(compose_cfg([*base[:-1], "replicas=1", "parallel.tp=3"])))
    assert "not gpus=8" in off_budget(compose_cfg([*base[:-1], "replicas=1", "parallel.tp=4"]))


def test_an_off_budget_trial_says_why_in_its_directory(tmp_path):
    """Its job directory used to hold only run.log: sweep_report listed it as "no metrics.json", like a job that
    died."""
    import json
    import subprocess
    import sys

    from experiments.build import CONF_DIR

    cmd = [sys.executable, "-m", "experiments.run", "model=llama3_8b", "hardware=h100", "cost_model=roofline",
           "+gpus=8", "replicas=auto", "parallel.tp=8", "parallel.pp=2", f"hydra.run.dir={tmp_path}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=CONF_DIR.parent, timeout=120)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["run_status"] == "failed"
    assert metrics["error"].startswith("deployment search trial not run (replicas=0")
    assert metrics["error"].endswith("objective 0")
