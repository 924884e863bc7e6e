"""The discrete-event driver: arrivals -> router -> replicas, each running the shared step loop.

One SimPy event per step (never per token). The same driver runs the real engine: only the Executor
differs (a cost model here, a forward pass there), and an executor with ``wall_clock = True`` gets the
measured ``schedule()`` time added to its step, so scheduling overhead is part of a measured step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from core.batch import Batch
from core.interfaces import Executor, Router, Workload
from core.records import StepRecord
from core.replica import Replica
from core.request import Request, RequestState


@dataclass
class RunResult:
    states: list[RequestState]
    steps: list[StepRecord]
    end_s: float  # simulated time of the last event
    wall_s: float  # wall-clock seconds the run took
    batches: list[Batch] = field(default_factory=list)  # filled only with keep_batches=True


class Simulation:
    def __init__(self, replicas: Sequence[Replica], executors: Sequence[Executor], router: Router,
                 workload: Workload, keep_batches: bool = False, progress: bool = False) -> None:
        if len(replicas) != len(executors) or not replicas:
            raise ValueError(f"need one executor per replica, got {len(replicas)} replicas, {len(executors)} executors")
        self.env = simpy.Environment()
        self.replicas = list(replicas)
        self.executors = list(executors)
        self.router = router
        self.workload = workload
        self.keep_batches = keep_batches
        self.states: list[RequestState] = []
        self.steps: list[StepRecord] = []
        self.batches: list[Batch] = []
        self._wake: list[simpy.Event | None] = [None] * len(self.replicas)
        self._ids: set[str] = set()
        self._progress = progress
        self._bar = None
        for r in self.replicas:
            r.on_terminal = self._on_terminal

    def run(self) -> RunResult:
        t0 = time.perf_counter()
        if self._progress:
            from tqdm import tqdm

            self._bar = tqdm(desc="requests", unit="req", mininterval=1.0)
        self.env.process(self._arrivals())
        for i in range(len(self.replicas)):
            self.env.process(self._replica_loop(i))
        self.env.run()
        if self._bar is not None:
            self._bar.close()
        stuck = [s.id for r in self.replicas for s in (*r.waiting, *r.running)]
        if stuck:  # only a scheduler that refuses work on a busy replica can cause this
            raise RuntimeError(f"simulation ended with {len(stuck)} unfinished requests, e.g. {stuck[:5]}")
        return RunResult(self.states, self.steps, self.env.now, time.perf_counter() - t0, self.batches)

    # ---- processes -----------------------------------------------------------------------------------------
    def _arrivals(self):
        for req in self.workload.initial():
            if req.arrival_s > self.env.now:
                yield self.env.timeout(req.arrival_s - self.env.now)
            self._dispatch(req)

    def _delayed(self, req: Request):
        yield self.env.timeout(max(req.arrival_s - self.env.now, 0.0))
        self._dispatch(req)

    def _dispatch(self, req: Request) -> None:
        if req.id in self._ids:
            raise ValueError(f"workload yielded request id {req.id!r} twice; request ids must be unique")
        self._ids.add(req.id)
        idx = self.router.route(req, [r.view() for r in self.replicas]) if len(self.replicas) > 1 else 0
        if not 0 <= idx < len(self.replicas):
            raise RuntimeError(f"router {type(self.router).__name__} returned replica {idx} of {len(self.replicas)}")
        self.states.append(self.replicas[idx].add(req, self.env.now))
        wake = self._wake[idx]
        if wake is not None and not wake.triggered:
            wake.succeed()

    def _replica_loop(self, i: int):
        replica, executor, env = self.replicas[i], self.executors[i], self.env
        wall_clock = getattr(executor, "wall_clock", False)
        clock = time.perf_counter if wall_clock else (lambda: 0.0)
        while True:
            t0 = clock()
            batch = replica.schedule(env.now)
            if batch.empty:
                if replica.running:
                    raise RuntimeError(f"scheduler {type(replica.scheduler).__name__} returned an empty batch "
                                       f"with {len(replica.running)} running requests on replica {i}")
                if replica.waiting:
                    continue  # the replica rejected an unschedulable head request; try the next one
                self._wake[i] = env.event()
                yield self._wake[i]
                self._wake[i] = None
                continue
            sched_s = clock() - t0
            out = executor.execute(batch)
            duration = out.duration_s + sched_s
            start = env.now
            yield env.timeout(duration)
            replica.apply(batch, out.tokens, env.now)
            self.steps.append(StepRecord(i, start, duration, batch.features, replica.kv.num_used_blocks,
                                         len(batch.preempted)))
            if self.keep_batches:
                self.batches.append(batch)

    def _on_terminal(self, state: RequestState, now: float) -> None:
        release = getattr(self.executors[state.replica], "release", None)
        if release is not None:  # the engine drops per-request buffers
            release(state.id)
        if self._bar is not None:
            self._bar.update(1)
        nxt = self.workload.on_finish(state, now)
        if nxt is not None:
            self.env.process(self._delayed(nxt))
