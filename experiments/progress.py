"""Progress with a total and an ETA: across the jobs of a Hydra multirun, and across a study's runs.

``SweepProgress`` is a Hydra callback (``hydra.callbacks.progress`` in conf/config.yaml). At the start of a
multirun it counts the jobs the sweep will launch (the basic sweeper's cartesian product of the sweep overrides,
or an Optuna sweeper's ``n_trials``) and records the start time in ``<sweep dir>/.progress/``; each job, in
whatever process or machine the launcher ran it, marks itself done there at its end and logs
``multirun: 3/12 jobs done (job 5: complete), 1m10s elapsed, ETA 3m20s``. The marks are files, so the count is
right with parallel launchers (joblib, Ray, Submitit) as long as the sweep directory is shared.

``Progress`` is the same line for a loop in one process (a study's runs).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

log = logging.getLogger(__name__)
STATE_DIR = ".progress"


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``4000`` -> ``1h06m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_line(what: str, done: int, total: int | None, elapsed_s: float) -> str:
    """``what: done/total ..., elapsed, ETA`` (the ETA assumes the remaining items take the mean time so far)."""
    if not total:
        return f"{what}: {done} done, {duration(elapsed_s)} elapsed"
    eta = elapsed_s / done * (total - done) if done else None
    tail = f", ETA {duration(eta)}" if eta is not None and done < total else ""
    return f"{what}: {done}/{total} done, {duration(elapsed_s)} elapsed{tail}"


def count_jobs(config: DictConfig) -> int | None:
    """How many jobs the multirun launches; None when it cannot be known up front (another sweeper, a glob)."""
    sweeper = config.hydra.sweeper
    target = str(sweeper.get("_target_", ""))
    if "optuna" in target.lower():
        return int(sweeper.n_trials) if sweeper.get("n_trials") is not None else None
    if not target.endswith("BasicSweeper"):
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    args += list(config.hydra.overrides.task)
    try:
        overrides = OverridesParser.create().parse_overrides(args)
        total = 1
        for o in overrides:
            if o.is_sweep_override():
                total *= sum(1 for _ in o.sweep_iterator())
        return total
    except Exception:  # a sweep that needs the config loader (glob over a group): count unknown
        return None


class SweepProgress(Callback):
    """Logs ``done/total`` and an ETA after every job of a multirun (see the module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        state = Path(config.hydra.sweep.dir) / STATE_DIR
        state.mkdir(parents=True, exist_ok=True)
        for stale in state.glob("job*.done"):  # a sweep run before into the same directory: not this one's jobs
            stale.unlink()
        total = count_jobs(config)
        (state / "sweep.json").write_text(json.dumps({"total": total, "start": time.time()}))
        log.info(eta_line("multirun", 0, total, 0.0) + (f" ({total} jobs)" if total else ""))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        hc = config.hydra
        if hc.mode != RunMode.MULTIRUN:
            return
        state = Path(hc.sweep.dir) / STATE_DIR
        if not (state / "sweep.json").is_file():  # started by something that did not call on_multirun_start
            return
        info = json.loads((state / "sweep.json").read_text())
        status = getattr(getattr(job_return, "status", None), "name", "done").lower()
        (state / f"job{hc.job.num}.done").write_text(status)
        done = sum(1 for _ in state.glob("job*.done"))
        line = eta_line("multirun", done, info["total"], time.time() - info["start"])
        log.info(f"{line} (job {hc.job.num}: {status})")


class Progress:
    """``done/total`` with an ETA for a loop in one process: ``p = Progress("study", n); ...; p.step(label)``."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.done, self.start = what, total, 0, time.perf_counter()

    def step(self, label: str = "") -> str:
        self.done += 1
        line = eta_line(self.what, self.done, self.total, time.perf_counter() - self.start)
        line = f"{line} ({label})" if label else line
        log.info(line)
        return line

