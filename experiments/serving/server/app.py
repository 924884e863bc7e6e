"""The OpenAI-compatible HTTP app (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers parse and check the request (``protocol``), submit it to the serving loop (``bridge``) and turn its token
events into text: incrementally detokenized, cut at a stop string (which ends the request in the engine too),
streamed as server-sent events or returned whole. A client that goes away cancels its request; its KV blocks are
freed before the loop's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from core.request import Request, SamplingParams, Status
from core.specs import ModelSpec
from engine.tokenizer import IncrementalDetokenizer
from experiments.serving.server import protocol
from experiments.serving.server.bridge import EndEvent, LoopThread, Stream
from experiments.serving.server.metrics import CONTENT_TYPE, ServerMetrics
from experiments.serving.server.protocol import APIError, Generation

log = logging.getLogger(__name__)
MAX_ID_CHARS = 256  # longest X-Request-Id taken
TOKENIZE_THREADS = 2  # bodies parsed and prompts tokenized at once, off the event loop

@dataclass
class ServerSettings:
    model_name: str
    max_waiting: int  # queued requests (all replicas) beyond which new ones get 429
    default_sampling: SamplingParams
    api_key: str | None = None  # every /v1 route wants "Authorization: Bearer <api_key>" (None: open)
    max_prompt_chars: int = 2**24  # longer text prompts get 413 before tokenization (serve.max_prompt_chars)
    tokenize_timeout_s: float = 30.0  # body parsing + tokenization taking longer: 413
    has_logits: bool = True  # False (backend=sim): fields that need a model's logits are refused


class _Output:
    """One response's text: detokenized incrementally, held back near a possible stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already handed out
        self.token_ids: list[int] = []
        self.logprobs: list[tuple | None] = []  # per token, as the sampler gave it (None: not asked)
        self.stopped = False
        self.end: EndEvent | None = None  # how the request ended

    def add(self, token_id: int, logprob: tuple | None = None) -> str:
        """Take a token; return the text that can be sent now."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
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
        self.live: set[str] = set()  # ids of requests being answered (event-loop thread only)
        self.issued: set[str] = set()  # every request id handed to the loop (event-loop thread only)
        # parsing and tokenization run here, so a huge prompt stalls neither the event loop nor other streams
        self.parser = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models), web.get("/health", self.health),
                web.get("/metrics", self.prometheus)]

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """The API key on every /v1 route; every error an OpenAI-style JSON body (aiohttp's own 404 / 405 / 413
        too), never a traceback."""
        try:
            key = self.settings.api_key
            if key is not None and request.path.startswith("/v1/"):
                got = request.headers.get("Authorization", "").encode("utf-8", "replace")
                if not hmac.compare_digest(got, f"Bearer {key}".encode("utf-8", "replace")):
                    raise APIError("missing or wrong API key: send 'Authorization: Bearer <serve.api_key>'", 401,
                                   kind="authentication_error")
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response(APIError(e.reason, e.status).body(), status=e.status)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as e:  # a bug: answered as one, and logged with its traceback
            log.exception("internal error on %s", request.path)
            return web.json_response(APIError(f"internal error: {type(e).__name__}: {e}", 500,
                                              kind="server_error").body(), status=500)

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
        rid = owned = None  # owned: the client's id, once this handler holds it in ``live``
        try:
            if self.draining:
                raise APIError("the server is shutting down", status=503, kind="service_unavailable")
            # a client's X-Request-Id names the request in the run files too (its records and ours then pair up)
            given = _request_id(request) or protocol.new_id("chatcmpl" if chat else "cmpl")
            if given in self.live:  # checked before the request goes anywhere near the loop's stream table
                raise APIError("X-Request-Id names a request still being answered; ids must be unique", 409,
                               param="X-Request-Id")
            # A finished request's id may come again (a benchmark rerun against a long-lived server): the run
            # files then name this one ``<id>#<n>``, so every record stays unique and still pairs with the client.
            rid, n = given, 0
            while rid in self.issued:
                n += 1
                rid = f"{given}#{n}"
            self.issued.add(rid)
            owned = given
            self.live.add(owned)
            gen = await self._parse(request, chat)
            snap = self.bridge.snapshot
            waiting = snap.num_waiting + self.bridge.pending  # queued, and submitted but not yet dispatched
            if waiting >= self.settings.max_waiting:
                raise APIError(f"too many requests waiting ({waiting} >= serve.max_waiting="
                               f"{self.settings.max_waiting}); retry later", status=429, kind="rate_limit_error")
            try:
                req = Request(rid, self.bridge.now(), len(gen.prompt_ids), gen.max_tokens,
                              prompt_token_ids=gen.prompt_ids, sampling=gen.sampling, ignore_eos=gen.ignore_eos,
                              min_tokens=gen.min_tokens, stop_token_ids=gen.stop_token_ids)
            except ValueError as e:  # protocol checks every field first; this is a last line
                raise APIError(str(e)) from None
            stream = await self.bridge.submit(req)
            if stream.state.status is Status.REJECTED:
                raise APIError(f"request rejected: {stream.state.reason}")
        except APIError as e:
            self.live.discard(owned)
            return web.json_response(e.body(), status=e.status)
        except ValueError as e:  # a request id used before
            self.live.discard(owned)
            return web.json_response(APIError(str(e), param="X-Request-Id").body(), status=400)
        except RuntimeError as e:  # the loop has failed or stopped
            self.live.discard(owned)
            return web.json_response(APIError(str(e), 503, kind="service_unavailable").body(), status=503)
        except BaseException:  # cancelled (client gone) while parsing or queued
            self.live.discard(owned)
            raise
        ended = False
        try:
            if gen.stream:
                response = await self._stream(request, stream, gen, chat)
            else:
                response = await self._whole(stream, gen, chat)
            ended = True
            return response
        finally:
            self.live.discard(owned)
            if not ended:  # client gone (write failed or handler cancelled), or an error: free the KV now
                self.bridge.abort(stream.request.id, "client disconnected")

    async def _parse(self, request: web.Request, chat: bool) -> Generation:
        """The body read, then parsed and tokenized in a worker thread within ``tokenize_timeout_s``."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise APIError(f"the request body is over the server's limit: {e.text}", 413) from None
        work = asyncio.get_running_loop().run_in_executor(self.parser, self._parse_body, raw, chat)
        try:
            return await asyncio.wait_for(work, self.settings.tokenize_timeout_s)
        except TimeoutError:
            raise APIError(f"parsing and tokenizing this request took over serve.tokenize_timeout_s="
                           f"{self.settings.tokenize_timeout_s} s; send a shorter prompt", 413,
                           param="messages" if chat else "prompt") from None

    def _parse_body(self, raw: bytes, chat: bool) -> Generation:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, an int of 5000 digits, deep nesting
            raise APIError(f"the request body is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.settings.model_name:
            raise APIError(f"model {str(model)[:100]!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}", status=404, param="model", kind="not_found_error")
        cap = self.settings.max_prompt_chars
        if chat:
            prompt = protocol.chat_prompt(body, self.tokenizer, cap)
        else:
            prompt = protocol.completion_prompt(body, self.tokenizer, self.spec.vocab_size, cap,
                                                self.spec.max_model_len)
        return protocol.parse_generation(body, prompt, self.spec.max_model_len, self.settings.default_sampling,
                                         self.spec.vocab_size, chat, self.settings.has_logits)

    async def _events(self, stream: Stream, gen: Generation, out: _Output):
        """Yield (text, token_id) per token; returns the finish reason through ``out``."""
        while True:
            event = await stream.queue.get()
            if isinstance(event, EndEvent):
                out.end = event
                return
            text = out.add(event.token_id, event.logprob)
            yield text, event.token_id
            if out.stopped:  # a stop string: end the request in the engine as finished
                self.bridge.finish_early(stream.request.id, "stop string")
                out.end = EndEvent(Status.FINISHED, "stop string")
                return

    def _echo(self, gen: Generation) -> tuple[str, tuple[int, ...]]:
        """What ``echo`` puts before the answer: the prompt's text and ids."""
        if not gen.echo:
            return "", ()
        return (self.tokenizer.decode(list(gen.prompt_ids)) if self.tokenizer is not None else ""), gen.prompt_ids

    def _logprobs(self, gen: Generation, chat: bool, ids: list[int], lps: list, offset: int) -> dict | None:
        if gen.logprobs is None:
            return None
        tok = self.tokenizer
        spell = (lambda t: tok.decode([t])) if tok is not None else (lambda t: f"token_id:{t}")
        return protocol.logprobs_block(chat, list(zip(ids, lps, strict=True)), spell, offset)

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
        head, head_ids = self._echo(gen)
        ids = [*head_ids, *out.token_ids] if gen.return_token_ids else None
        choice = protocol.choice(chat, head + out.text, self._finish_reason(out, gen), delta=False, token_ids=ids,
                                 logprobs=self._logprobs(gen, chat, out.token_ids, out.logprobs, len(head)))
        body = protocol.envelope(chat, stream.request.id, self.settings.model_name, protocol.now_s(), [choice],
                                 stream=False, usage_block=protocol.usage(len(gen.prompt_ids), len(out.token_ids)))
        return web.json_response(body)

    async def _stream(self, request: web.Request, stream: Stream, gen: Generation, chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        rid, model, created = stream.request.id, self.settings.model_name, protocol.now_s()
        out = _Output(self.tokenizer, gen.stop)
        first = True
        head, head_ids = self._echo(gen)

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

        async for text, token_id in self._events(stream, gen, out):
            ids = [*head_ids, token_id] if gen.return_token_ids else None
            lps = self._logprobs(gen, chat, [token_id], out.logprobs[-1:], len(head) + out.sent - len(text))
            piece = protocol.choice(chat, head + text, None, True, first, ids, lps)
            await send(protocol.envelope(chat, rid, model, created, [piece], stream=True))
            first, head, head_ids = False, "", ()
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


async def drain(server: OpenAIServer, timeout_s: float) -> None:
    """Refuse new requests, then let those in flight finish for up to ``timeout_s`` and cancel the rest."""
    server.draining = True
    await asyncio.get_running_loop().run_in_executor(None, server.bridge.drain, timeout_s)


def _request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id: printable, valid UTF-8 and at most ``MAX_ID_CHARS`` long (it names the request
    in the run files), else a 400 naming the header."""
    rid = request.headers.get("X-Request-Id")
    if not rid:
        return None
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError("X-Request-Id is not valid UTF-8", param="X-Request-Id") from None
    if len(rid) > MAX_ID_CHARS or not rid.isprintable():
        raise APIError(f"X-Request-Id must be printable and at most {MAX_ID_CHARS} characters", param="X-Request-Id")
    return rid
