"""Wall-clock time for the serving loop (``core.loop``): the server's clock.

One thread runs every process of the loop. A process waiting ``Until`` a time or for the rest of a ``Sleep``
sits in a heap of due times; an ``Idle`` replica is parked until a dispatch wakes it. Other threads (HTTP
handlers) never touch the loop's state: they hand work to the loop thread with ``call`` (``submit`` for a
request), which returns a ``concurrent.futures.Future``.

A measured step (the engine) has already spent its time when its process yields ``Sleep``, so the process is due
at once; a predicted step (a cost model) is waited out, which makes a simulated model serve at its modelled
speed in real time.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from core.loop import Idle, Process, RunResult, ServingLoop, Sleep, Until


class RealTimeClock:
    """``core.loop.Clock`` on ``time.perf_counter``, zero at construction."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._heap: list[tuple[float, int, Process]] = []
        self._seq = itertools.count()  # FIFO among processes due at the same time
        self._idle: dict[int, Process] = {}
        self._inbox: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False

    @property
    def now(self) -> float:
        return time.perf_counter() - self._t0

    # ---- core.loop.Clock (loop thread only) -----------------------------------------------------------------
    def start(self, process: Process) -> None:
        heapq.heappush(self._heap, (self.now, next(self._seq), process))

    def wake(self, replica: int) -> None:
        process = self._idle.pop(replica, None)
        if process is not None:
            self.start(process)

    # ---- any thread -----------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the loop thread; its result (or exception) arrives in the returned future."""
        fut: Future = Future()
        with self._cond:
            if self._stop:
                fut.set_exception(RuntimeError("the serving loop has stopped"))
                return fut
            self._inbox.append((fn, fut))
            self._cond.notify()
        return fut

    def stop(self) -> None:
        """Let ``run`` return after the work it is doing now (requests still queued stay where they are)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    # ---- the loop thread ------------------------------------------------------------------------------------
    def run(self, processes: list[Process], until_idle: bool = False) -> None:
        """Run ``processes`` (and those they start) until ``stop()``; with ``until_idle``, also return once no
        process is due and no call is pending (every replica idle, arrivals done: a workload run's end)."""
        for p in processes:
            self.start(p)
        while True:
            with self._cond:
                calls = list(self._inbox)
                self._inbox.clear()
                stop = self._stop
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller sees it; the loop goes on
                    fut.set_exception(e)
            if stop:
                self._fail_pending()
                return
            if calls:
                continue
            if self._heap and self._heap[0][0] <= self.now:
                _, _, process = heapq.heappop(self._heap)
                self._advance(process)
                continue
            if until_idle and not self._heap:
                return
            with self._cond:
                if not self._inbox and not self._stop:
                    self._cond.wait(self._heap[0][0] - self.now if self._heap else None)

    def _advance(self, process: Process) -> None:
        try:
            wait = next(process)
        except StopIteration:
            return
        if type(wait) is Sleep:
            heapq.heappush(self._heap, (wait.since + wait.seconds, next(self._seq), process))
        elif type(wait) is Until:
            heapq.heappush(self._heap, (wait.time_s, next(self._seq), process))
        elif type(wait) is Idle:
            self._idle[wait.replica] = process
        else:
            raise TypeError(f"a loop process yielded {wait!r}; expected Until, Sleep or Idle")

    def _fail_pending(self) -> None:
        with self._cond:
            calls = list(self._inbox)
            self._inbox.clear()
        for _, fut in calls:
            fut.set_exception(RuntimeError("the serving loop has stopped"))


def run_in_real_time(loop: ServingLoop) -> RunResult:
    """Run a workload's loop on the wall clock in this thread, to its end (arrivals done, every replica idle)."""
    clock = RealTimeClock()
    clock.run(loop.processes(clock), until_idle=True)
    loop.finish()
    return loop.result(clock.now)
