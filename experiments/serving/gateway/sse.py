"""Reading an OpenAI server-sent-event stream as it passes through: complete events out, tokens and usage counted."""

from __future__ import annotations

import json
from dataclasses import dataclass

from experiments.serving.loadgen.client import _tokens_in_chunk

EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # what ends an SSE event (servers built on sse-starlette send CRLF)


@dataclass
class SSEReader:
    """Feed raw bytes; ``feed`` returns the complete events (ended by a blank line: LF or CRLF) to pass on, and the
    output tokens they carry. Also kept: the usage block, whether a finish_reason / ``[DONE]`` / an error was seen."""

    buffer: bytes = b""
    done: bool = False
    finished: bool = False
    error: str | None = None
    usage: dict | None = None

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        self.buffer += chunk
        cut = max((i + len(sep) for sep in EVENT_ENDS if (i := self.buffer.rfind(sep)) >= 0), default=0)
        if not cut:
            return b"", 0
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        tokens = 0
        for line in out.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                err = obj["error"]
                self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            for choice in obj.get("choices") or ():
                tokens += _tokens_in_chunk(choice)
                self.finished = self.finished or choice.get("finish_reason") is not None
            if obj.get("usage"):
                self.usage = obj["usage"]
        return out, tokens

    @property
    def complete(self) -> bool:
        return self.error is None and (self.done or self.finished)


def error_event(message: str, kind: str = "server_error", code: int = 502) -> bytes:
    """An OpenAI-style error object as one SSE event, then ``[DONE]``."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
