"""Simulated time for the serving loop (``core.loop``): SimPy runs its processes, one event per step.

Time jumps by each step's duration, whatever produced it: a cost model, a replayed recording, or the engine's
measured step (the virtual-measured clock of engine runs: requests arrive at their trace times, idle gaps are
skipped instead of slept, so a replay of the engine's step times reproduces its timestamps exactly).
"""

from __future__ import annotations

import time

import simpy

from core.loop import Idle, Process, RunResult, ServingLoop, Sleep, Until


class SimPyClock:
    """``core.loop.Clock`` on a SimPy environment."""

    def __init__(self, num_replicas: int) -> None:
        self.env = simpy.Environment()
        self._idle: list[simpy.Event | None] = [None] * num_replicas

    @property
    def now(self) -> float:
        return self.env.now

    def start(self, process: Process) -> None:
        self.env.process(self._drive(process))

    def wake(self, replica: int) -> None:
        event = self._idle[replica]
        if event is not None and not event.triggered:
            event.succeed()

    def _drive(self, process: Process):
        env = self.env
        for wait in process:
            if type(wait) is Sleep:
                yield env.timeout(wait.seconds)
            elif type(wait) is Until:
                yield env.timeout(max(wait.time_s - env.now, 0.0))
            elif type(wait) is Idle:
                event = self._idle[wait.replica] = env.event()
                yield event
                self._idle[wait.replica] = None
            else:
                raise TypeError(f"a loop process yielded {wait!r}; expected Until, Sleep or Idle")


def simulate(loop: ServingLoop, progress: bool = False) -> RunResult:
    """Run ``loop`` to the end in simulated time (every request terminal, no event left)."""
    t0 = time.perf_counter()
    clock = SimPyClock(len(loop.replicas))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="requests", unit="req", mininterval=1.0)
        loop.on_terminal.append(lambda state, now: bar.update(1))
    try:
        for process in loop.processes(clock):
            clock.start(process)
        clock.env.run()
    finally:
        if bar is not None:
            bar.close()
    loop.finish()
    return loop.result(time.perf_counter() - t0)
