"""The load client: one asyncio loop that sends each request at its due time, streams it and times every chunk."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl

from core.interfaces import Workload
from core.journal import RunJournal
from core.request import Request, RequestState, Status
from experiments.serving.loadgen.prompts import Prompts
from experiments.serving.loadgen.target import Target

SPIN_S = 0.0011  # sleep until this long before a due time, then yield to the loop until it (epoll rounds up to ms)
LAUNCH_LEAD_S = 0.005  # a request's task starts this long before its due time
WARM_CONNECTIONS = 8  # keep-alive connections opened before the start
GC_EVERY_S, GC_QUIET_S = 0.5, 0.01  # young-generation garbage collection: how often, and only this far from a send
ERROR_TEXT_LIMIT = 300
log = logging.getLogger(__name__)
CLIENT_COLUMNS = ("id", "scheduled_s", "sent_s", "http_status", "usage_prompt_tokens", "usage_output_tokens",
                  "usage_cached_tokens")

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class ClientRecord:
    """What the client saw of one request, besides its RequestState (times relative to the start)."""

    id: str
    scheduled_s: float
    sent: float | None = None  # loop time the body was written (set by the aiohttp trace hook)
    sent_s: float | None = None
    http_status: int | None = None
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    usage_cached_tokens: int | None = None


@dataclass
class LoadgenResult:
    states: list[RequestState]
    records: list[ClientRecord]
    wall_s: float
    model: str
    num_token_count_mismatch: int = 0
    num_client_errors: int = 0

    @property
    def send_lags_s(self) -> list[float]:
        return [r.sent_s - r.scheduled_s for r in self.records if r.sent_s is not None]


def _tokens_in_chunk(choice: Mapping[str, Any]) -> int:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, Mapping) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    text = choice.get("text")
    if text is None:  # a chat-style delta
        text = (choice.get("delta") or {}).get("content")
    return 0 if not text and choice.get("finish_reason") is not None else 1


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:ERROR_TEXT_LIMIT]


def _exception_text(e: BaseException) -> str:
    return _one_line(f"{type(e).__name__}: {e}")


def _error_text(status: int, body: str) -> str:
    """The reason of an HTTP error answer: the status and the OpenAI-style error message (else the body)."""
    msg = body.strip()
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, Mapping) else obj
        msg = err.get("message", msg) if isinstance(err, Mapping) else str(err)
    return _one_line(f"HTTP {status}: {msg}")


class LoadGen:
    """One replay of ``workload`` against ``target`` (``run()`` once)."""

    def __init__(self, workload: Workload, target: Target, prompts: Prompts, progress: bool = False,
                 total: int | None = None, journal: RunJournal | None = None) -> None:
        self.workload, self.target, self.prompts = workload, target, prompts
        self.journal = journal  # told of each request as it starts and as it ends (core.journal)
        self.progress, self.total = progress, total
        self.states: list[RequestState] = []
        self.records: list[ClientRecord] = []
        self.model = target.model
        self.num_token_count_mismatch = 0
        self.num_client_errors = 0  # requests ended by an unexpected exception in the client (logged once)
        self._ids: set[str] = set()
        self._outstanding = 0
        self._feeding = True
        self._tasks: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        self._dues: dict[str, float] = {}  # request id -> due time, for requests not sent yet

    def run(self) -> LoadgenResult:
        # Python's automatic garbage collection stops the loop for up to tens of ms at moments of its choosing; during
        # the run it is off, the setup's objects are frozen, and _collect_garbage collects the young generations when
        # no send is due soon.
        gc.collect()
        gc.freeze()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            wall = asyncio.run(self._main())
        finally:
            if was_enabled:
                gc.enable()
            gc.unfreeze()
        return LoadgenResult(self.states, self.records, wall, self.model or "", self.num_token_count_mismatch,
                             self.num_client_errors)

    # ---- setup ---------------------------------------------------------------------------------------------------
    async def _resolve_model(self, session: aiohttp.ClientSession) -> str:
        url = self.target.models_url
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                body = await r.text()
                if r.status != 200:
                    raise ValueError(_error_text(r.status, body))
                return json.loads(body)["data"][0]["id"]
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, IndexError) as e:
            # a user error, in one line (experiments.cli): no chained traceback before the message
            raise ValueError(f"target.model is null and GET {url} gave no model ({_exception_text(e)}); "
                             "check target.url or set target.model") from None

    async def _warm_up(self, session: aiohttp.ClientSession) -> None:
        """Open a few keep-alive connections before the clock starts (a GET of the models list each, whatever it
        answers), so the first requests do not pay for TCP connects and first-use code paths in their send lag."""
        async def get() -> None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(self.target.models_url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()

        n = min(self.target.max_concurrency or WARM_CONNECTIONS, WARM_CONNECTIONS)
        await asyncio.gather(*(get() for _ in range(n)))

    def _headers(self, req: Request) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": req.id}
        key = self.target.api_key or os.environ.get("OPENAI_API_KEY")
        if key:
            h["Authorization"] = f"Bearer {key}"
        return h

    def _payload(self, req: Request) -> bytes:
        body: dict[str, Any] = {"model": self.model, "prompt": self.prompts(req), "max_tokens": req.max_new_tokens,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.target.ignore_eos:
            body.update(ignore_eos=True, min_tokens=req.max_new_tokens)
        body.update(self.target.extra_body)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _main(self) -> float:
        self.loop = loop = asyncio.get_running_loop()
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(self._on_sent)
        connector = aiohttp.TCPConnector(limit=self.target.max_concurrency or 0, keepalive_timeout=60)
        self.sem = asyncio.Semaphore(self.target.max_concurrency) if self.target.max_concurrency else None
        from tqdm import tqdm

        self.bar = tqdm(total=self.total, desc="loadgen", unit="req", disable=not self.progress, mininterval=0.5,
                        file=sys.stderr)
        # no client-side total timeout: target.timeout_s (from each request's due time) is the only one
        self._url = yarl.URL(self.target.completions_url)  # parsed once, not per request
        async with aiohttp.ClientSession(connector=connector, trace_configs=[trace],
                                         cookie_jar=aiohttp.DummyCookieJar(),
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            self.session = session
            if self.model is None:
                self.model = await self._resolve_model(session)
            await self._warm_up(session)
            self.done = asyncio.Event()
            self.t0 = loop.time()
            collector = loop.create_task(self._collect_garbage())
            await self._feed(self.workload.initial())
            self._feeding = False
            if self._outstanding == 0:
                self.done.set()
            await self.done.wait()
            wall = loop.time() - self.t0
            collector.cancel()
            for task in list(self._tasks):  # only after a failure: stop what is still in flight
                task.cancel()
            await asyncio.gather(collector, *self._tasks, return_exceptions=True)
        self.bar.close()
        if self._failure is not None:
            raise self._failure
        return wall

    # ---- sending ---------------------------------------------------------------------------------------------------
    async def _on_sent(self, _session: Any, ctx: Any, _params: Any) -> None:
        rec = (ctx.trace_request_ctx or {}).get("record")
        if rec is not None and rec.sent is None:
            rec.sent = self.loop.time()
            self._dues.pop(rec.id, None)

    async def _collect_garbage(self) -> None:
        """Every GC_EVERY_S, at a moment when no send is due within GC_QUIET_S, collect generations 0 and 1."""
        loop = self.loop
        while True:
            await asyncio.sleep(GC_EVERY_S)
            while any(0 <= due - loop.time() < GC_QUIET_S for due in self._dues.values()):
                await asyncio.sleep(0.001)
            gc.collect(1)

    async def _feed(self, requests: Iterator[Request]) -> None:
        for req in requests:
            self._register(req)
            await self._send_at(req)

    def _register(self, req: Request) -> None:
        """Count a request as outstanding from the moment it is known (the run ends when none is left)."""
        if req.id in self._ids:
            raise ValueError(f"workload yielded request id {req.id!r} twice; request ids must be unique")
        self._ids.add(req.id)
        self._outstanding += 1

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()  # a bug or a workload error: stop the run and raise it
            self.done.set()

    async def _send_at(self, req: Request) -> None:
        """Build the request body, then launch the request's task shortly before its due time (the task waits for
        the exact time itself, so no task switch separates the due time from the send)."""
        payload = self._payload(req)
        due = self.t0 + req.arrival_s
        self._dues[req.id] = due
        delay = due - LAUNCH_LEAD_S - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        self._spawn(self._request(req, payload, due))

    async def _until(self, due: float, rec: ClientRecord) -> None:
        """Wait for ``due`` (loop time) to send ``rec``'s request."""
        loop = self.loop
        delay = due - loop.time()
        if delay > SPIN_S:
            await asyncio.sleep(delay - SPIN_S)
        while loop.time() < due:
            await asyncio.sleep(0)

    async def _request(self, req: Request, payload: bytes, due: float) -> None:
        loop = self.loop
        state = RequestState(req)
        state.replica = 0
        rec = ClientRecord(req.id, due - self.t0)
        self.states.append(state)
        self.records.append(rec)
        if self.journal is not None:
            self.journal.admit(state)
        await self._until(due, rec)
        deadline = None if self.target.timeout_s is None else due + self.target.timeout_s
        cm = asyncio.timeout_at(deadline)
        events: list[list[float | int]] = []  # [time, tokens] per network read that carried tokens; kept on failure
        try:
            async with cm:
                if self.sem is None:
                    await self._stream(req, payload, state, rec, events)
                else:
                    async with self.sem:
                        await self._stream(req, payload, state, rec, events)
        except TimeoutError as e:
            if cm.expired():
                state.status = Status.TIMED_OUT
                state.reason = f"no complete answer within target.timeout_s={self.target.timeout_s}"
            else:
                state.status, state.reason = Status.REJECTED, _exception_text(e)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            state.status, state.reason = Status.REJECTED, _exception_text(e)
        except Exception as e:  # anything else from the HTTP stack: this request failed, the run goes on
            if not self.num_client_errors:
                log.warning("request %s: unexpected client error", req.id, exc_info=True)
            self.num_client_errors += 1
            state.status, state.reason = Status.REJECTED, "client error: " + _exception_text(e)
        now = loop.time() - self.t0
        if rec.sent is not None:
            rec.sent_s = rec.sent - self.t0
            state.first_scheduled_s = rec.sent_s
        self._set_tokens(state, events, rec)
        if state.status is Status.FINISHED and not state.token_times:  # the usage block said 0 tokens
            state.status, state.reason = Status.REJECTED, "no output token (usage completion_tokens = 0)"
        if not state.status.terminal:  # cannot happen: _stream ends with a status or raises
            state.status, state.reason = Status.REJECTED, state.reason or "the answer ended incomplete"
        state.finish_s = state.token_times[-1] if state.status is Status.FINISHED else now
        self._dues.pop(req.id, None)
        self._finished(state, now)

    def _finished(self, state: RequestState, now: float) -> None:
        if self.journal is not None:
            self.journal.end(state)
        self.bar.update(1)
        nxt = self.workload.on_finish(state, now)
        if nxt is not None:
            self._register(nxt)
            self._spawn(self._send_at(nxt))
        self._outstanding -= 1
        if self._outstanding == 0 and not self._feeding:
            self.done.set()

    async def _stream(self, req: Request, payload: bytes, state: RequestState, rec: ClientRecord,
                      events: list[list[float | int]]) -> None:
        """Send the request and read its SSE stream into ``events``; set the status (FINISHED or REJECTED)."""
        loop, t0 = self.loop, self.t0
        done = finished = False
        async with self.session.post(self._url, data=payload, headers=self._headers(req),
                                     trace_request_ctx={"record": rec}) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                state.status, state.reason = Status.REJECTED, _error_text(resp.status, await resp.text())
                return
            buf = b""
            content = resp.content
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                t = loop.time() - t0
                buf += chunk
                *lines, buf = buf.split(b"\n")
                k_read = 0
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, SSE comments (": ping"), event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if not isinstance(obj, dict):
                        continue
                    if obj.get("error"):
                        err = obj["error"]
                        msg = err.get("message", err) if isinstance(err, Mapping) else err
                        state.status, state.reason = Status.REJECTED, _one_line(f"error in stream: {msg}")
                    for choice in obj.get("choices") or ():
                        k_read += _tokens_in_chunk(choice)
                        finished = finished or choice.get("finish_reason") is not None
                    usage = obj.get("usage")
                    if usage:
                        rec.usage_prompt_tokens = usage.get("prompt_tokens")
                        rec.usage_output_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        rec.usage_cached_tokens = details.get("cached_tokens")
                if k_read:
                    events.append([t, k_read])
                if done:
                    break
            if state.status is Status.REJECTED:  # an error object in the stream
                return
            if not events:
                state.status, state.reason = Status.REJECTED, ("the response held no SSE chunk with an output token "
                                                               "(does the server stream?)")
            elif done or finished:
                state.status = Status.FINISHED
            else:
                state.status, state.reason = Status.REJECTED, "the stream ended without finish_reason or [DONE]"

    def _set_tokens(self, state: RequestState, events: list[list[float | int]], rec: ClientRecord) -> None:
        from experiments.serving.bench_result import apportion

        counted = sum(int(k) for _, k in events)
        n = rec.usage_output_tokens
        if isinstance(n, int) and n >= 0 and n != counted and events:
            self.num_token_count_mismatch += 1
            for ev, k in zip(events, apportion(n, len(events)), strict=True):
                ev[1] = k
        times = [float(t) for t, k in events for _ in range(int(k))]
        state.token_times = times
        state.output_token_ids = [-1] * len(times)  # a black box returns text; ids unknown, the count is kept
        state.first_token_s = times[0] if times else None
        if rec.usage_cached_tokens:
            state.num_cached_tokens = int(rec.usage_cached_tokens)

