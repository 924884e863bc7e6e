"""sweep_report over a multirun-shaped directory: one line per scheduler, values read from each job."""

import json

import pytest
import yaml
from hydra import compose, initialize_config_dir

from core.output import read_metrics
from experiments.build import CONF_DIR
from experiments.run import run
from experiments.studies.sweep_report import report


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
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))  # .progress etc.
    assert jobs == ["0", "1"]
    recorded = yaml.safe_load((sweep / "1" / ".hydra" / "overrides.yaml").read_text())
    assert "scheduler.max_num_batched_tokens=128" in recorded and extra[0] in recorded
    assert read_metrics(sweep / "1" / "metrics.json")["run_status"] == "complete"


def _multirun(sweep, *swept):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "experiments.run", "-m", f"hydra.sweep.dir={sweep}", "workload.num_requests=6",
           "output.plots=false", "output.progress=false", *swept]
    subprocess.run(cmd, check=True, capture_output=True, cwd=CONF_DIR.parent, timeout=600)


def test_three_swept_keys_are_facets_not_dropped(tmp_path):
    """scheduler x budget x rate: every job is one row of the table and one point of the figure, the rate a facet
    (it used to be dropped: the last job in directory order won each (scheduler, budget) point)."""
    sweep = tmp_path / "sweep"
    _multirun(sweep, "scheduler=sarathi,orca", "scheduler.max_num_batched_tokens=64,256",
              "workload.arrival.rate_rps=5,60")
    png = report(sweep)
    assert png.stat().st_size > 10_000
    lines = (sweep / "sweep_report.md").read_text().splitlines()
    assert lines[0].startswith("| workload.arrival.rate_rps | scheduler | scheduler.max_num_batched_tokens |")
    assert len(lines) == 2 + 8
    for job in sweep.iterdir():
        if not (job / "metrics.json").is_file():
            continue
        o = dict(s.split("=", 1) for s in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) if "=" in s)
        goodput = read_metrics(job / "metrics.json")["goodput_rps"]
        row = (f"| {o['workload.arrival.rate_rps']} | {o['scheduler']} | "
               f"{float(o['scheduler.max_num_batched_tokens']):g} | ")
        assert sum(r.startswith(row) and r.endswith(f" {goodput:.4g} |") for r in lines) == 1, row
    report(sweep, where={"workload.arrival.rate_rps": "60"})  # one facet
    assert len((sweep / "sweep_report.md").read_text().splitlines()) == 2 + 4
    assert "workload.arrival.rate_rps" not in (sweep / "sweep_report.md").read_text()


def test_jobs_that_no_swept_key_tells_apart_are_refused(tmp_path):
    overrides = ["scheduler=sarathi", "scheduler.max_num_batched_tokens=64", "workload.num_requests=6",
                 "output.plots=false"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    for name, extra in (("a/0", []), ("a/1", ["replicas=1"]), ("b/0", ["replicas=1"])):  # nested job directories
        job = tmp_path / name
        run(cfg, job)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides + extra))
    with pytest.raises(ValueError, match=r"jobs a/1, b/0 have the same value of every swept key \['replicas'"):
        report(tmp_path)
    (tmp_path / "b" / "0" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides + ["replicas=2"]))
    report(tmp_path)
    table = (tmp_path / "sweep_report.md").read_text().splitlines()
    assert table[0].startswith("| replicas | scheduler |") and len(table) == 2 + 3


# ---- repeats: jobs that differ only in seed ---------------------------------------------------------------------
def fake_job(root, name, overrides, goodput, ttft=1.0, stall=0.1, slo_ttft=2.0):
    """A finished job directory without running anything: .hydra/overrides.yaml and the metrics.json keys the
    report reads."""
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "metrics.json").write_text(json.dumps({
        "run_status": "complete", "goodput_rps": goodput, "ttft_s": {"p90": ttft}, "max_stall_s": {"p99": stall},
        "slo": {"ttft_s": slo_ttft, "max_stall_s": 0.2, "tpot_s": None, "e2e_s": None}}))


T_975_2 = 4.302652729911275  # Student t, 97.5th percentile, 2 degrees of freedom (tables)


def test_seed_repeats_are_one_point_with_mean_and_95_interval(tmp_path):
    """A multirun `seed=0,1,2` x scheduler x budget: 3 repeats per point, not an ambiguity. Goodputs 1, 2, 3: mean
    2, sample sd 1, interval 2 -+ t(0.975, 2) / sqrt(3)."""
    job = 0
    for sched in ("orca", "sarathi"):
        for budget in (64, 256):
            for seed, goodput in zip((0, 1, 2), (1.0, 2.0, 3.0), strict=True):
                fake_job(tmp_path, str(job), [f"scheduler={sched}", f"scheduler.max_num_batched_tokens={budget}",
                                              f"seed={seed}"], goodput + (budget == 256), ttft=0.5 + seed)
                job += 1
    png = report(tmp_path)
    assert png.stat().st_size > 10_000
    lines = (tmp_path / "sweep_report.md").read_text().splitlines()
    assert lines[0].startswith("| scheduler | scheduler.max_num_batched_tokens | n | TTFT p90 (s) mean | "
                               "TTFT p90 (s) ci_low | TTFT p90 (s) ci_high |")
    assert lines[0].endswith("| goodput (req/s) mean | goodput (req/s) ci_low | goodput (req/s) ci_high |")
    rows = [r for r in lines[2:] if r.startswith("| ")]
    assert len(rows) == 4  # one per (scheduler, budget), not per job
    half = T_975_2 * 1.0 / 3 ** 0.5  # sd of (1, 2, 3) and of (0.5, 1.5, 2.5) is 1
    cells = rows[0].strip("| ").split(" | ")
    assert cells[:3] == ["orca", "64", "3"]
    assert cells[3:6] == [f"{1.5:.4g}", f"{1.5 - half:.4g}", f"{1.5 + half:.4g}"]  # TTFT p90
    assert cells[-3:] == [f"{2.0:.4g}", f"{2.0 - half:.4g}", f"{2.0 + half:.4g}"]  # goodput
    assert rows[1].startswith("| orca | 256 | 3 |") and rows[1].split(" | ")[-3] == f"{3.0:.4g}"
    assert "Repeats: jobs that differ only in seed (0, 1, 2)" in lines[-1]


def test_a_seed_given_twice_is_still_refused_and_one_seed_has_no_interval(tmp_path):
    for i, (seed, goodput) in enumerate(((0, 1.0), (1, 2.0), (1, 5.0))):
        fake_job(tmp_path, str(i), ["scheduler=orca", "scheduler.max_num_batched_tokens=64", f"seed={seed}"], goodput)
    fake_job(tmp_path, "3", ["scheduler=orca", "scheduler.max_num_batched_tokens=128", "seed=0"], 4.0)
    with pytest.raises(ValueError, match=r"jobs 1, 2 have the same value of every swept key \['seed'"):
        report(tmp_path)
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump(["scheduler=orca", "scheduler.max_num_batched_tokens=64", "seed=2"]))
    report(tmp_path)
    rows = (tmp_path / "sweep_report.md").read_text().splitlines()
    single = next(r for r in rows if r.startswith("| orca | 128 |"))
    assert single.startswith("| orca | 128 | 1 |") and single.endswith("| 4 | n/a | n/a |")
    # --repeat names another key: seed is then an ordinary facet again
    report(tmp_path, repeat="replicas")
    assert (tmp_path / "sweep_report.md").read_text().startswith("| seed | scheduler |")


def test_a_failing_job_fails_the_sweep_after_the_others_ran_and_is_named(tmp_path):
    """A job's config error used to exit the process: the jobs after it never ran and its directory held nothing.
    Now every job runs, the failed one leaves metrics.json (run_status failed, the error), the sweep exits non-zero
    and the report names the job and its error."""
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "experiments.run", "-m", f"hydra.sweep.dir={sweep}", "workload.num_requests=6",
           "output.plots=false", "output.progress=false", "scheduler=sarathi,orca",
           "scheduler.max_num_batched_tokens=0,256"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=CONF_DIR.parent, timeout=300)
    assert r.returncode != 0
    failed = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("job 0 failed (")]
    assert failed and "scheduler=sarathi" in failed[0] and "allowed: an integer >= 1" in failed[0]
    for job in (0, 2):
        m = read_metrics(sweep / str(job) / "metrics.json")
        assert m["run_status"] == "failed" and "scheduler.max_num_batched_tokens=0" in m["error"]
    for job in (1, 3):
        assert read_metrics(sweep / str(job) / "metrics.json")["run_status"] == "complete"
    report(sweep)
    md = (sweep / "sweep_report.md").read_text()
    assert md.count("| 256 |") == 2
    assert "job 0 (run_status failed: scheduler.max_num_batched_tokens=0; allowed" in md and ", 2 (" in md


def test_x_and_series_must_differ(tmp_path):
    with pytest.raises(ValueError, match="--x and --series both name seed"):
        report(tmp_path, x="seed", series="seed")


def test_x_or_series_that_no_job_overrides_is_read_from_each_job_config(tmp_path):
    """`+sweep=rates` sweeps only the rate: `--x workload.arrival.rate_rps` used to fail with "not swept in every
    job: ['scheduler']"; the series is now each job's scheduler option (and a plain key its config value)."""
    _multirun(tmp_path, "workload.arrival.rate_rps=1,4")
    report(tmp_path, x="workload.arrival.rate_rps")
    md = (tmp_path / "sweep_report.md").read_text().splitlines()
    assert md[0].startswith("| scheduler | workload.arrival.rate_rps |")
    assert [r.split(" | ")[:2] for r in md[2:]] == [["| sarathi", "1"], ["| sarathi", "4"]]
    report(tmp_path, x="workload.arrival.rate_rps", series="kv.block_size")
    assert (tmp_path / "sweep_report.md").read_text().splitlines()[2].startswith("| 16 | 1 |")
