"""Simulated time for the serving loop (``core.loop``): one event per step, on a heap ordered exactly as SimPy.

Time jumps by each step's duration, whatever produced it: a cost model, a replayed recording, or the engine's
measured step (the virtual-measured clock of engine runs: requests arrive at their trace times, idle gaps are
skipped instead of slept, so a replay of the engine's step times reproduces its timestamps exactly).

``HeapClock`` (the default of ``run_virtual``) and ``SimPyClock`` produce the same event order, hence identical runs;
the heap is several times cheaper per event. Fast-forwarded decode steps (``core.fast_forward``) are still one
event each, so the order of events -- and every output -- is the per-step run's.
"""

from __future__ import annotations

import heapq
import itertools
import time

import simpy

from core.fast_forward import DecodeRun
from core.loop import Decodes, Idle, Process, RunResult, ServingLoop, Sleep, Until


class SimPyClock:
    """``core.loop.Clock`` on a SimPy environment."""

    drives_decodes = True  # core.loop.DecodeClock: a Decodes wait is one timeout per step

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

    def run(self) -> None:
        self.env.run()

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
            elif type(wait) is Decodes:
                seconds = wait.seconds
                while seconds is not None:
                    yield env.timeout(seconds)
                    seconds = wait.run.advance(env.now)
            else:
                raise TypeError(f"a loop process yielded {wait!r}; expected Until, Sleep or Idle")


URGENT, NORMAL = 0, 1  # SimPy's event priorities: a started process runs before other events at the same time


class HeapClock:
    """``core.loop.Clock`` on a plain heap of ``(time, priority, sequence number, process)``: SimPy's event order
    exactly (``SimPyClock``'s runs and this one's are identical, event for event), at a fraction of the cost.

    SimPy orders events by (time, priority, creation order); a process is resumed when the event it waits for is
    popped. The loop's processes wait on three things, and each maps to one heap entry created at the same moment
    SimPy creates its event: ``Sleep`` -> a timeout at ``now + seconds``; ``Until`` -> a timeout of
    ``max(time - now, 0.0)`` (the same float arithmetic); ``Idle`` -> nothing until ``wake``, which schedules the
    process at ``now`` (SimPy's ``succeed``); ``start`` -> an URGENT entry at ``now`` (SimPy's ``Initialize``).
    Events SimPy schedules that resume nobody (a finished process's own event) only consume sequence numbers, which
    never changes the relative order of the rest. What it saves is SimPy's Event objects, callbacks and the
    wrapping generator: one heap push and pop and one generator resume per step. A fast-forwarded decode step
    (``core.loop.Decodes``) is an entry that carries its ``DecodeRun``: when it is popped the clock calls
    ``run.advance(now)`` and pushes the next step exactly as the process's next ``Sleep`` would have been pushed,
    resuming the process only when the run ends.
    """

    drives_decodes = True  # core.loop.DecodeClock

    def __init__(self, num_replicas: int) -> None:
        self._now: float = 0  # SimPy's initial time is the int 0 (until a float delay is added): written as "0"
        # (time, priority, sequence number, process, the DecodeRun whose step ends then, if any)
        self._queue: list[tuple[float, int, int, Process, DecodeRun | None]] = []
        self._seq = itertools.count()
        self._idle: list[Process | None] = [None] * num_replicas

    @property
    def now(self) -> float:
        return self._now

    def start(self, process: Process) -> None:
        heapq.heappush(self._queue, (self._now, URGENT, next(self._seq), process, None))

    def wake(self, replica: int) -> None:
        process = self._idle[replica]
        if process is not None:
            self._idle[replica] = None
            heapq.heappush(self._queue, (self._now, NORMAL, next(self._seq), process, None))

    def run(self) -> None:
        queue, seq, push, pop = self._queue, self._seq, heapq.heappush, heapq.heappop
        while queue:
            now, _, _, process, run = pop(queue)
            self._now = now
            if run is not None:  # a fast-forwarded decode step ended: the next one, or back to the process
                seconds = run.advance(now)
                if seconds is not None:
                    push(queue, (now + seconds, NORMAL, next(seq), process, run))
                    continue
            try:
                wait = next(process)
            except StopIteration:
                continue
            kind = type(wait)
            if kind is Sleep:
                if wait.seconds < 0:
                    raise ValueError(f"Negative delay {wait.seconds}")
                push(queue, (now + wait.seconds, NORMAL, next(seq), process, None))
            elif kind is Until:
                push(queue, (now + max(wait.time_s - now, 0.0), NORMAL, next(seq), process, None))
            elif kind is Idle:
                self._idle[wait.replica] = process
            elif kind is Decodes:
                push(queue, (now + wait.seconds, NORMAL, next(seq), process, wait.run))
            else:
                raise TypeError(f"a loop process yielded {wait!r}; expected Until, Sleep, Idle or Decodes")


CLOCKS = {"heap": HeapClock, "simpy": SimPyClock}


def run_virtual(loop: ServingLoop, progress: bool = False, clock: str = "heap") -> RunResult:
    """Run ``loop`` to the end in simulated time (every request terminal, no event left). ``clock``: ``heap``
    (``HeapClock``, the default) or ``simpy`` (``SimPyClock``): the same event order, so the same outputs."""
    t0 = time.perf_counter()
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}; allowed: {list(CLOCKS)}")
    sim_clock = CLOCKS[clock](loop.num_idle_slots)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="requests", unit="req", mininterval=1.0)
        loop.on_terminal.append(lambda state, now: bar.update(1))
    try:
        for process in loop.processes(sim_clock):
            sim_clock.start(process)
        sim_clock.run()
    finally:
        if bar is not None:
            bar.close()
    loop.finish()
    return loop.result(time.perf_counter() - t0)
