"""Sweeps beyond one machine (the `cluster` extra): a multirun as Ray tasks (on a local Ray the driver starts, and
on a Ray head node the test starts, through conf/hydra/launcher/ray_cluster.yaml), as submitit jobs (its local
executor; the Slurm preset's sbatch script), and the Optuna search preset (conf/sweep/search.yaml) finding the
chunk trade-off study's best token budget. Every launcher leaves the multirun layout experiments.studies.sweep_report
reads: one directory per job number with its .hydra/overrides.yaml and metrics.json."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from core.output import read_metrics
from experiments.build import CONF_DIR
from experiments.studies.sweep_report import collect, report

ROOT = CONF_DIR.parent
SMALL = ["workload.num_requests=6", "output.plots=false", "output.progress=false"]
GRID = ["scheduler=sarathi,orca", "scheduler.max_num_batched_tokens=512,1024"]  # 4 jobs (orca: whole prompts)


def multirun(sweep: Path, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """``python -m experiments.run -m`` into ``sweep``; its output (the test fails with its tail on an error)."""
    cmd = [sys.executable, "-m", "experiments.run", "-m", f"hydra.sweep.dir={sweep}", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{' '.join(cmd)}\nexit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout + r.stderr


def check_layout(sweep: Path, n: int) -> list[tuple[dict[str, str], dict]]:
    """Jobs 0..n-1, each with its overrides and a complete metrics.json, all read back by sweep_report."""
    assert sorted((p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")), key=int) == [
        str(i) for i in range(n)]
    for i in range(n):
        assert read_metrics(sweep / str(i) / "metrics.json")["run_status"] == "complete"
    jobs = collect(sweep)
    assert len(jobs) == n
    return jobs


def check_grid(sweep: Path) -> None:
    jobs = check_layout(sweep, 4)
    swept = {(o["scheduler"], o["scheduler.max_num_batched_tokens"]) for o, _ in jobs}
    assert swept == {(s, b) for s in ("sarathi", "orca") for b in ("512", "1024")}
    assert all(m["num_completed"] == 6 for _, m in jobs)


# --- Ray ------------------------------------------------------------------------------------------------------

def _ray_pids(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the Ray temp dir a test gave its own instance)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _assert_no_ray_left(marker: str, grace_s: float = 15.0) -> None:
    """No process of this test's Ray instance is left; any that is gets killed (by pid), and the test fails."""
    deadline = time.monotonic() + grace_s
    while (left := _ray_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"Ray processes left running: {left}"


@pytest.fixture
def ray_temp_dir():
    """A short temp dir of the test's own (Ray's socket paths must stay under 108 bytes); every process of its Ray
    instance names it, which is how the test checks that none is left."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    d = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    yield d
    _assert_no_ray_left(d)
    shutil.rmtree(d, ignore_errors=True)


RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}  # no token (~/.ray/auth_token) to share


def test_ray_launcher_runs_a_multirun_on_a_local_ray(tmp_path, ray_temp_dir):
    """`hydra/launcher=ray`: the driver starts a local Ray (2 CPUs), runs every job as a Ray task, and stops it."""
    sweep = tmp_path / "sweep"
    out = multirun(sweep, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                   "+hydra.launcher.ray.init.include_dashboard=false",
                   f"+hydra.launcher.ray.init._temp_dir={ray_temp_dir}",
                   *SMALL, *GRID, env=RAY_ENV)
    assert "Ray Launcher is launching 4 jobs" in out
    check_grid(sweep)
    png = report(sweep)  # one line per scheduler against the budget
    assert png.stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_cluster_preset_joins_a_running_ray(tmp_path, ray_temp_dir):
    """`hydra/launcher=ray_cluster` with the address of a Ray head node the test starts (as `ray start --head` on
    a cluster): the jobs run on that Ray, and the head node stops with no process left."""
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
           "--num-cpus=2", "--object-store-memory=78643200", "--include-dashboard=false", f"--temp-dir={ray_temp_dir}",
           "--disable-usage-stats"]  # a small object store, as the plugin gives a Ray it starts (CI /dev/shm)
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **RAY_ENV})
    lines, started = [], threading.Event()

    def drain():  # reads the head's output to its end, so that a full pipe never blocks it
        for line in head.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        started.wait(timeout=180)
        assert started.is_set() and head.poll() is None, "ray start --head failed:\n" + "".join(lines[-30:])
        sweep = tmp_path / "sweep"
        out = multirun(sweep, "hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address=127.0.0.1:{port}",
                       *SMALL, *GRID, env=RAY_ENV)
        assert "Connecting to existing Ray cluster" in out
        check_grid(sweep)
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head's own process group (start_new_session): its Ray processes
        try:
            head.wait(timeout=3)  # a clean stop takes ~30 s here; the instance is the test's own, so no need
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        reader.join(timeout=10)
        head.stdout.close()


# --- Submitit -------------------------------------------------------------------------------------------------

def test_submitit_local_runs_a_multirun(tmp_path):
    """`hydra/launcher=submitit_local`: every job a submitit job (a local process), results in the same layout;
    submitit's own files stay in the hidden .submitit/ that sweep_report skips."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    out = multirun(sweep, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", *SMALL, *GRID)
    assert "Submitit 'local' sweep output dir" in out
    check_grid(sweep)
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 4


def test_slurm_cluster_preset_makes_an_sbatch_script(tmp_path, monkeypatch):
    """conf/hydra/launcher/slurm_cluster.yaml composes, and the parameters the plugin hands submitit (translated
    as the plugin does) are ones submitit's Slurm executor takes, ending in the sbatch script's lines. (No Slurm
    here: a stand-in `srun` on PATH lets the executor be built; nothing is submitted.)"""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm_cluster", "hydra.launcher.partition=gpu_a",
                                           "hydra.launcher.setup=[source /shared/venv/bin/activate]",
                                           f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 0\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    params = {k: v for k, v in OmegaConf.to_container(launcher, resolve=False).items() if k != "_target_"}
    executor = submitit.AutoExecutor(folder=str(tmp_path / ".submitit" / "%j"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    params.pop("submitit_folder")
    params["name"] = "run"  # ${hydra.job.name}, set when a job runs
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -m experiments.run", "uid")
    for line in ("#SBATCH --partition=gpu_a", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=16GB",
                 "#SBATCH --time=60", "source /shared/venv/bin/activate"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"


# --- Optuna search ----------------------------------------------------------------------------------------------

def test_search_preset_returns_the_run_goodput(tmp_path):
    """`+sweep=search` as shipped (TPE, seed 0; here 4 trials in one process): each trial is a job of the multirun
    layout, and Optuna's best value is the best goodput_rps in the jobs' metrics.json."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    multirun(sweep, "+sweep=search", "hydra/launcher=basic", "hydra.sweeper.n_trials=4", "workload.num_requests=12",
             "workload.arrival.rate_rps=16", "output.progress=false")
    jobs = check_layout(sweep, 4)
    keys = {"scheduler.max_num_batched_tokens", "scheduler.max_num_seqs", "router", "replicas"}
    assert all(keys <= set(o) for o, _ in jobs)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(m["goodput_rps"] for _, m in jobs)
    assert set(best["best_params"]) == keys


def test_search_finds_the_chunk_tradeoff_best_budget(tmp_path):
    """The optimum is known: the chunk trade-off study (tiny scale, every budget of the full study) names its best
    budget; the search preset over the same budgets (the study's other settings fixed, exhaustively: the grid
    sampler, 8 trials) returns that budget and its goodput."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra import compose, initialize_config_dir

    from experiments.studies.study import run_study

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("study", overrides=["study=chunk_tradeoff", "study.scale=tiny", "output.progress=false"])
    budgets = [int(b) for b in cfg.study.budgets]
    cfg.study.tiny.budgets = budgets
    run_study(cfg, tmp_path / "study")
    numbers = json.loads((tmp_path / "study" / "summary.json").read_text())["numbers"]
    source = numbers["sim.best_goodput_rps"]["source"]  # sim/budget=<best>/metrics.json:goodput_rps
    best_budget = int(source.split("budget=")[1].split("/")[0])
    assert best_budget not in (budgets[0], budgets[-1])  # an inner optimum: the trade-off, not an edge

    sweep = tmp_path / "search"
    # choice(x) rather than a plain x for the fixed keys: the plugin sizes the grid before it drops plain values
    multirun(sweep, "+study=chunk_tradeoff", "+sweep=search", "hydra/launcher=basic", "hydra/sweeper/sampler=grid",
             *cfg.study.tiny.overrides, f"scheduler.max_num_batched_tokens=choice({','.join(map(str, budgets))})",
             f"scheduler.max_num_seqs=choice({cfg.scheduler.max_num_seqs})", "router=choice(round_robin)",
             "replicas=choice(1)", "output.progress=false")
    jobs = check_layout(sweep, len(budgets))
    assert sorted(int(o["scheduler.max_num_batched_tokens"]) for o, _ in jobs) == budgets
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_params"]["scheduler.max_num_batched_tokens"] == best_budget
    assert result["best_value"] == pytest.approx(numbers["sim.best_goodput_rps"]["value"], rel=1e-9)


def test_objective_is_the_named_metric():
    """What experiments.run returns to a sweeper: goodput_rps unless `objective` names another metrics.json key."""
    from omegaconf import OmegaConf

    from experiments.run import objective

    metrics = {"goodput_rps": 3.5, "ttft_s": {"p90": 0.25, "p99": None}, "backend": "sim"}
    assert objective(OmegaConf.create({}), metrics) == 3.5
    assert objective(OmegaConf.create({"objective": "ttft_s.p90"}), metrics) == 0.25
    assert objective(OmegaConf.create({"objective": "ttft_s.p99"}), metrics) is None
    for bad, message in (("goodput", "not a key"), ("ttft_s.p50", "not a key"), ("ttft_s", "not a number"),
                         ("backend", "not a number")):
        with pytest.raises(ValueError, match=f"objective={bad}: {message}"):
            objective(OmegaConf.create({"objective": bad}), metrics)
