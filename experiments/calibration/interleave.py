"""Runs that take turns step by step (``run_interleaved``): several engine runs measured on the same machine state."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from core.batch import Batch
from core.interfaces import BaseExecutor, Executor, StepOutput
from core.loop import ServingLoop
from core.replica import Replica
from experiments.build import build_executors, build_loop, build_replicas
from experiments.config import RunConfig
from experiments.run import finish_run
from sim.clock import run_virtual


class _Baton:
    """Lets runs in several threads work one at a time, handing over at every step."""

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


class _TakeTurns(BaseExecutor):
    """Executor wrapper: hand the machine to the next run, run this step when it comes back."""

    def __init__(self, inner: Executor, baton: _Baton, index: int, total: int) -> None:
        self.inner, self.baton, self.index, self.total = inner, baton, index, total
        self.stopwatch = inner.stopwatch
        self.paired_steps = 0  # steps run while every run was still going

    def execute(self, batch: Batch) -> StepOutput:
        self.baton.hand_over(self.index)
        self.baton.wait(self.index)
        if self.baton.stop:
            raise _Stopped
        if len(self.baton.active) == self.total:
            self.paired_steps += 1
        return self.inner.execute(batch)

    @property
    def copy_s(self) -> float:
        return self.inner.copy_s

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def finish(self) -> None:
        self.inner.finish()
    # predicts_decodes stays False (BaseExecutor): every step must take its turn, so none is fast-forwarded


def _shared_executors(runs: Mapping[str, RunConfig],
                      replicas: Mapping[str, list[Replica]]) -> dict[str, list[Executor]]:
    """Executors per run; runs with the same model, backend options, quantisation and seed share one engine model
    (one ``build_executors`` call over all their replicas), so taking turns does not also swap the weights in
    caches."""
    groups: dict[str, list[str]] = {}
    for name, r in runs.items():
        key = repr((r.model, r.sim, r.engine, r.quant, r.seed, r.engine_clock))  # records hold dicts: no hash
        groups.setdefault(key, []).append(name)
    out: dict[str, list[Executor]] = {}
    for names in groups.values():
        every = build_executors(runs[names[0]], [r for n in names for r in replicas[n]])
        for n in names:
            out[n], every = every[:len(replicas[n])], every[len(replicas[n]):]
    return out


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
    names = list(cfgs)
    if primary is not None and primary not in cfgs:
        raise ValueError(f"primary={primary!r} is not one of the runs {names}")
    baton = _Baton(len(names))
    loops: dict[str, ServingLoop] = {}
    results, errors, stopped = {}, {}, set()
    runs = {n: RunConfig.from_config(cfgs[n]) for n in names}
    replicas = {n: build_replicas(runs[n]) for n in names}
    executors = _shared_executors(runs, replicas)
    for i, name in enumerate(names):
        wrapped = [_TakeTurns(e, baton, i, len(names)) for e in executors[name]]
        loops[name] = build_loop(runs[name], lambda reps, w=wrapped: w, replicas[name])

    def work(i: int, name: str) -> None:
        loop = loops[name]
        t0 = time.perf_counter()
        try:
            baton.wait(i)
            results[name] = run_virtual(loop)
        except _Stopped:
            stopped.add(name)
            results[name] = loop.result(time.perf_counter() - t0)
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
        extra = {"stopped_early": n in stopped} if primary is not None else None
        out[n] = finish_run(runs[n], loops[n], results[n], out_dirs[n], extra=extra)
        out[n]["paired_steps"] = sum(e.paired_steps for e in loops[n].executors)
    return out

