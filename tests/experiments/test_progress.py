"""Progress lines: durations, ETA arithmetic, the multirun job count, and the callback in a real multirun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.progress import Progress, count_jobs, duration, eta_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("s", "text"), [(0, "0s"), (59.4, "59s"), (75, "1m15s"), (3600, "1h00m"), (4000, "1h06m")])
def test_duration(s, text):
    assert duration(s) == text


def test_eta_is_the_mean_time_so_far_times_what_is_left():
    assert eta_line("x", 2, 6, 20.0) == "x: 2/6 done, 20s elapsed, ETA 40s"
    assert eta_line("x", 6, 6, 20.0) == "x: 6/6 done, 20s elapsed"
    assert eta_line("x", 0, 6, 0.0) == "x: 0/6 done, 0s elapsed"
    assert eta_line("x", 3, None, 5.0) == "x: 3 done, 5s elapsed"


def _cfg(task, params=None, target="hydra._internal.core_plugins.basic_sweeper.BasicSweeper", **sweeper):
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": target, "params": params, **sweeper},
                                       "overrides": {"task": task}}})


def test_count_jobs_is_the_cartesian_product_of_sweeps():
    assert count_jobs(_cfg(["seed=0,1,2", "scheduler=orca,sarathi", "replicas=2"])) == 6
    assert count_jobs(_cfg(["seed=range(0,4)"], params={"workload.arrival.rate_rps": "1,2,4"})) == 12
    assert count_jobs(_cfg(["a=1"])) == 1
    assert count_jobs(_cfg([], target="hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                           n_trials=20)) == 20
    assert count_jobs(_cfg([], target="my.Sweeper")) is None


def test_progress_steps(caplog):
    p = Progress("study", 4)
    with caplog.at_level("INFO"):
        assert p.step("a").startswith("study: 1/4 done")
    assert "ETA" in caplog.text and "(a)" in caplog.text


def test_a_multirun_logs_done_over_total_after_every_job(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.run", "-m", "seed=0,1", "scheduler=sarathi,orca",
                          "workload.num_requests=5", "output.plots=false", f"hydra.sweep.dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("multirun:")]
    assert [ln.split(" done")[0] for ln in lines] == [f"multirun: {i}/4" for i in range(1, 5)]
    assert "ETA" in lines[0] and lines[-1].endswith("(job 3: completed)")
    assert json.loads((tmp_path / ".progress" / "sweep.json").read_text())["total"] == 4
    assert sorted(p.name for p in (tmp_path / ".progress").glob("job*.done")) == [f"job{i}.done" for i in range(4)]
    assert "multirun: 4/4 done" in (tmp_path / "3" / "run.log").read_text()  # logged to the job's run.log too


def test_a_sweep_into_a_used_directory_counts_only_its_own_jobs(tmp_path):
    """The marks of an earlier sweep into the same directory used to count: "2/2 done" after its first job."""
    cmd = [sys.executable, "-m", "experiments.run", "-m", "seed=0,1", "workload.num_requests=5", "output.plots=false",
           f"hydra.sweep.dir={tmp_path}"]
    for _ in range(2):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("multirun:")]
    assert [ln.split(" done")[0] for ln in lines] == ["multirun: 1/2", "multirun: 2/2"]
