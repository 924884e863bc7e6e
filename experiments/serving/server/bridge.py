"""The serving loop on the wall clock in its own thread, and the bridge to the asyncio HTTP handlers.

Handlers never touch replica state: they submit and abort through ``RealTimeClock.call`` (run on the loop thread),
and receive tokens through one ``asyncio.Queue`` per request, filled from the loop thread once per step with
``call_soon_threadsafe``. Everything the loop thread does for the server per step is O(tokens in the step).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from core.batch import Batch
from core.interfaces import StepOutput
from core.loop import ServingLoop
from core.realtime import RealTimeClock
from core.records import StepRecord
from core.request import Request, RequestState, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    time_s: float
    logprob: tuple | None = None  # (logprob, ((token id, logprob), ...)) when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class EndEvent:
    status: Status
    reason: str


@dataclass
class Stream:
    """One request's output channel, read by its HTTP handler."""

    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: RequestState | None = None
    delivered: int = 0  # output tokens handed to the queue (loop thread only)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Load figures for /metrics and backpressure, refreshed by the loop thread after every step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 1


class NoArrivals:
    """The server's workload: requests come from HTTP handlers, none from a workload."""

    def initial(self):
        return iter(())

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        return None


class LoopThread:
    """Runs ``loop`` on a ``RealTimeClock`` in a daemon thread and streams its tokens to asyncio handlers."""

    def __init__(self, loop: ServingLoop, clock: RealTimeClock, aio_loop: asyncio.AbstractEventLoop,
                 metrics: Any | None = None) -> None:
        self.loop, self.clock, self.aio = loop, clock, aio_loop
        self.metrics = metrics  # experiments.serving.server.metrics.ServerMetrics, told about steps and ends
        self.streams: dict[str, Stream] = {}  # loop thread only
        self.snapshot = Snapshot(kv_total_blocks=sum(r.kv.num_blocks for r in loop.replicas))
        self.pending = 0  # submissions not yet dispatched (handler side, event-loop thread only)
        self.failed: dict[str, str] = {}  # requests whose step raised -> the error they end with (loop thread)
        loop.executors = [IsolatedExecutor(ex, self._step_failed) for ex in loop.executors]
        loop.on_step.append(self._on_step)
        loop.on_terminal.append(self._on_terminal)
        loop.on_idle.append(self._on_idle)
        self.hurry = threading.Event()  # set by a second signal: ``drain`` stops waiting and cancels what is left
        self.thread = threading.Thread(target=self._run, name="serving-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            self.clock.run(self.loop.processes(self.clock))
        except BaseException as e:  # surfaced by /health and every later submission
            self.error = e
            self.clock.stop()
            for stream in list(self.streams.values()):
                self.aio.call_soon_threadsafe(stream.queue.put_nowait, EndEvent(Status.CANCELLED, f"engine error: {e}"))

    # ---- handler side (event-loop thread) -----------------------------------------------------------------
    async def submit(self, request: Request) -> Stream:
        """Route and queue ``request``; the stream's ``state`` tells whether it was rejected at once."""
        if self.error is not None:
            raise RuntimeError(f"the serving loop failed: {self.error}")
        stream = Stream(request)
        self.pending += 1
        try:
            stream.state = await asyncio.wrap_future(self.clock.call(lambda: self._dispatch(stream)))
        finally:
            self.pending -= 1
        return stream

    def abort(self, request_id: str, reason: str) -> Future:
        """Cancel a request (the client is gone); its KV is freed before the next step (``Replica.end_early``)."""
        return self.clock.call(lambda: self._end_early(request_id, Status.CANCELLED, reason))

    def finish_early(self, request_id: str, reason: str) -> Future:
        """End a request FINISHED before its replica saw it end (the server matched its stop string)."""
        return self.clock.call(lambda: self._end_early(request_id, Status.FINISHED, reason))

    def now(self) -> float:
        return self.clock.now

    def stop(self, timeout_s: float = 10.0) -> None:
        self.clock.stop()
        self.thread.join(timeout_s)

    # ---- loop thread ----------------------------------------------------------------------------------------
    def _dispatch(self, stream: Stream) -> RequestState:
        rid = stream.request.id
        if rid in self.streams:  # never replace a live request's stream: its tokens would go to this one
            raise ValueError(f"request id {rid!r} belongs to a request still running; request ids must be unique")
        self.streams[rid] = stream  # before dispatch: a rejection ends it inside dispatch
        try:
            state = self.loop.dispatch(stream.request)
        except BaseException:
            self.streams.pop(rid, None)
            raise
        self._refresh()
        return state

    def _end_early(self, request_id: str, status: Status, reason: str) -> bool:
        for r in self.loop.replicas:
            if r.end_early(request_id, self.clock.now, status, reason) is not None:
                self._refresh()
                return True
        return False

    def _on_step(self, replica: int, batch: Batch, record: StepRecord) -> None:
        now = self.clock.now
        out: list[tuple[asyncio.Queue, TokenEvent]] = []
        for ch in batch.chunks:
            if ch.samples:
                stream = self.streams.get(ch.state.id)
                # one token, or several when the step verified drafts (none from a failed step)
                if stream is not None and ch.state.id not in self.failed:
                    out += _events(stream, ch.state, now)
        self._refresh()  # before the tokens go out: a client that sees a token sees the load it came with
        if out:
            self.aio.call_soon_threadsafe(_deliver, out)
        if self.metrics is not None:
            self.metrics.on_step(batch, record)

    def _on_terminal(self, state: RequestState, now: float) -> None:
        stream = self.streams.pop(state.id, None)
        if stream is not None:  # a request ends inside apply(), before the step's tokens go out: send its last ones
            error = self.failed.pop(state.id, None)
            if error is not None and state.status is Status.FINISHED:  # the failed step's placeholder was its last
                state.status, state.reason = Status.CANCELLED, error  # token: the run files must not say FINISHED
            end = EndEvent(state.status, state.reason) if error is None else EndEvent(Status.CANCELLED, error)
            items = [*(_events(stream, state, now) if error is None else ()), (stream.queue, end)]
            # sent once this turn of the loop is over, after the step's listeners (the metrics): a client that has
            # seen its request end finds all of its tokens in /metrics
            if self.clock.call(lambda: self.aio.call_soon_threadsafe(_deliver, items)).done():  # clock stopped
                self.aio.call_soon_threadsafe(_deliver, items)
        if self.metrics is not None:
            self.metrics.on_terminal(state)

    def _step_failed(self, batch: Batch, error: Exception) -> None:
        """A step raised: its requests end with the error (their placeholder tokens never reach a client); the
        loop and every other request run on."""
        reason = f"engine error: {type(error).__name__}: {error}"
        log.error("a step of %d requests failed (%s); ending them, serving on", len(batch.chunks), reason)
        for ch in batch.chunks:
            self.failed[ch.state.id] = reason
            self._end_early(ch.state.id, Status.CANCELLED, reason)  # on the loop thread, inside the step

    def _on_idle(self, replica: int) -> None:
        """A replica found nothing to run (every request aborted at once, say): the gauges say so now, not at the
        next request."""
        self._refresh()

    def _refresh(self) -> None:
        reps: Sequence = self.loop.replicas
        self.snapshot = Snapshot(sum(len(r.running) for r in reps), sum(len(r.waiting) for r in reps),
                                 sum(r.kv.num_used_blocks for r in reps), self.snapshot.kv_total_blocks)

    def drain(self, timeout_s: float) -> None:
        """Wait (blocking, off the event loop) until no request is unfinished, for at most ``timeout_s`` or until
        ``hurry`` is set (a second signal), then cancel what is left."""
        deadline = time.monotonic() + timeout_s
        while (time.monotonic() < deadline and not self.hurry.is_set()
               and self.clock.call(self.loop.unfinished).result(timeout=timeout_s)):
            self.hurry.wait(0.02)
        left = self.clock.call(self.loop.unfinished).result(timeout=10)
        reason = "server shutting down" + (" (second signal)" if self.hurry.is_set() else "")
        for rid in left:
            self.abort(rid, reason).result(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.clock.call(self.loop.unfinished).result(timeout=10):
            time.sleep(0.01)


class IsolatedExecutor:
    """An executor whose failing step does not end the serving loop: ``on_error(batch, exc)`` is told, and the step
    yields placeholder tokens (token 0, one per sampling chunk) in no time. Everything else is the wrapped one's."""

    def __init__(self, inner: Any, on_error) -> None:
        self.inner, self.on_error = inner, on_error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, batch: Batch) -> StepOutput:
        try:
            return self.inner.execute(batch)
        except Exception as e:
            self.on_error(batch, e)
            return StepOutput([0] * sum(ch.samples for ch in batch.chunks), 0.0)


def _events(stream: Stream, state: RequestState, now: float) -> list[tuple[asyncio.Queue, TokenEvent]]:
    """The tokens of ``state`` not yet handed to ``stream`` (with their logprobs, when it asked for them)."""
    tokens, lps, start = state.output_token_ids, state.logprobs, stream.delivered
    stream.delivered = len(tokens)
    return [(stream.queue, TokenEvent(t, now, lps[j] if lps is not None and j < len(lps) else None))
            for j, t in enumerate(tokens[start:], start)]


def _deliver(items: list[tuple[asyncio.Queue, TokenEvent | EndEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)
