"""`python -m experiments.loadgen`: replay any workload against any OpenAI-compatible server, measured like a run.

Every workload of the simulator (``conf/workload/*``) is sent to ``target.url``'s ``/v1/completions``, streamed
(SSE, ``stream_options.include_usage``), and measured per output chunk, so the run directory holds the same
requests.csv, tokens.csv and metrics.json as a simulated run (no steps.csv: a black box shows no steps), plus:

- ``bench_serve.json``: the same run in vLLM ``bench serve`` result form (``experiments.serving.bench_result``);
- ``client.csv``: per request the scheduled and actual send times (s from the start), the HTTP status and the
  token counts the server reported in its usage block;
- ``config.yaml`` (the resolved config) and ``latency_cdfs.png`` (``output.plots``).

Prompts: a request of n prompt tokens is sent as exactly n token ids (``target.prompt_mode=tokens``: its
``prompt_token_ids``, else ``core.prompt.materialize``'s deterministic ids, the ones our engine runs, so requests
sharing content share token prefixes), or as text that tokenizes to n tokens with the target's tokenizer
(``prompt_mode=text``, ``TextPrompts``). ``target.ignore_eos`` sends ``ignore_eos`` and ``min_tokens`` =
``max_tokens`` so that every request generates exactly its workload output length.

Timing (one asyncio loop, ``time.monotonic``): request i is due at start + ``arrival_s``; the client sleeps until
just before, then yields to the loop until the due time and launches it. Its ``arrival_s`` in the run files is the
due time (so client delays count in TTFT), its ``first_scheduled_s`` the time its body was written to the socket
(metrics' queue_s is therefore the client-side delay: send lag plus any wait for a ``target.max_concurrency``
slot; the server's own queue is not visible). Each network read is one timestamp: the tokens of the SSE chunks it
carries are one output event (k tokens -> one event of k tokens, ``core.metrics.output_events``). A chunk's
tokens are counted from its ``token_ids`` (or ``logprobs.tokens``) when the server sends them, else 1 per chunk
(0 for an empty final chunk); when the usage block's ``completion_tokens`` disagrees, the usage count is spread
over the chunks (``bench_format.apportion``) and ``num_token_count_mismatch`` counts it. A FINISHED request's
``finish_s`` is its last token's time (as in the simulator, and vLLM's E2EL).

Every request ends in exactly one terminal status: FINISHED (a stream with >= 1 token that ended with a
finish_reason or ``[DONE]``); TIMED_OUT (no complete answer ``target.timeout_s`` after its due time; the
connection is closed, which a server sees as a cancel); REJECTED (an HTTP error status, a connection error, an
error object in the stream, or a stream that ended early), with the reason. Closed-loop and multi-turn workloads
get each client's next request from ``workload.on_finish(state, now)``, as in the simulator.

Send lag (actual send - due time, over all requests that were sent) is in metrics.json as ``send_lag_s``;
``python -m experiments.bench_loadgen`` measures it at 100 req/s against a fake server. To keep it small the
client opens a few keep-alive connections before the clock starts, builds each request body before its due time,
and pauses Python's automatic garbage collection during the run (young generations are collected when no send is
due within ``GC_QUIET_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import gc
import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yarl
from omegaconf import DictConfig, OmegaConf

from core.interfaces import Workload
from core.metrics import stats
from core.prompt import materialize
from core.request import Request, RequestState, Status

PROMPT_MODES = ("tokens", "text")
SPIN_S = 0.0011  # sleep until this long before a due time, then yield to the loop until it (epoll rounds up to ms)
LAUNCH_LEAD_S = 0.005  # a request's task starts this long before its due time
WARM_CONNECTIONS = 8  # keep-alive connections opened before the start
GC_EVERY_S, GC_QUIET_S = 0.5, 0.01  # young-generation garbage collection: how often, and only this far from a send
ERROR_TEXT_LIMIT = 300
LAG_PERCENTILES = (50, 90, 99, 99.9)
log = logging.getLogger(__name__)
CLIENT_COLUMNS = ("id", "scheduled_s", "sent_s", "http_status", "usage_prompt_tokens", "usage_output_tokens",
                  "usage_cached_tokens")


# ---- configuration -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """The ``target`` section: where and how requests are sent."""

    url: str
    model: str | None = None
    timeout_s: float | None = None
    prompt_mode: str = "tokens"
    tokenizer: str | None = None
    ignore_eos: bool = True
    max_concurrency: int | None = None
    api_key: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"target.url must be an http:// or https:// URL, got {self.url!r}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"target.prompt_mode={self.prompt_mode!r}; allowed: {list(PROMPT_MODES)}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise ValueError(f"target.timeout_s must be a number of seconds > 0 or null, got {t!r}")
        c = self.max_concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"target.max_concurrency must be an int >= 1 or null, got {c!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"target.ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError(f"target.extra_body must be a mapping of extra request fields, got {self.extra_body!r}")

    @classmethod
    def from_mapping(cls, node: Mapping[str, Any]) -> Target:
        d = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node)
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"target: unknown keys {unknown}; allowed: {sorted(allowed)}")
        if "url" not in d:
            raise ValueError("target.url is required (e.g. target.url=http://127.0.0.1:8000)")
        d["extra_body"] = dict(d.get("extra_body") or {})
        return cls(**d)

    @property
    def completions_url(self) -> str:
        """``url`` as given when it ends with /v1/completions, else with /v1/completions (or /completions) added."""
        u = self.url.rstrip("/")
        if u.endswith("/completions"):
            return u
        return u + ("/completions" if u.endswith("/v1") else "/v1/completions")

    @property
    def models_url(self) -> str:
        return self.completions_url.removesuffix("/completions") + "/models"


# ---- prompts -------------------------------------------------------------------------------------------------------
class TextPrompts:
    """Text that tokenizes to a given number of tokens with ``tokenizer`` (a transformers tokenizer).

    A pool of "words" is picked from the vocabulary: tokens that decode to a plain ASCII alphanumeric piece
    and survive a round trip repeated (decode([i, i, i]) encodes back to [i, i, i]), e.g. " the" for byte-level
    BPE. Token id t of a prompt becomes word ``pool[t % len(pool)]``, so prompts sharing token prefixes share text
    prefixes (the server's prefix cache sees the workload's sharing). The tokens the tokenizer adds (BOS) count:
    the text holds n - ``num_special_tokens_to_add()`` words. A text whose count is off after decoding is corrected
    by adding or dropping words (a few rounds); ``text(ids, n)`` returns (text, tokens it encodes to), the nearest
    count when n cannot be met (n = 1 with a BOS-adding tokenizer).
    """

    def __init__(self, tokenizer: Any, pool_size: int = 1024, max_scan: int = 200_000) -> None:
        self.tok = tokenizer
        self.num_special = int(tokenizer.num_special_tokens_to_add(pair=False))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool: list[int] = []
        for i in range(min(len(tokenizer), max_scan)):
            if i in special:
                continue
            piece = tokenizer.decode([i])
            word = piece.strip()
            if not word or not word.isascii() or not word.isalnum():
                continue
            if self._encode(tokenizer.decode([i, i, i])) != [i, i, i]:
                continue
            pool.append(i)
            if len(pool) >= pool_size:
                break
        if not pool:
            raise ValueError("target.tokenizer: found no vocabulary entry that round-trips as a word; "
                             "use target.prompt_mode=tokens")
        self.pool = pool

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def count(self, text: str) -> int:
        """Tokens the server's tokenizer gives ``text``, added special tokens included."""
        return len(self._encode(text)) + self.num_special

    def text(self, token_ids: Sequence[int], n: int) -> tuple[str, int]:
        pool, k = self.pool, len(self.pool)
        words = [pool[t % k] for t in token_ids]
        target = max(1, n - self.num_special)
        m, best = target, None
        for _ in range(8):
            ids = (words + [pool[(len(words) + j) % k] for j in range(m - len(words))])[:m]
            text = self.tok.decode(ids)
            got = self.count(text)
            if best is None or abs(got - n) < abs(best[1] - n):
                best = (text, got)
            if got == n:
                break
            m = max(1, m + n - got)
        return best


def load_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer from a local directory (``engine.tokenizer``: no download)."""
    from engine.tokenizer import load_tokenizer as load

    tok = load(path)
    if tok is None:
        raise ValueError(f"target.tokenizer={str(path)!r}: no tokenizer files in that directory")
    return tok


class Prompts:
    """The ``prompt`` field for a request: token ids (tokens mode) or text (text mode), exactly prompt_len long."""

    def __init__(self, mode: str, vocab_size: int, seed: int = 0, text: TextPrompts | None = None) -> None:
        if mode == "text" and text is None:
            raise ValueError("target.prompt_mode=text needs a tokenizer (target.tokenizer or model.path)")
        self.mode, self.vocab_size, self.seed, self.text = mode, vocab_size, seed, text
        self.num_length_off = 0  # text prompts whose token count could not be made exact

    def __call__(self, req: Request) -> list[int] | str:
        ids = materialize(req, self.vocab_size, self.seed)
        if self.mode == "tokens":
            return ids
        text, got = self.text.text(ids, req.prompt_len)
        self.num_length_off += got != req.prompt_len
        return text


# ---- the client ------------------------------------------------------------------------------------------------------
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
                 total: int | None = None) -> None:
        self.workload, self.target, self.prompts = workload, target, prompts
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
            raise RuntimeError(f"target.model is null and GET {url} gave no model ({type(e).__name__}: {e}); "
                               "check target.url or set target.model") from e

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


# ---- the run ---------------------------------------------------------------------------------------------------------
def _known_total(workload: Workload, requests: list[Request] | None) -> int | None:
    if requests is not None:
        return len(requests)
    n = getattr(workload, "num_requests", None)
    return n if isinstance(n, int) else None


def _client_csv(records: Sequence[ClientRecord]) -> str:
    from core.output import fmt

    f = io.StringIO()
    w = csv.writer(f, lineterminator="\n")
    w.writerow(CLIENT_COLUMNS)
    for r in sorted(records, key=lambda r: r.scheduled_s):
        w.writerow([fmt(getattr(r, c)) for c in CLIENT_COLUMNS])
    return f.getvalue()


def build_prompts(cfg: DictConfig, target: Target) -> Prompts:
    """Tokens or text prompts for ``target``; the vocabulary comes from the tokenizer when one is named
    (``target.tokenizer``, else ``model.path`` in text mode), else from the model config."""
    from experiments.build import model_spec

    tok_dir = target.tokenizer
    if tok_dir is None and target.prompt_mode == "text":
        tok_dir = cfg.model.get("path")
        if not tok_dir:
            raise ValueError("target.prompt_mode=text needs target.tokenizer=DIR (a local tokenizer directory) "
                             "or model.path=DIR")
    seed = int(cfg.get("seed", 0))
    if tok_dir is None:
        return Prompts("tokens", model_spec(cfg).vocab_size, seed)
    tok = load_tokenizer(tok_dir)
    text = TextPrompts(tok) if target.prompt_mode == "text" else None
    return Prompts(target.prompt_mode, len(tok), seed, text)


def run_loadgen(cfg: DictConfig, out_dir: str | Path, client: type[LoadGen] | None = None) -> dict[str, Any]:
    """Replay ``cfg.workload`` against ``cfg.target`` and write the run directory; returns metrics.json's dict.
    ``client``: a LoadGen subclass to run instead (e.g. instrumented, as in ``experiments.benchmarks.loadgen``)."""
    from core.metrics import summarize
    from core.workload.base import OpenLoop
    from experiments.build import build_workload, metrics_options, model_spec, progress_bar
    from experiments.serving.bench_result import bench_serve_result, write_measured_run

    target = Target.from_mapping(cfg.target)
    options = metrics_options(cfg, model_spec(cfg))
    workload = build_workload(cfg.workload)
    prompts = build_prompts(cfg, target)
    # open-loop requests are known up front: their count gives the progress bar a total and an ETA
    requests = list(workload.initial()) if isinstance(workload, OpenLoop) else None
    if requests is not None:
        workload = _Fixed(workload, requests)
    output = cfg.get("output") or {}
    gen = (client or LoadGen)(workload, target, prompts, progress=progress_bar(output.get("progress", "auto")),
                              total=_known_total(workload, requests))
    res = gen.run()

    metrics = summarize(res.states, **options)
    lags = res.send_lags_s
    metrics.update(
        backend="loadgen", target_url=target.completions_url, target_model=res.model, prompt_mode=target.prompt_mode,
        send_lag_s=stats(lags, options["percentile_method"], LAG_PERCENTILES),
        num_unsent=len(res.records) - len(lags),
        num_token_count_mismatch=res.num_token_count_mismatch,
        num_client_errors=res.num_client_errors,
        num_prompt_length_off=prompts.num_length_off + sum(
            r.usage_prompt_tokens is not None and r.usage_prompt_tokens != s.request.prompt_len
            for r, s in zip(res.records, res.states, strict=True)),
    )
    bench = bench_serve_result(res.states, metrics["duration_s"], options["slo"])
    bench.update(backend="twinserve-loadgen", model_id=res.model, max_concurrency=target.max_concurrency)
    out = Path(out_dir)
    write_measured_run(out, res.states, metrics, {
        "bench_serve.json": json.dumps(bench, indent=2, allow_nan=False) + "\n",
        "client.csv": _client_csv(res.records),
        "config.yaml": OmegaConf.to_yaml(cfg, resolve=True),
    }, timing={"wall_s": res.wall_s})
    if output.get("plots", False):
        from core.output import read_metrics, read_requests_csv, read_tokens_csv
        from experiments import plots

        run = plots.RunData(read_requests_csv(out / "requests.csv"), read_tokens_csv(out / "tokens.csv"), {},
                            read_metrics(out / "metrics.json"))
        plots.latency_cdfs({out.name: run}, out / "latency_cdfs.png", f"loadgen: {res.model}")
    return metrics


class _Fixed:
    """An open-loop workload whose requests were already drawn (``initial`` replays the list)."""

    def __init__(self, inner: Workload, requests: list[Request]) -> None:
        self.inner, self.requests = inner, requests

    def initial(self) -> Iterator[Request]:
        return iter(self.requests)

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        return self.inner.on_finish(state, now)


def summary_line(metrics: Mapping[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.2f}"

    lag = metrics["send_lag_s"]
    return (f"completed {metrics['num_completed']}/{metrics['num_requests']} (rejected {metrics['num_rejected']}, "
            f"timed out {metrics['num_timed_out']}); TTFT p50/p99 ms {ms(metrics['ttft_s']['p50'])}/"
            f"{ms(metrics['ttft_s']['p99'])}; ITL p50/p99 ms {ms(metrics['itl_s']['p50'])}/"
            f"{ms(metrics['itl_s']['p99'])}; send lag p50/p99/max ms {ms(lag['p50'])}/{ms(lag['p99'])}/"
            f"{ms(lag['max'])}")


def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out_dir = HydraConfig.get().runtime.output_dir
    t = time.perf_counter()
    metrics = run_loadgen(cfg, out_dir)
    log.info(summary_line(metrics))
    log.info(f"wrote {out_dir} ({time.perf_counter() - t:.1f} s)")


def main() -> None:
    import hydra

    from experiments.build import CONF_DIR
    from experiments.cli import user_errors

    # an absolute config path: works as `python -m experiments.loadgen` and as the twinserve-loadgen console script
    hydra.main(config_path=str(CONF_DIR), config_name="loadgen", version_base="1.3")(user_errors(_main))()


if __name__ == "__main__":
    main()
