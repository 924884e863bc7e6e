"""sweep_report over a multirun-shaped directory: one line per scheduler, values read from each job."""

import json

import pytest
import yaml
from hydra import compose, initialize_config_dir

from core.output import read_metrics
from experiments.build import CONF_DIR
from experiments.runs import run
from experiments.sweep_report import report


def test_report_reads_every_job(tmp_path):
    for i, (sched, budget) in enumerate([("sarathi", 64), ("sarathi", 256), ("orca", 256)]):
        overrides = [f"scheduler={sched}", f"scheduler.max_num_batched_tokens={budget}", "workload.num_requests=6",
                     "output.plots=false"]
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        job = tmp_path / str(i)
        run(cfg, job)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    png = report(tmp_path)
    assert png.stat().st_size > 10_000
    table = (tmp_path / "sweep_report.md").read_text().splitlines()
    assert len(table) == 2 + 3
    goodput = read_metrics(tmp_path / "2" / "metrics.json")["goodput_rps"]
    assert any(r.startswith("| orca | 256 |") and f"{goodput:.4g}" in r for r in table)


def test_report_names_missing_sweep_keys(tmp_path):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / "metrics.json").write_text("{}")
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["seed=1"]))
    with pytest.raises(ValueError, match="swept keys"):
        report(tmp_path)


def test_report_leaves_out_and_names_unfinished_jobs(tmp_path):
    overrides = ["scheduler=sarathi", "scheduler.max_num_batched_tokens=64", "workload.num_requests=6",
                 "output.plots=false"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    for i in range(3):
        (tmp_path / str(i) / ".hydra").mkdir(parents=True)
        (tmp_path / str(i) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    run(cfg, tmp_path / "0")
    run(cfg, tmp_path / "1")
    m = read_metrics(tmp_path / "1" / "metrics.json")
    (tmp_path / "1" / "metrics.json").write_text(json.dumps({**m, "run_status": "interrupted"}))
    report(tmp_path)  # job 2 never wrote metrics.json (killed), job 1 was interrupted
    table = (tmp_path / "sweep_report.md").read_text()
    assert table.count("| sarathi | 64 |") == 1
    assert "job 1 (run_status interrupted), 2 (no metrics.json)" in table


def test_multirun_job_directories_are_job_numbers(tmp_path):
    """16 overrides used to give `File name too long`, and a path-valued override nested directories: job
    directories are job numbers, each job's overrides are in its .hydra/overrides.yaml."""
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    extra = [f"+note{i}=/some/long/path/value_{i}_{'x' * 20}" for i in range(14)]
    cmd = [sys.executable, "-m", "experiments.run", "-m", f"hydra.sweep.dir={sweep}", "workload.num_requests=4",
           "output.plots=false", "output.progress=false", "scheduler.max_num_batched_tokens=64,128", *extra]
    subprocess.run(cmd, check=True, capture_output=True, cwd=CONF_DIR.parent, timeout=300)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    recorded = yaml.safe_load((sweep / "1" / ".hydra" / "overrides.yaml").read_text())
    assert "scheduler.max_num_batched_tokens=128" in recorded and extra[0] in recorded
    assert read_metrics(sweep / "1" / "metrics.json")["run_status"] == "complete"
