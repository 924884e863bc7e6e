"""Running configs for the calibration experiments: command-line style overrides, the engine's stopwatch, runs with
custom executors (replay), and runs that take turns step by step (``run_interleaved``).

All runs write the DESIGN section 8 files plus their resolved ``config.yaml``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from core.batch import Batch
from core.interfaces import Executor, StepOutput
from core.replica import Replica
from core.specs import ModelSpec
from experiments.build import (
    CONF_DIR,
    build_executors,
    model_spec,
    replicas_for,
    simulation,
    write_results,
)
from experiments.build import run as run_config
from sim.cost.replay import replay_executors

CLOCKS = ("auto", "wall", "thread")
COMPARED_FILES = ("requests.csv", "tokens.csv")


# ---- the engine's stopwatch ---------------------------------------------------------------------------------
class ThreadClockExecutor:
    """An engine executor timed by the CPU time of the calling thread instead of the wall clock.

    On a CPU engine with one torch thread every operator runs on the calling thread, so its CPU time is the step's
    compute time without the time other processes held the core: on a shared machine the wall clock of a step
    swings by tens of percent with the neighbours' load, its thread CPU time far less. ``engine_clock=thread``.
    """

    wall_clock = True

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    def execute(self, batch: Batch) -> StepOutput:
        t0 = time.thread_time()
        out = self.inner.execute(batch)
        return StepOutput(out.tokens, time.thread_time() - t0)

    def __getattr__(self, name: str):  # release(), warmup(), runner ... of the wrapped engine executor
        return getattr(self.inner, name)


def engine_clock(cfg: DictConfig) -> str:
    """The stopwatch of engine steps: ``engine_clock`` wall | thread, or auto (thread for the CPU engine on one
    torch thread, else wall). thread needs that CPU setting."""
    clock = cfg.get("engine_clock", "auto") or "auto"
    if clock not in CLOCKS:
        raise ValueError(f"engine_clock={clock!r}; allowed: {list(CLOCKS)}")
    b = cfg.backend
    one_cpu_thread = b.get("device", "cpu") == "cpu" and b.get("num_threads") == 1
    if clock == "auto":
        return "thread" if one_cpu_thread else "wall"
    if clock == "thread" and b.name == "engine" and not one_cpu_thread:
        raise ValueError(f"engine_clock=thread needs backend.device=cpu and backend.num_threads=1, got "
                         f"device={b.get('device')!r} num_threads={b.get('num_threads')!r}; or set engine_clock=wall")
    return clock


def executors_for(cfg: DictConfig, spec: ModelSpec, replicas: list[Replica]) -> list[Executor]:
    """``build_executors``, with engine executors on the ``engine_clock`` stopwatch."""
    clock = engine_clock(cfg)
    executors = build_executors(cfg, spec, replicas)
    if cfg.backend.name != "engine" or clock == "wall":
        return executors
    return [ThreadClockExecutor(e) for e in executors]


# ---- configs ---------------------------------------------------------------------------------------------------
def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A copy of ``cfg`` with command-line style overrides: ``group=option`` swaps a config group for
    conf/<group>/<option>.yaml, ``a.b=value`` sets a key (value parsed as YAML, as Hydra does)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for item in overrides:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected key=value")
        if "." not in key and (CONF_DIR / key).is_dir():
            option = CONF_DIR / key / f"{value}.yaml"
            if not option.is_file():
                allowed = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
                raise ValueError(f"override {item!r}: no option {value!r} in group {key}; allowed: {allowed}")
            out[key] = OmegaConf.load(option)
        else:
            OmegaConf.update(out, key, yaml.safe_load(value) if value else None, merge=False, force_add=True)
    return out


def with_backend(cfg: DictConfig, name: str) -> DictConfig:
    """``cfg`` on backend ``name``; keeps the configured backend section when it already is that backend."""
    if cfg.backend.name == name:
        return cfg
    return apply_overrides(cfg, [f"backend={name}"])


def with_calibration(cfg: DictConfig, path: str | Path) -> DictConfig:
    """The simulator with a calibration file as its cost model (what ``cost_model=calibrated`` does)."""
    out = apply_overrides(with_backend(cfg, "sim"), ["cost_model=calibrated"])
    out.cost_model.path = str(Path(path).resolve())
    return out


def save_config(cfg: DictConfig, out_dir: Path) -> None:
    try:
        text = OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # an unresolvable key (e.g. ``???``) still leaves a readable record
        text = OmegaConf.to_yaml(cfg)
    (out_dir / "config.yaml").write_text(text)


def run(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """``experiments.build.run`` (engine runs on the ``engine_clock`` stopwatch) plus the resolved config saved
    next to the run's files."""
    out = Path(out_dir)
    if cfg.backend.name == "engine" and engine_clock(cfg) != "wall":
        return run_with_executors(cfg, out, lambda reps: executors_for(cfg, model_spec(cfg), reps), "engine")
    metrics = run_config(cfg, out)
    save_config(cfg, out)
    return metrics


# ---- runs --------------------------------------------------------------------------
def _simulation(cfg: DictConfig, make: Callable[[list[Replica]], list[Executor]],
                replicas: list[Replica] | None = None):
    sim = simulation(cfg, make, replicas)
    return sim, sim.executors


def _shared_executors(cfgs: Mapping[str, DictConfig],
                      replicas: Mapping[str, list[Replica]]) -> dict[str, list[Executor]]:
    """Executors per run; runs with the same model, backend and seed share one engine model (one
    ``build_executors`` call over all their replicas), so taking turns does not also swap the weights in caches."""
    groups: dict[str, list[str]] = {}
    for name, cfg in cfgs.items():
        key = json.dumps([OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "backend")]
                         + [cfg.seed, engine_clock(cfg)], sort_keys=True, default=str)
        groups.setdefault(key, []).append(name)
    out: dict[str, list[Executor]] = {}
    for names in groups.values():
        cfg = cfgs[names[0]]
        every = executors_for(cfg, model_spec(cfg), [r for n in names for r in replicas[n]])
        for n in names:
            out[n], every = every[:len(replicas[n])], every[len(replicas[n]):]
    return out


def _write(cfg: DictConfig, result, executors: Sequence[Executor], out_dir: str | Path,
           backend_label: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    for ex in executors:
        check = getattr(ex, "check_done", None)
        if check is not None:
            check()
    extra = dict(extra or {})
    if backend_label == "engine":
        extra["engine_clock"] = engine_clock(cfg)
    metrics = write_results(cfg, result, out_dir, backend_label, extra)
    save_config(cfg, Path(out_dir))
    return metrics


def run_with_executors(cfg: DictConfig, out_dir: str | Path, make: Callable[[list[Replica]], list[Executor]],
                       backend_label: str) -> dict[str, Any]:
    """Run ``cfg`` with executors from ``make(replicas)`` (same replicas, router and workload as
    ``build.run``) and write the run directory."""
    sim, executors = _simulation(cfg, make)
    return _write(cfg, sim.run(), executors, out_dir, backend_label)


class _Baton:
    """Lets simulations in several threads run one at a time, handing over at every step (see run_interleaved)."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.active = list(range(n))
        self.holder = 0
        self.stop = False  # set when the primary run ends: the others stop at their next step

    def wait(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == i)

    def _next(self, i: int) -> int:
        later = [j for j in self.active if j > i]
        return (later or self.active or [i])[0]

    def hand_over(self, i: int) -> None:
        with self.cond:
            self.holder = self._next(i)
            self.cond.notify_all()

    def leave(self, i: int, stop_others: bool = False) -> None:
        with self.cond:
            self.active.remove(i)
            self.stop = self.stop or stop_others
            if self.holder == i and self.active:
                self.holder = self._next(i)
            self.cond.notify_all()


class _Stopped(Exception):
    """Raised inside a background run's step once the primary run has finished."""


class _TakeTurns:
    """Executor wrapper: hand the machine to the next simulation, run this step when it comes back."""

    def __init__(self, inner: Executor, baton: _Baton, index: int, total: int) -> None:
        self.inner, self.baton, self.index, self.total = inner, baton, index, total
        self.wall_clock = getattr(inner, "wall_clock", False)
        self.paired_steps = 0  # steps run while every run was still going

    def execute(self, batch):
        self.baton.hand_over(self.index)
        self.baton.wait(self.index)
        if self.baton.stop:
            raise _Stopped
        if len(self.baton.active) == self.total:
            self.paired_steps += 1
        return self.inner.execute(batch)


def run_interleaved(cfgs: Mapping[str, DictConfig], out_dirs: Mapping[str, str | Path],
                    primary: str | None = None) -> dict[str, dict[str, Any]]:
    """Run several configs (e.g. a held-out and a training engine workload) step by step in turn: one thread per
    run, only one of them working at any time, handing over at every step. Each run's timeline is its own (its
    clock advances by its own step times), so its files are those of a run alone; but all runs see the machine in
    the same state, so a shared machine's drift over the minute they take hits them alike instead of biasing a
    comparison of runs made one after the other.

    With ``primary``, the other runs stop when it ends (their files then hold what they did so far; metrics
    ``stopped_early`` is True): a long training run measured alongside costs no more than the primary. Each
    returned metrics dict holds ``paired_steps`` (not written): steps run while every run was still going."""
    from sim.simulator import RunResult

    names = list(cfgs)
    if primary is not None and primary not in cfgs:
        raise ValueError(f"primary={primary!r} is not one of the runs {names}")
    baton = _Baton(len(names))
    sims, results, errors, stopped = {}, {}, {}, set()
    replicas = {n: replicas_for(cfgs[n]) for n in names}
    executors = _shared_executors(cfgs, replicas)
    for i, name in enumerate(names):
        sims[name] = _simulation(cfgs[name], lambda reps, i=i, name=name: [_TakeTurns(e, baton, i, len(names))
                                                                           for e in executors[name]], replicas[name])

    def work(i: int, name: str) -> None:
        sim = sims[name][0]
        t0 = time.perf_counter()
        try:
            baton.wait(i)
            results[name] = sim.run()
        except _Stopped:
            stopped.add(name)
            results[name] = RunResult(sim.states, sim.steps, sim.env.now, time.perf_counter() - t0)
        except BaseException as e:  # re-raised by the caller's thread
            errors[name] = e
        finally:
            baton.leave(i, stop_others=name == primary)

    threads = [threading.Thread(target=work, args=(i, n), name=f"run-{n}", daemon=True) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        name, err = next(iter(errors.items()))
        raise RuntimeError(f"interleaved run {name!r} failed: {err}") from err
    out = {}
    for n in names:
        out[n] = _write(cfgs[n], results[n], sims[n][1], out_dirs[n], cfgs[n].backend.name,
                        {"stopped_early": n in stopped} if primary is not None else None)
        out[n]["paired_steps"] = sum(e.paired_steps for e in sims[n][1])
    return out


def replay(cfg: DictConfig, recording: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Simulate ``cfg`` with the step durations recorded in ``recording`` (a run directory); raises
    ``ReplayDivergence`` at the first step whose batch differs from the recording."""
    return run_with_executors(with_backend(cfg, "sim"), out_dir,
                              lambda reps: replay_executors(recording, len(reps)), "replay")


def same_files(a: str | Path, b: str | Path, names: Sequence[str] = COMPARED_FILES) -> dict[str, bool]:
    return {n: (Path(a) / n).read_bytes() == (Path(b) / n).read_bytes() for n in names}


