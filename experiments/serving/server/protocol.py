"""The OpenAI API's request bodies, checked and turned into what the serving loop runs; its response shapes.

Follows the OpenAI completions and chat-completions APIs with vLLM's extensions (``ignore_eos``, ``min_tokens``,
``top_k``, ``return_token_ids``). Unknown fields are ignored (clients send their own); a known field of the
wrong type or out of range is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from core.request import SamplingParams


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.kind = message, status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Generation:
    """One generation request: the prompt as token ids and how to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int
    return_token_ids: bool


_MISSING = object()


def _field(body: dict[str, Any], key: str, types: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise APIError(f"'{key}' is required", param=key)
        return default
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _tuple(types))
    if not ok:
        names = " or ".join(t.__name__ for t in _tuple(types))
        raise APIError(f"'{key}' must be {names}, got {type(v).__name__}", param=key)
    return v


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _token_ids(v: Any, key: str, vocab_size: int) -> tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise APIError(f"'{key}' must be a string or a list of token ids", param=key)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'{key}' has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=key)
    return tuple(v)


def parse_generation(body: Any, prompt_ids: tuple[int, ...], max_model_len: int,
                     default_sampling: SamplingParams) -> Generation:
    """The fields both endpoints share, given the prompt already as token ids."""
    if not prompt_ids:
        raise APIError("the prompt is empty", param="prompt")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_model_len} tokens",
                       param="prompt")
    max_tokens = _field(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", int, room)
    if max_tokens < 1:
        raise APIError(f"'max_tokens' must be >= 1, got {max_tokens}", param="max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise APIError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds this model's "
                       f"context of {max_model_len} tokens", param="max_tokens")
    if _field(body, "n", int, 1) != 1:
        raise APIError("only n=1 is supported", param="n")
    temperature = float(_field(body, "temperature", (int, float), default_sampling.temperature))
    top_p = float(_field(body, "top_p", (int, float), default_sampling.top_p))
    top_k = _field(body, "top_k", int, default_sampling.top_k)
    seed = _field(body, "seed", int, None)
    try:
        sampling = SamplingParams(temperature, top_p, 0 if top_k == -1 else top_k, seed)
    except ValueError as e:
        raise APIError(str(e).replace("sampling.", ""), param="sampling") from None
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    stop_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    options = _field(body, "stream_options", dict, {})
    min_tokens = _field(body, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise APIError(f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}",
                       param="min_tokens")
    return Generation(prompt_ids, max_tokens, sampling, tuple(stop), tuple(stop_ids),
                      _field(body, "stream", bool, False), bool(_field(options, "include_usage", bool, False)),
                      _field(body, "ignore_eos", bool, False), min_tokens,
                      _field(body, "return_token_ids", bool, False))


def completion_prompt(body: Any, tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """``prompt``: a string (needs the checkpoint's tokenizer), a list of token ids, or a one-element list of
    either (a batch of several prompts is not supported)."""
    prompt = _field(body, "prompt", (str, list))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this checkpoint has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return tuple(tokenizer.encode(prompt))
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError("a batch of several prompts is not supported; send one prompt per request", param="prompt")
    return _token_ids(prompt, "prompt", vocab_size)


def chat_prompt(body: Any, tokenizer: Any) -> tuple[int, ...]:
    """``messages`` through the checkpoint's chat template."""
    messages = _field(body, "messages", list)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this checkpoint has no chat template; use /v1/completions", param="messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # a template that rejects these messages
        raise APIError(f"the chat template failed on these messages: {e}", param="messages") from None
    if not isinstance(ids, list):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(chat: bool, text: str, finish_reason: str | None, delta: bool, first: bool = False,
           token_ids: list[int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if not chat:
        out["text"] = text
    elif delta:
        out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        out["message"] = {"role": "assistant", "content": text}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def envelope(chat: bool, rid: str, model: str, created: int, choices: list[dict[str, Any]], stream: bool,
             usage_block: dict[str, int] | None = None) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    out: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_block is not None or not stream:
        out["usage"] = usage_block
    return out


def now_s() -> int:
    return int(time.time())
