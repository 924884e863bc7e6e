"""The gateway's HTTP side: each request is routed by the router plugin over the backends in rotation, passed on
unchanged, and its answer passed back (a stream event by event, as it arrives).

Faults end only the requests they touch, with an OpenAI-style error body, and take the backend out of rotation
until a health check passes again: a backend that refuses the connection (or does not accept it within
``connect_timeout_s``) is skipped and the next choice of the router tried, so nothing was sent twice; no answer
header within ``timeout_s`` is a **504**; an answer that breaks off (the connection drops, no chunk for
``timeout_s``, or the stream ends without a finish) becomes an error event in the stream, then ``[DONE]``. With
no backend in rotation the gateway answers **503**; when every one in rotation is saturated (``max_in_flight``
requests in flight there, or it answered 429 in the last ``saturated_s``) **429**. A backend's own error answer
(4xx, 5xx) is passed through; a 429 from it first tries the other backends. A client that goes away closes the
upstream connection, which a server sees as a cancel (ours frees the request's KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from core.interfaces import Router
from core.request import Request, Status
from experiments.serving.gateway.backends import Backend, Flight, parse_metrics
from experiments.serving.gateway.config import GatewayConfig
from experiments.serving.gateway.index import PrefixIndex, key_hashes, prompt_keys
from experiments.serving.gateway.metrics import GatewayMetrics
from experiments.serving.gateway.records import Outcome, Recorder
from experiments.serving.gateway.sse import SSEReader, error_event

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; only the cost-based router's pending-work estimate uses it
FORWARDED_HEADERS = ("Content-Type", "Authorization", "Accept")
CONNECTION_REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
UPSTREAM_BROKEN = (aiohttp.ClientError, OSError, TimeoutError)
CLIENT_GONE = (ConnectionResetError, aiohttp.ClientConnectionResetError)
log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Answered by the gateway itself with an OpenAI-style error body."""

    def __init__(self, message: str, status: int, kind: str) -> None:
        super().__init__(message)
        self.message, self.status, self.kind = message, status, kind

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        return web.json_response(body, status=self.status)


def _max_tokens(body: Mapping[str, Any]) -> int:
    v = body.get("max_tokens") or body.get("max_completion_tokens")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else DEFAULT_MAX_TOKENS


class Gateway:
    """The routes and the background poller. ``start`` / ``stop`` run inside the serving event loop."""

    def __init__(self, cfg: GatewayConfig, router: Router, recorder: Recorder,
                 tokenizers: Mapping[str, Any] | None = None) -> None:
        self.cfg, self.router, self.recorder = cfg, router, recorder
        self.tokenizers = dict(tokenizers or {})
        self.backends = [Backend(s, PrefixIndex(s.num_blocks or cfg.index_max_blocks, cfg.index_max_age_s))
                         for s in cfg.backends]
        self.router_name = type(router).__name__
        self.metrics = GatewayMetrics(self.backends, self.router_name)
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self._t0 = 0.0
        self.draining = False

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models), web.get("/health", self.health),
                web.get("/metrics", self.prometheus)]

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---- lifecycle and polling ---------------------------------------------------------------------------------
    async def start(self) -> None:
        self._t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s, sock_read=self.cfg.timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             cookie_jar=aiohttp.DummyCookieJar())
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.session is not None:
            await self.session.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_interval_s)
            await self.poll()

    async def poll(self) -> None:
        """One health check and /metrics scrape of every backend."""
        await asyncio.gather(*(self._check(b) for b in self.backends))

    async def _check(self, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s + self.cfg.poll_interval_s)
        try:
            async with self.session.get(b.spec.url + "/health", timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    b.mark_down(f"health check: HTTP {r.status}")
                    return
            async with self.session.get(b.spec.url + "/metrics", timeout=timeout) as r:
                text = await r.text() if r.status == 200 else ""
        except UPSTREAM_BROKEN as e:
            b.mark_down(f"health check: {type(e).__name__}: {e}")
            return
        b.mark_up()
        with contextlib.suppress(ValueError):  # a page that is not Prometheus text: nothing scraped
            b.on_scrape(parse_metrics(text))

    # ---- small endpoints ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        states = {b.name: {"healthy": b.healthy, "reason": b.reason, "in_flight": len(b.flights)}
                  for b in self.backends}
        ok = any(b.healthy for b in self.backends) and not self.draining
        return web.json_response({"status": "ok" if ok else "unavailable", "backends": states},
                                 status=200 if ok else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    async def models(self, request: web.Request) -> web.Response:
        if self.cfg.model_name:
            card = {"id": self.cfg.model_name, "object": "model", "owned_by": "twinserve-gateway"}
            return web.json_response({"object": "list", "data": [card]})
        for b in self.backends:
            if not b.healthy:
                continue
            with contextlib.suppress(*UPSTREAM_BROKEN):
                async with self.session.get(b.spec.url + "/v1/models") as r:
                    if r.status == 200:
                        return web.json_response(await r.json(content_type=None))
        return GatewayError("no backend in rotation answers /v1/models", 503, "service_unavailable").response()

    # ---- routing -----------------------------------------------------------------------------------------------
    def choose(self, body: Mapping[str, Any], chat: bool, out: Outcome, tried: set[int]) -> tuple[int, list[int]]:
        """The backend for this request (its index) and the prompt's block hashes at its block size."""
        now = self.now()
        left = [i for i in range(len(self.backends)) if i not in tried]
        healthy = [i for i in left if self.backends[i].healthy]
        if not healthy:
            down = "; ".join(f"{b.name}: {b.reason or 'tried'}" for b in self.backends)
            raise GatewayError(f"no backend is in rotation ({down})", 503, "service_unavailable")
        free = [i for i in healthy if not self.backends[i].saturated(now)]
        if not free:
            raise GatewayError(f"every backend is saturated ({len(healthy)} in rotation, each at its max_in_flight "
                               "or answering 429); retry later", 429, "rate_limit_error")
        keys: dict[int, tuple[int, ...]] = {}  # by tokenizer (its id); hashes by (tokenizer, block size)
        hashes: dict[tuple[int, int], list[int]] = {}
        views, chains = [], []
        for pos, i in enumerate(free):
            b = self.backends[i]
            tok = self.tokenizers.get(b.spec.tokenizer or self.cfg.tokenizer or "")
            k = keys.setdefault(id(tok), prompt_keys(body, chat, tok))
            chains.append(hashes.setdefault((id(tok), b.block_size), key_hashes(k, b.block_size)))
            views.append(b.view(pos, chains[-1], now))
            out.prompt_len = max(out.prompt_len, len(k))
        req = Request(out.id, max(now, 0.0), max(out.prompt_len, 1), out.max_tokens)
        pos = self.router.route(req, views)
        if not isinstance(pos, int) or not 0 <= pos < len(views):
            raise GatewayError(f"router {self.router_name} returned {pos!r}, not an index below {len(views)}",
                               500, "server_error")
        self.metrics.decisions.labels(self.router_name, self.backends[free[pos]].name).inc()
        return free[pos], chains[pos]

    # ---- generation --------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        arrival = self.now()
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            self.metrics.rejected.labels("bad_request").inc()
            return GatewayError(f"the request body is not a JSON object: {e}", 400, "invalid_request_error").response()
        rid = request.headers.get("X-Request-Id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        out = Outcome(rid, arrival, 1, _max_tokens(body))
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        headers["X-Request-Id"] = rid
        try:
            return await self._attempts(request, path, chat, body, raw, headers, out)
        except _Answered as e:
            out.status, out.reason = Status.REJECTED, e.error.message
            self.metrics.requests.labels(out.backend_name, "error").inc()
            return e.error.response()
        except CLIENT_GONE:  # the answer was under way; nobody reads this one
            out.status, out.reason = Status.CANCELLED, "client disconnected"
            return web.Response(status=499)
        except asyncio.CancelledError:
            out.status, out.reason = Status.CANCELLED, "client disconnected"
            raise
        finally:
            if out.status is Status.CANCELLED and out.backend >= 0:
                self.metrics.requests.labels(out.backend_name, "cancelled").inc()
            out.finish_s = self.now()
            self.recorder.add(out)

    async def _attempts(self, request: web.Request, path: str, chat: bool, body: dict[str, Any], raw: bytes,
                        headers: dict[str, str], out: Outcome) -> web.StreamResponse:
        """Route, send; on a refused connection or a 429 from the backend, route again among the others."""
        tried: set[int] = set()
        last_429: tuple[int, bytes, str] | None = None
        while True:
            try:
                if self.draining:
                    raise GatewayError("the gateway is shutting down", 503, "service_unavailable")
                i, hashes = self.choose(body, chat, out, tried)
            except GatewayError as e:
                if last_429 is not None:  # every backend said 429 itself: pass the last answer on
                    status, data, ctype = last_429
                    out.reason = f"HTTP 429 from {out.backend_name}"
                    return web.Response(status=status, body=data, content_type=ctype)
                self.metrics.rejected.labels({503: "no_backend", 429: "saturated"}.get(e.status, "error")).inc()
                out.backend, out.backend_name, out.reason = -1, "", f"HTTP {e.status}: {e.message}"
                return e.response()
            tried.add(i)
            b = self.backends[i]
            out.backend, out.backend_name, out.sent_s, out.reason = i, b.name, self.now(), ""
            cached = b.index.match(hashes, out.sent_s) * b.block_size
            key = (id(out), i)  # not the request id: a client may send the same X-Request-Id twice
            b.flights[key] = flight = Flight(out.prompt_len, out.max_tokens, cached)
            b.index.add(hashes, out.sent_s)
            try:
                upstream = await self._send(b, path, raw, headers, out)
                if upstream is None:  # refused: try another backend
                    continue
                try:
                    if upstream.status == 429:
                        b.saturated_until = self.now() + self.cfg.saturated_s
                        last_429 = (429, await upstream.read(), upstream.content_type)
                        self.metrics.requests.labels(b.name, "http_429").inc()
                        continue
                    if upstream.status != 200:
                        return await self._pass_error(b, upstream, out)
                    if body.get("stream") is True:
                        return await self._stream(request, b, upstream, flight, out)
                    return await self._whole(b, upstream, out)
                finally:
                    upstream.close()  # a no-op once read whole; else (cancelled, failed) it drops the connection
            finally:
                b.flights.pop(key, None)

    async def _send(self, b: Backend, path: str, raw: bytes, headers: dict[str, str],
                    out: Outcome) -> aiohttp.ClientResponse | None:
        """POST to the backend; None when it refused (out of rotation, the caller tries another)."""
        try:
            return await self.session.post(b.spec.url + path, data=raw, headers=headers)
        except CONNECTION_REFUSED as e:
            self.metrics.errors.labels(b.name, "refused").inc()
            b.mark_down(f"connection refused: {type(e).__name__}: {e}")
            out.reason = f"{b.name} refused the connection"
            return None
        except UPSTREAM_BROKEN as e:
            timed_out = isinstance(e, TimeoutError)
            self.metrics.errors.labels(b.name, "timeout" if timed_out else "died").inc()
            b.mark_down(f"{type(e).__name__}: {e}")
            msg = (f"backend {b.name} sent no answer within gateway.timeout_s={self.cfg.timeout_s}" if timed_out
                   else f"backend {b.name} failed before answering: {type(e).__name__}: {e}")
            raise _Answered(GatewayError(msg, 504 if timed_out else 502, "server_error"), out) from None

    async def _pass_error(self, b: Backend, upstream: aiohttp.ClientResponse, out: Outcome) -> web.Response:
        data = await upstream.read()
        if upstream.status >= 500:
            self.metrics.errors.labels(b.name, "http_5xx").inc()
        self.metrics.requests.labels(b.name, f"http_{upstream.status}").inc()
        out.reason = f"HTTP {upstream.status} from {b.name}: {data[:200].decode(errors='replace')}"
        return web.Response(status=upstream.status, body=data, content_type=upstream.content_type)

    async def _whole(self, b: Backend, upstream: aiohttp.ClientResponse, out: Outcome) -> web.Response:
        try:
            data = await upstream.read()
        except UPSTREAM_BROKEN as e:
            self.metrics.errors.labels(b.name, "timeout" if isinstance(e, TimeoutError) else "died").inc()
            b.mark_down(f"answer broke off: {type(e).__name__}: {e}")
            raise _Answered(GatewayError(f"backend {b.name} broke off its answer: {type(e).__name__}: {e}",
                                         504 if isinstance(e, TimeoutError) else 502, "server_error"), out) from None
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            self._usage(json.loads(data).get("usage"), out)
        n = out.usage_output_tokens or 1
        out.events = [(self.now(), n)]
        out.status = Status.FINISHED
        self.metrics.requests.labels(b.name, "finished").inc()
        return web.Response(status=200, body=data, content_type=upstream.content_type)

    @staticmethod
    def _usage(usage: Any, out: Outcome) -> None:
        if isinstance(usage, dict):
            out.usage_prompt_tokens = usage.get("prompt_tokens")
            out.usage_output_tokens = usage.get("completion_tokens")
            out.usage_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

    async def _stream(self, request: web.Request, b: Backend, upstream: aiohttp.ClientResponse, flight: Flight,
                      out: Outcome) -> web.StreamResponse:
        down = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await down.prepare(request)
        sse, out.events = SSEReader(), []
        fault: str | None = None
        try:
            while True:
                chunk = await upstream.content.readany()
                if not chunk:
                    break
                events, k = sse.feed(chunk)
                if k:
                    out.events.append((self.now(), k))
                    flight.streaming, flight.generated = True, flight.generated + k
                if events:
                    await self._write(down, events, out)
        except CLIENT_GONE:
            raise
        except UPSTREAM_BROKEN as e:
            timed_out = isinstance(e, TimeoutError)
            self.metrics.errors.labels(b.name, "timeout" if timed_out else "died").inc()
            fault = (f"backend {b.name} sent nothing for gateway.timeout_s={self.cfg.timeout_s}" if timed_out
                     else f"backend {b.name} broke off the stream: {type(e).__name__}: {e}")
        if fault is None and not sse.complete and sse.error is None:
            self.metrics.errors.labels(b.name, "died").inc()
            fault = f"backend {b.name} ended the stream without a finish_reason or [DONE]"
        self._usage(sse.usage, out)
        if fault is not None:
            b.mark_down(fault)
            out.status, out.reason = Status.REJECTED, fault
            self.metrics.requests.labels(b.name, "error").inc()
            await self._write(down, error_event(fault), out)
        elif sse.error is not None:
            out.status, out.reason = Status.REJECTED, f"error in stream from {b.name}: {sse.error}"
            self.metrics.requests.labels(b.name, "error").inc()
        else:
            out.status = Status.FINISHED
            self.metrics.requests.labels(b.name, "finished").inc()
        with contextlib.suppress(*CLIENT_GONE):
            await down.write_eof()
        return down

    @staticmethod
    async def _write(down: web.StreamResponse, data: bytes, out: Outcome) -> None:
        try:
            await down.write(data)
        except CLIENT_GONE:
            out.status, out.reason = Status.CANCELLED, "client disconnected"
            raise


class _Answered(Exception):
    """A backend fault answered with ``error`` (caught in ``Gateway._generate``)."""

    def __init__(self, error: GatewayError, out: Outcome) -> None:
        super().__init__(error.message)
        self.error, self.out = error, out
