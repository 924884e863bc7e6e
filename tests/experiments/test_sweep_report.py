"""sweep_report over a multirun-shaped directory: one line per scheduler, values read from each job."""

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
