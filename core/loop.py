"""The serving loop every backend drives: arrivals -> router -> replicas, each running

    batch = replica.schedule(now)
    out = executor.execute(batch)
    replica.apply(batch, out.tokens, now + out.duration_s)

It is written once, as generator *processes* that yield what they wait for (``Until`` a time, ``Sleep`` for a
step's duration, ``Idle`` until a request arrives). A ``Clock`` runs the processes and is the one thing that
varies between backends:

- ``sim.clock.SimPyClock``: simulated time (a cost model's step times, or measured ones replayed or taken from
  the engine: time jumps by each step's duration, idle gaps are skipped);
- ``core.realtime.RealTimeClock``: the wall clock (the server); requests also come in from other threads.

The loop depends on core only. It never looks executor attributes up by name: ``core.interfaces.Executor``
declares all it uses.

Decode fast-forward (``core.fast_forward``): after a step that leaves every running request in decode, where the
executor ``predicts_decodes`` (the simulator's cost model), the scheduler declares ``SteadyDecodeScheduler`` and
nobody listens to steps, the replica's next identical decode steps run without schedule / execute / apply -- still
one ``Sleep`` and one step record each, so the clock's event order and every output stay the per-step run's.

Replica groups (``groups``: the attention data-parallel ranks of an MoE deployment, ``sim.pipeline``): replicas
that step together, as one process: each schedules its own batch, a ``GroupExecutor`` prices them at once, every
member's step lasts the group's step (one step record per member that ran a batch); no fast-forward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from core.batch import Batch
from core.fast_forward import DecodeRun
from core.interfaces import Executor, Router, StepOutput, Workload
from core.metrics import ITLPool
from core.records import StepLog, StepRecord, feature_values
from core.replica import Replica
from core.request import Request, RequestState


@dataclass(frozen=True, slots=True)
class Until:
    """Wait until the clock reads ``time_s`` (a request's arrival)."""

    time_s: float


@dataclass(slots=True)
class Sleep:
    """A step started at ``since`` and lasts ``seconds``. Simulated clocks advance by it; the wall clock has
    already spent it when the step was measured, and only waits for what is left (a cost-model step).

    Not frozen (one is made per step, and a frozen dataclass's constructor costs several times a plain one's);
    treat it as immutable."""

    seconds: float
    since: float


@dataclass(frozen=True, slots=True)
class Idle:
    """Wait until a request is dispatched to replica ``replica`` (``Clock.wake``)."""

    replica: int


@dataclass(slots=True)
class Decodes:
    """Fast-forwarded decode steps (``core.fast_forward``), for a clock that ``drives_decodes``: the first step
    lasts ``seconds``; when a step ends the clock calls ``run.advance(now)`` (it records the step and returns the
    next one's duration) and schedules the next step as it would a ``Sleep``; on None it resumes the process then
    and there. One clock event per step, as with a ``Sleep`` per step, without resuming the process each time."""

    run: DecodeRun
    seconds: float


Wait = Until | Sleep | Idle | Decodes
Process = Generator[Wait, None, None]


class GroupExecutor(Protocol):
    """Prices the batches of a replica group's members as one step (``ServingLoop``'s ``groups``)."""

    def execute_group(self, batches: Sequence[Batch]) -> list[StepOutput]: ...


class Clock(Protocol):
    """Runs the loop's processes on some notion of time."""

    @property
    def now(self) -> float: ...

    def start(self, process: Process) -> None:
        """Run ``process`` from now on (arrivals, a closed-loop client's delayed next request)."""

    def wake(self, replica: int) -> None:
        """A request was dispatched to ``replica``: resume its process if it is ``Idle``."""


@runtime_checkable
class DecodeClock(Clock, Protocol):
    """A ``Clock`` that also accepts ``Decodes`` waits (the simulated clocks). Others get one ``Sleep`` per
    fast-forwarded step."""

    drives_decodes: bool


@dataclass
class RunResult:
    states: list[RequestState]
    steps: Sequence[StepRecord]  # a StepLog from a loop
    end_s: float  # clock time of the last event
    wall_s: float  # wall-clock seconds the run took
    batches: list[Batch] = field(default_factory=list)  # filled only with keep_batches=True
    itl_pool: ITLPool | None = None  # the ITL samples of the requests folded as they ended (``ServingLoop``)


class Journal(Protocol):
    """Where a loop that keeps only live requests sends the rest (``core.journal.RunJournal``)."""

    ids: Any  # ids seen so far: ``in`` and ``add``

    def admit(self, state: RequestState) -> None: ...

    def end(self, state: RequestState) -> None: ...

    def add(self, replica: int, start_s: float, duration_s: float, features: Sequence[int], kv_blocks_used: int,
            num_preempted: int) -> None: ...


StepListener = Callable[[int, Batch, StepRecord], None]
TerminalListener = Callable[[RequestState, float], None]


def plugin_index(idx: Any, n: int, plugin: str, what: str) -> int:
    """A router's or placement's choice as an index into its ``n`` replicas (an int or a NumPy integer), or a
    RuntimeError naming the plugin and what it returned: a float or None would fail later, far from its cause."""
    try:
        i = operator.index(idx)
    except TypeError:
        raise RuntimeError(f"{plugin} returned {idx!r} ({type(idx).__name__}); it must return the index of a "
                           f"{what}, an int in 0..{n - 1}") from None
    if not 0 <= i < n:
        raise RuntimeError(f"{plugin} returned {what} {i} of {n}")
    return i


class ServingLoop:
    """Replicas, their executors, a router and a workload, as processes for a ``Clock``.

    Listeners (the server's token streams, a progress bar) are told about every step and every request that
    reaches a terminal status; they run on the loop's thread and must not block. A step listener gets every step's
    batch with its tokens applied, so while one is registered (or ``keep_batches``) no step is fast-forwarded;
    terminal listeners are unaffected (a request always finishes in a per-step step).
    """

    def __init__(self, replicas: Sequence[Replica], executors: Sequence[Executor], router: Router,
                 workload: Workload, keep_batches: bool = False, frontend_delay_s: float = 0.0,
                 fast_forward: bool = True, itl_pool: ITLPool | None = None,
                 groups: Sequence[tuple[Sequence[int], GroupExecutor]] = ()) -> None:
        if len(replicas) != len(executors) or not replicas:
            raise ValueError(f"need one executor per replica, got {len(replicas)} replicas, {len(executors)} executors")
        self.replicas = list(replicas)
        self.executors = list(executors)
        self.router = router
        self.workload = workload
        self.keep_batches = keep_batches
        # Decode fast-forward (core.fast_forward): where the executor predicts decode steps and the scheduler
        # promises a steady decode state, runs of identical decode steps skip schedule / execute / apply. Outputs
        # are byte-identical either way; False forces every step through the three lines (to check just that).
        self.fast_forward = fast_forward
        self.fast_forwarded_steps = 0  # steps taken by fast-forward (they are in ``steps`` like every other)
        # A server's front end (HTTP, tokenisation) between a request's arrival and its dispatch to a replica: a
        # simulation of a measured server adds it; arrival times (and so TTFT) stay the client's.
        self.frontend_delay_s = frontend_delay_s
        # Where no per-token rows are written: each request that ends puts its ITL samples into this pool and
        # drops its token times (core.metrics.ITLPool), so a long trace's memory does not grow per token.
        self.itl_pool = itl_pool
        self.states: list[RequestState] = []
        self.steps = StepLog()  # column store: a long trace keeps millions of steps
        self.batches: list[Batch] = []
        self.on_step: list[StepListener] = []
        self.on_terminal: list[TerminalListener] = []
        self.on_idle: list[Callable[[int], None]] = []  # a replica found nothing to run (gauges refresh)
        self.journal: Journal | None = None  # set by journal_to: ended requests and steps go there, not to memory
        self.clock: Clock | None = None
        self._clock_drives_decodes = False
        self._ids: set[str] = set()
        self.groups = [(list(members), ex) for members, ex in groups]
        self._wake_slot = list(range(len(self.replicas)))  # the Idle slot waking a replica's process: a group's first
        for members, _ in self.groups:
            for i in members:
                self._wake_slot[i] = members[0]
        for r in self.replicas:
            r.on_terminal = self._terminal

    def journal_to(self, journal: Journal) -> None:
        """Keep only live requests (a server, for as long as it runs): each request is told to ``journal`` when
        it is queued and when it ends instead of kept in ``states``, each step goes to it instead of ``steps``,
        request ids into its compact ``ids`` (``core.journal.RunJournal``). No step is fast-forwarded, no ITL
        pool kept (the journal has every token time)."""
        self.journal, self.steps, self._ids = journal, journal, journal.ids
        self.fast_forward, self.itl_pool = False, None

    def processes(self, clock: Clock) -> list[Process]:
        """The processes to run on ``clock``: the workload's arrivals and one per replica."""
        self.clock = clock
        self._clock_drives_decodes = isinstance(clock, DecodeClock) and clock.drives_decodes  # checked once
        grouped = {i for members, _ in self.groups for i in members}
        return [self._arrivals(), *(self._replica(i) for i in range(len(self.replicas)) if i not in grouped),
                *(self._group(members, ex) for members, ex in self.groups)]

    @property
    def num_idle_slots(self) -> int:
        """Ids a process may wait on with ``Idle`` (one per replica); a clock keeps that many slots."""
        return len(self.replicas)

    def unfinished(self) -> list[str]:
        return [s.id for r in self.replicas for s in (*r.waiting, *r.running)]

    def finish(self) -> None:
        """After the run: every request must have ended; executors get their end-of-run check."""
        stuck = self.unfinished()
        if stuck:  # only a scheduler that refuses work on a busy replica can cause this
            raise RuntimeError(f"run ended with {len(stuck)} unfinished requests, e.g. {stuck[:5]}")
        queued = set(stuck)
        lost = [s for s in self.states if not s.status.terminal and s.id not in queued]
        if lost:  # a plugin took them out of view.waiting / view.running itself: they would vanish from the counts
            names = sorted({type(self.replicas[s.replica].scheduler).__name__ for s in lost})
            raise RuntimeError(f"run ended with {len(lost)} requests in no replica's queue, e.g. "
                               f"{[f'{s.id} ({s.status.name})' for s in lost[:5]]}: scheduler {', '.join(names)} "
                               "removed them from view.waiting / view.running without admit, preempt or finishing "
                               "them")
        for ex in self.executors:
            ex.finish()
        if self.itl_pool is not None:
            self.itl_pool.flush()

    def result(self, wall_s: float) -> RunResult:
        return RunResult(self.states, self.steps, self.clock.now if self.clock else 0.0, wall_s, self.batches,
                         self.itl_pool)

    # ---- requests in -----------------------------------------------------------------------------------------
    def dispatch(self, req: Request) -> RequestState:
        """Route a request to a replica now and queue it there (or reject it there, with a reason)."""
        if req.id in self._ids:
            raise ValueError(f"request id {req.id!r} was submitted twice; request ids must be unique")
        self._ids.add(req.id)
        idx = self._route(req)
        state = self.replicas[idx].add(req, self.clock.now)
        if self.journal is None:
            self.states.append(state)
        elif not state.status.terminal:  # rejected at once: its end record holds the request
            self.journal.admit(state)
        self.clock.wake(self._wake_slot[idx])
        return state

    def _route(self, req: Request) -> int:
        """The replica a new request goes to: the router's choice among all replicas."""
        idx = self.router.route(req, [r.view() for r in self.replicas]) if len(self.replicas) > 1 else 0
        return plugin_index(idx, len(self.replicas), f"router {type(self.router).__name__}", "replica")

    def _arrivals(self) -> Process:
        clock, delay = self.clock, self.frontend_delay_s
        for req in self.workload.initial():
            due = req.arrival_s + delay if delay else req.arrival_s
            if due > clock.now:
                yield Until(due)
            self.dispatch(req)

    def _delayed(self, req: Request) -> Process:
        yield Until(req.arrival_s + self.frontend_delay_s if self.frontend_delay_s else req.arrival_s)
        self.dispatch(req)

    # ---- one replica -----------------------------------------------------------------------------------------
    def _replica(self, i: int) -> Process:
        replica, executor, clock = self.replicas[i], self.executors[i], self.clock
        stopwatch = executor.stopwatch
        fast = self.fast_forward and executor.predicts_decodes and stopwatch is None
        while True:
            # A measuring executor's step runs from one schedule() to the next: scheduling is part of its time.
            t0 = stopwatch() if stopwatch else 0.0
            start = clock.now
            batch = replica.schedule(start)
            if batch.empty:
                if replica.running:
                    raise RuntimeError(f"scheduler {type(replica.scheduler).__name__} returned an empty batch "
                                       f"with {len(replica.running)} running requests on replica {i}")
                if replica.waiting and not replica.sending:
                    continue  # the replica rejected an unschedulable head request; try the next one
                for listener in self.on_idle:
                    listener(i)
                yield Idle(i)
                continue
            sched_s = stopwatch() - t0 if stopwatch else 0.0
            out = executor.execute(batch)
            duration = out.duration_s + sched_s
            yield Sleep(duration, start)
            replica.apply(batch, out.tokens, clock.now, out.num_tokens)
            self._record(i, start, duration, batch, replica)
            if fast and not self.on_step and not self.keep_batches:
                run = replica.start_decode_run(executor, clock.now)
                if run is not None:
                    yield from self._decode_run(i, replica, run)

    def _group(self, members: list[int], executor: GroupExecutor) -> Process:
        """Replicas ``members`` stepping together: each schedules its batch, ``executor`` prices them as one step."""
        replicas, clock = [self.replicas[i] for i in members], self.clock
        while True:
            start = clock.now
            batches = [r.schedule(start) for r in replicas]
            if all(b.empty for b in batches):
                busy = [i for i, r in zip(members, replicas, strict=True) if r.running]
                if busy:
                    raise RuntimeError(f"empty batches with running requests on replicas {busy}")
                if any(r.waiting and not r.sending for r in replicas):
                    continue  # a head request was rejected; try the next one
                yield Idle(members[0])
                continue
            outs = executor.execute_group(batches)
            duration = max(o.duration_s for o in outs)
            yield Sleep(duration, start)
            for i, r, batch, out in zip(members, replicas, batches, outs, strict=True):
                if batch.empty:
                    continue
                r.apply(batch, out.tokens, clock.now, out.num_tokens)
                self._record(i, start, duration, batch, r)

    def _record(self, i: int, start: float, duration: float, batch: Batch, replica: Replica) -> None:
        """Replica ``i``'s step of ``batch`` (applied): its steps.csv row, the kept batch, the step listeners."""
        self.steps.add(i, start, duration, feature_values(batch.features), replica.kv.num_used_blocks,
                       len(batch.preempted))
        if self.keep_batches:
            self.batches.append(batch)
        if self.on_step:
            record = StepRecord(i, start, duration, batch.features, replica.kv.num_used_blocks, len(batch.preempted))
            for listener in self.on_step:
                listener(i, batch, record)

    def _decode_run(self, i: int, replica: Replica, run: DecodeRun) -> Process:
        """Fast-forwarded steps of replica ``i`` (``core.fast_forward``): one clock event and one step record per
        step, exactly where the per-step loop has them, but no schedule / execute / apply."""
        clock = self.clock
        try:
            start = clock.now
            duration = run.begin(i, self.steps, start)
            if duration is None:
                return
            if self._clock_drives_decodes:
                yield Decodes(run, duration)  # the clock calls run.advance at each step's end
            else:
                while duration is not None:
                    yield Sleep(duration, start)
                    start = clock.now
                    duration = run.advance(start)
        finally:
            self.fast_forwarded_steps += len(run.ends)
            replica.end_decode_run()
            run.close()

    def _terminal(self, state: RequestState, now: float) -> None:
        self.executors[state.replica].release(state.id)
        if self.journal is not None:  # before the listeners: a client told of the end finds it journaled
            self.journal.end(state)
        for listener in self.on_terminal:
            listener(state, now)
        nxt = self.workload.on_finish(state, now)
        if nxt is not None:
            self.clock.start(self._delayed(nxt))
        state.compact()  # every listener has seen it: the run keeps it, in less memory
        if self.itl_pool is not None:
            self.itl_pool.fold(state)
