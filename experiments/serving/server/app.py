"""The OpenAI-compatible HTTP app (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers parse and check the request (``protocol``), submit it to the serving loop (``bridge``) and turn its token
events into text: incrementally detokenized, cut at a stop string (which ends the request in the engine too),
streamed as server-sent events or returned whole. A client that goes away cancels its request; its KV blocks are
freed before the loop's next step.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from core.journal import safe_text
from core.request import Request, SamplingParams, Status
from core.specs import ModelSpec
from engine.tokenizer import IncrementalDetokenizer
from experiments.serving.server import protocol
from experiments.serving.server.bridge import EndEvent, LoopThread, Stream
from experiments.serving.server.metrics import CONTENT_TYPE, ServerMetrics
from experiments.serving.server.protocol import APIError, Generation


@dataclass
class ServerSettings:
    model_name: str
    max_waiting: int  # queued requests (all replicas) beyond which new ones get 429
    default_sampling: SamplingParams


class _Output:
    """One response's text: detokenized incrementally, held back near a possible stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already handed out
        self.token_ids: list[int] = []
        self.stopped = False
        self.end: EndEvent | None = None  # how the request ended

    def add(self, token_id: int) -> str:
        """Take a token; return the text that can be sent now."""
        self.token_ids.append(token_id)
        if self.detok is None:
            return ""
        self.text += self.detok.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if self.detok is not None and not self.stopped:
            self.text += self.detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


class OpenAIServer:
    """The routes. ``bridge`` is attached when the app starts (it needs the running event loop)."""

    def __init__(self, spec: ModelSpec, tokenizer: Any, settings: ServerSettings) -> None:
        self.spec, self.tokenizer, self.settings = spec, tokenizer, settings
        self.bridge: LoopThread | None = None
        self.metrics: ServerMetrics | None = None
        self.draining = False

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models), web.get("/health", self.health),
                web.get("/metrics", self.prometheus)]

    # ---- small endpoints ------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.settings.model_name, "object": "model", "created": protocol.now_s(),
                "owned_by": "twinserve", "max_model_len": self.spec.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.bridge.error is not None:
            return web.json_response({"status": "error", "error": str(self.bridge.error)}, status=500)
        return web.json_response({"status": "draining" if self.draining else "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- generation -----------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            gen = self._parse(await self._body(request), chat)
            if self.draining:
                raise APIError("the server is shutting down", status=503, kind="service_unavailable")
            snap = self.bridge.snapshot
            if snap.num_waiting + self.bridge.pending >= self.settings.max_waiting:
                raise APIError(f"too many requests waiting ({snap.num_waiting} >= serve.max_waiting="
                               f"{self.settings.max_waiting}); retry later", status=429, kind="rate_limit_error")
            # a client's X-Request-Id names the request in the run files too (its records and ours then pair up)
            rid = _request_id(request, chat)
            req = Request(rid, self.bridge.now(), len(gen.prompt_ids), gen.max_tokens, prompt_token_ids=gen.prompt_ids,
                          sampling=gen.sampling, ignore_eos=gen.ignore_eos, min_tokens=gen.min_tokens,
                          stop_token_ids=gen.stop_token_ids)
            stream = await self.bridge.submit(req)
            if stream.state.status is Status.REJECTED:
                raise APIError(f"request rejected: {stream.state.reason}")
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except ValueError as e:  # a request id used before
            return web.json_response(APIError(str(e), param="X-Request-Id").body(), status=400)
        except RuntimeError as e:  # the loop has failed or stopped
            return web.json_response(APIError(str(e), 503, kind="service_unavailable").body(), status=503)
        ended = False
        try:
            if gen.stream:
                response = await self._stream(request, stream, gen, chat)
            else:
                response = await self._whole(stream, gen, chat)
            ended = True
            return response
        finally:
            if not ended:  # client gone (write failed or handler cancelled), or an error: free the KV now
                self.bridge.abort(stream.request.id, "client disconnected")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.settings.model_name:
            raise APIError(f"model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                           status=404, param="model", kind="not_found_error")
        return body

    def _parse(self, body: dict[str, Any], chat: bool) -> Generation:
        if chat:
            prompt = protocol.chat_prompt(body, self.tokenizer)
        else:
            prompt = protocol.completion_prompt(body, self.tokenizer, self.spec.vocab_size)
        return protocol.parse_generation(body, prompt, self.spec.max_model_len, self.settings.default_sampling)

    async def _events(self, stream: Stream, gen: Generation, out: _Output):
        """Yield (text, token_id) per token; returns the finish reason through ``out``."""
        while True:
            event = await stream.queue.get()
            if isinstance(event, EndEvent):
                out.end = event
                return
            text = out.add(event.token_id)
            yield text, event.token_id
            if out.stopped:  # a stop string: end the request in the engine as finished
                self.bridge.finish_early(stream.request.id, "stop string")
                out.end = EndEvent(Status.FINISHED, "stop string")
                return

    @staticmethod
    def _finish_reason(out: _Output, gen: Generation) -> str:
        end = out.end
        if end.status is Status.FINISHED:
            return "length" if len(out.token_ids) >= gen.max_tokens and not out.stopped else "stop"
        return "abort"

    async def _whole(self, stream: Stream, gen: Generation, chat: bool) -> web.Response:
        out = _Output(self.tokenizer, gen.stop)
        async for _ in self._events(stream, gen, out):
            pass
        out.finish()
        if out.end.status is not Status.FINISHED:
            status = 504 if out.end.status is Status.TIMED_OUT else 500
            err = APIError(f"request {out.end.status.value.lower()}: {out.end.reason}", status, kind="server_error")
            return web.json_response(err.body(), status=status)
        choice = protocol.choice(chat, out.text, self._finish_reason(out, gen), delta=False,
                                 token_ids=out.token_ids if gen.return_token_ids else None)
        body = protocol.envelope(chat, stream.request.id, self.settings.model_name, protocol.now_s(), [choice],
                                 stream=False, usage_block=protocol.usage(len(gen.prompt_ids), len(out.token_ids)))
        return web.json_response(body)

    async def _stream(self, request: web.Request, stream: Stream, gen: Generation, chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        rid, model, created = stream.request.id, self.settings.model_name, protocol.now_s()
        out = _Output(self.tokenizer, gen.stop)
        first = True

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

        async for text, token_id in self._events(stream, gen, out):
            piece = protocol.choice(chat, text, None, True, first, [token_id] if gen.return_token_ids else None)
            await send(protocol.envelope(chat, rid, model, created, [piece], stream=True))
            first = False
        tail = out.finish()
        if out.end.status is Status.FINISHED:
            reason = self._finish_reason(out, gen)
            await send(protocol.envelope(chat, rid, model, created, [protocol.choice(chat, tail, reason, True, first)],
                                         stream=True))
        else:
            err = APIError(f"request {out.end.status.value.lower()}: {out.end.reason}", 500, kind="server_error")
            await send(err.body())
        if gen.include_usage:
            await send(protocol.envelope(chat, rid, model, created, [], stream=True,
                                         usage_block=protocol.usage(len(gen.prompt_ids), len(out.token_ids))))
        await send("[DONE]")
        await response.write_eof()
        return response


def _request_id(request: web.Request, chat: bool) -> str:
    """The client's X-Request-Id (any bytes it holds made writable: ``core.journal.safe_text``), else a new id."""
    return safe_text(request.headers.get("X-Request-Id") or "") or protocol.new_id("chatcmpl" if chat else "cmpl")


async def drain(server: OpenAIServer, timeout_s: float) -> None:
    """Refuse new requests, then let those in flight finish for up to ``timeout_s`` and cancel the rest."""
    server.draining = True
    await asyncio.get_running_loop().run_in_executor(None, server.bridge.drain, timeout_s)
