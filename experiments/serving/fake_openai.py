"""A fake OpenAI-compatible completions server with known timings, for testing and benchmarking load clients.

``POST /v1/completions`` answers a streaming request (``stream: true``) with SSE chunks after a fixed time to
first token, then one chunk every ``itl_s`` seconds, ``tokens_per_chunk`` tokens per chunk, ``max_tokens`` tokens
in all (fewer when ``ignore_eos`` is false and ``eos_after`` is set: the fake "model" emits EOS after that many
tokens unless ``min_tokens`` asks for more), then the usage chunk (``stream_options.include_usage``) and
``data: [DONE]``. With ``return_token_ids: true`` (vLLM's extension) each chunk lists its ``token_ids``. A
non-streaming request gets one JSON answer after the same total time. ``GET /v1/models`` lists ``model``. Chunks
are paced on absolute times (first token at receipt + ttft, chunk j at + j * itl), so delays do not accumulate.

``plan(request_id, body)`` may override the behaviour per request (``X-Request-Id`` header): return None or a
dict with any of ``status`` (an HTTP error status to answer with, after ``delay_s``), ``ttft_s``, ``itl_s``,
``tokens_per_chunk``, ``abort_after`` (drop the connection after that many chunks). The server records, per
request id, its receipt time and the time each chunk was written (``time.monotonic``, the clock of asyncio loops,
so of an in-process client), in ``log``.

In-process (tests): ``with FakeOpenAIServer(ttft_s=0.02, itl_s=0.005) as srv: srv.url ...`` runs it on its own
event loop in a background thread on 127.0.0.1 and a free port. As a process (benchmarks, so that the server does
not share the client's interpreter): ``python -m experiments.fake_openai --port 0 --ttft-ms 1 --itl-ms 1``
prints ``PORT <n>`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

Plan = Callable[[str, dict[str, Any]], dict[str, Any] | None]


@dataclass
class RequestLog:
    received: float
    body: dict[str, Any]
    status: int = 200
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)


class FakeOpenAIServer:
    def __init__(self, ttft_s: float = 0.01, itl_s: float = 0.005, tokens_per_chunk: int = 1,
                 eos_after: int | None = None, include_usage: bool = True, model: str = "fake-model",
                 plan: Plan | None = None, host: str = "127.0.0.1", port: int = 0, keep_log: bool = True) -> None:
        self.ttft_s, self.itl_s, self.tokens_per_chunk = ttft_s, itl_s, tokens_per_chunk
        self.eos_after, self.include_usage, self.model, self.plan = eos_after, include_usage, model, plan
        self.host, self.port, self.keep_log = host, port, keep_log
        self.log: dict[str, RequestLog] = {}
        self.num_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- handlers ----------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "root": self.model}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        t_recv = time.monotonic()
        self.num_requests += 1
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "bad JSON")
        rid = request.headers.get("X-Request-Id", f"anon{self.num_requests}")
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            return _error(400, "prompt must be a string or a list of token ids")
        plan = (self.plan(rid, body) if self.plan else None) or {}
        entry = RequestLog(t_recv, body)
        if self.keep_log:
            self.log[rid] = entry
        ttft, itl = plan.get("ttft_s", self.ttft_s), plan.get("itl_s", self.itl_s)
        per_chunk = plan.get("tokens_per_chunk", self.tokens_per_chunk)
        if plan.get("status"):
            entry.status = plan["status"]
            await asyncio.sleep(plan.get("delay_s", 0.0))
            return _error(plan["status"], plan.get("message", f"fake error {plan['status']}"))
        n = max_tokens
        if not body.get("ignore_eos") and self.eos_after is not None:
            n = min(n, max(self.eos_after, body.get("min_tokens") or 0))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        finish = "length" if n == max_tokens else "stop"
        if not body.get("stream"):
            await asyncio.sleep(max(0.0, t_recv + ttft + itl * (-(-n // per_chunk) - 1) - time.monotonic()))
            return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion", "model": self.model,
                                      "choices": [{"index": 0, "text": " x" * n, "finish_reason": finish}],
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent, j = 0, 0
        while sent < n:
            k = min(per_chunk, n - sent)
            due = t_recv + ttft + j * itl
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent += k
            choice = {"index": 0, "text": " x" * k, "finish_reason": finish if sent == n else None}
            if body.get("return_token_ids"):  # vLLM's extension: the ids of the chunk's tokens
                choice["token_ids"] = list(range(sent - k, sent))
            chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "model": self.model, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            entry.chunk_times.append(time.monotonic())
            entry.chunk_tokens.append(k)
            j += 1
            if j == plan.get("abort_after"):
                request.transport.close()  # a crash mid-answer: no finish_reason, no [DONE]
                return resp
        if self.include_usage and (body.get("stream_options") or {}).get("include_usage"):
            tail = {"id": f"cmpl-{rid}", "object": "text_completion", "model": self.model, "choices": [],
                    "usage": usage}
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    async def start_async(self) -> None:
        # handler_cancellation: a client that disconnects (a timeout) cancels its handler, as in a real server
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> FakeOpenAIServer:
        """Serve from a background thread with its own event loop; returns once the port is bound."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as e:  # report a bind failure to the caller instead of hanging it
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = self._loop = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _error(status: int, message: str) -> web.Response:
    kind = {400: "BadRequestError", 429: "RateLimitError"}.get(status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A fake OpenAI-compatible streaming completions server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=10.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    args = p.parse_args(argv)
    srv = FakeOpenAIServer(args.ttft_ms / 1e3, args.itl_ms / 1e3, args.tokens_per_chunk, host=args.host,
                           port=args.port, keep_log=False)

    async def serve() -> None:
        await srv.start_async()
        print(f"PORT {srv.port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
