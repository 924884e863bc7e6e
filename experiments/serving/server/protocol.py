"""The OpenAI API's request bodies, checked and turned into what the serving loop runs; its response shapes.

Follows the OpenAI completions and chat-completions APIs with vLLM's extensions (``ignore_eos``, ``min_tokens``,
``top_k``, ``repetition_penalty``, ``return_token_ids``). Unknown fields are ignored (clients send their own); a
known field of the wrong type, non-finite or out of range is a 400 naming it; a field that would change the answer
but is not implemented (``REFUSED``) is a 400 naming it, never ignored.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from core.request import BIAS_RANGE, MAX_LOGPROBS, MIN_TEMPERATURE, PENALTY_RANGE, SamplingParams


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
    echo: bool = False  # the prompt's text (and ids) come first in the answer
    logprobs: int | None = None  # alternatives per token with logprobs; None: no logprobs block


# Fields that change the answer and are not implemented: refused (400 naming the field) unless they carry the
# neutral value given here (what a client that does not use them may still send).
REFUSED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},), "tools": ([],),
    "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"), "min_p": (0, 0.0),
    "prompt_logprobs": (0,), "use_beam_search": (False,), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "allowed_token_ids": (), "bad_words": ([],),
    "include_stop_str_in_output": (False,), "truncate_prompt_tokens": (), "logits_processors": ([],),
    "prediction": (), "audio": (), "modalities": (["text"],),
}
# Fields only a backend with logits can honour (backend=sim samples placeholder tokens: it has none), and their
# neutral values
NEEDS_LOGITS: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,), "top_logprobs": (), "logit_bias": ({},), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0)}


def _neutral(v: Any, neutral: tuple[Any, ...]) -> bool:
    return v is None or any(v == n and type(v) is type(n) for n in neutral)


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


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """A finite number in [lo, hi] (JSON has no NaN, but Python's parser reads NaN and Infinity)."""
    v = float(_field(body, key, (int, float), default))
    if not (math.isfinite(v) and lo <= v <= hi):
        raise APIError(f"'{key}' must be a finite number in [{lo}, {hi}], got {v}", param=key)
    return v


def _refuse(body: dict[str, Any], chat: bool, has_logits: bool) -> None:
    for key, neutral in REFUSED.items():
        if not _neutral(body.get(key), neutral):
            raise APIError(f"'{key}' is not supported by this server (it would change the answer); leave it out",
                           param=key)
    if chat and body.get("echo") not in (None, False):
        raise APIError("'echo' is a /v1/completions field", param="echo")
    if not has_logits:
        for key, neutral in NEEDS_LOGITS.items():
            if not _neutral(body.get(key), neutral):
                raise APIError(f"'{key}' needs a model's logits; this server (backend=sim) samples placeholder "
                               "tokens", param=key)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Completions: ``logprobs`` = how many alternatives (0..20). Chat: ``logprobs`` true, ``top_logprobs`` 0..20."""
    if chat:
        if not _field(body, "logprobs", bool, False):
            if body.get("top_logprobs") is not None:
                raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        key, n = "top_logprobs", _field(body, "top_logprobs", int, 0)
    else:
        key, n = "logprobs", _field(body, "logprobs", int, None)
        if n is None:
            return None
    if not 0 <= n <= MAX_LOGPROBS:
        raise APIError(f"'{key}' must be in [0, {MAX_LOGPROBS}], got {n}", param=key)
    return n


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = _field(body, "logit_bias", dict, {})
    out = []
    for k, v in bias.items():
        tok = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() and len(k) < 20 else None
        if tok is None or not 0 <= tok < vocab_size:
            raise APIError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {k!r}", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not BIAS_RANGE[0] <= v <= BIAS_RANGE[1]:
            raise APIError(f"'logit_bias' values must be numbers in [{BIAS_RANGE[0]}, {BIAS_RANGE[1]}], got {v!r} "
                           f"for token {tok}", param="logit_bias")
        out.append((tok, float(v)))
    return tuple(sorted(out))


def _token_ids(v: Any, key: str, vocab_size: int) -> tuple[int, ...]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise APIError(f"'{key}' must be a string or a list of token ids", param=key)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'{key}' has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=key)
    return tuple(v)


def parse_generation(body: Any, prompt_ids: tuple[int, ...], max_model_len: int,
                     default_sampling: SamplingParams, vocab_size: int = 2**31, chat: bool = False,
                     has_logits: bool = True) -> Generation:
    """The fields both endpoints share, given the prompt already as token ids. ``has_logits``: False for a backend
    that samples placeholder tokens (fields that need logits are then refused)."""
    _refuse(body, chat, has_logits)
    if not prompt_ids:
        raise APIError("the prompt is empty", param="prompt")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_model_len} tokens",
                       param="prompt")
    key = "max_tokens"
    max_tokens = _field(body, key, int, None)
    if max_tokens is None:
        key = "max_completion_tokens"
        max_tokens = _field(body, key, int, room)
    if max_tokens < 1:
        raise APIError(f"'{key}' must be >= 1, got {max_tokens}", param=key)
    if len(prompt_ids) + max_tokens > max_model_len:
        raise APIError(f"prompt ({len(prompt_ids)} tokens) + {key} ({max_tokens}) exceeds this model's "
                       f"context of {max_model_len} tokens", param=key)
    if _field(body, "n", int, 1) != 1:
        raise APIError("only n=1 is supported", param="n")
    d = default_sampling
    temperature = _number(body, "temperature", d.temperature, 0.0, 1e6)
    if 0 < temperature < MIN_TEMPERATURE:
        raise APIError(f"'temperature' must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}",
                       param="temperature")
    top_p = _number(body, "top_p", d.top_p, 0.0, 1.0)
    if top_p == 0:
        raise APIError("'top_p' must be in (0, 1], got 0", param="top_p")
    top_k = _field(body, "top_k", int, d.top_k)
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 or 0 (off) or a positive count, got {top_k}", param="top_k")
    seed = _field(body, "seed", int, None)
    logprobs = _logprobs(body, chat)
    fields = {"seed": seed, "logprobs": logprobs, "logit_bias": _logit_bias(body, vocab_size),
              "presence_penalty": _number(body, "presence_penalty", 0.0, *PENALTY_RANGE),
              "frequency_penalty": _number(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
              "repetition_penalty": _number(body, "repetition_penalty", 1.0, 1e-3, 1e3)}
    if fields["repetition_penalty"] <= 0:
        raise APIError("'repetition_penalty' must be > 0", param="repetition_penalty")
    try:
        sampling = SamplingParams(temperature, top_p, 0 if top_k == -1 else top_k, **fields)
    except ValueError as e:  # "sampling.<key> must ...": blame that key
        key = str(e).split(" ", 1)[0].removeprefix("sampling.")
        raise APIError(str(e).replace("sampling.", ""), param=key) from None
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    stop_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise APIError("'stop_token_ids' must be a list of integers", param="stop_token_ids")
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"'stop_token_ids' has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                       param="stop_token_ids")
    options = _field(body, "stream_options", dict, {})
    min_tokens = _field(body, "min_tokens", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise APIError(f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}",
                       param="min_tokens")
    echo = _field(body, "echo", bool, False)
    if echo and logprobs is not None:
        raise APIError("'echo' with 'logprobs' would need the prompt's logprobs, which this server does not "
                       "compute; ask for one of them", param="echo")
    return Generation(prompt_ids, max_tokens, sampling, tuple(stop), tuple(stop_ids),
                      _field(body, "stream", bool, False), bool(_field(options, "include_usage", bool, False)),
                      _field(body, "ignore_eos", bool, False), min_tokens,
                      _field(body, "return_token_ids", bool, False), echo, logprobs)


def check_text(text: str, key: str, max_chars: int) -> None:
    """A prompt text a tokenizer can take: at most ``max_chars`` characters, valid Unicode (no lone surrogate)."""
    if len(text) > max_chars:
        raise APIError(f"'{key}' has {len(text)} characters; this server takes at most serve.max_prompt_chars="
                       f"{max_chars}", status=413, param=key)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{key}' is not valid Unicode: {e.reason} at character {e.start}", param=key) from None


PROMPT_CHARS_PER_TOKEN = 32  # serve.max_prompt_chars null: this many characters per token of context
PROBE_CHARS_PER_TOKEN = 4  # a long text is first tokenized on a prefix of this many characters per context token


def encode(tokenizer: Any, text: str, max_model_len: int) -> tuple[int, ...]:
    """``text`` as token ids. A text longer than ``PROBE_CHARS_PER_TOKEN`` x the context is first tokenized on
    prefixes of doubling length: one already over the context (plus a margin for a word cut at its end) refuses
    the whole at that cost, so a 10 MB prompt for a 4k-token model is refused in milliseconds."""
    n = PROBE_CHARS_PER_TOKEN * max_model_len
    while n < len(text):
        got = len(tokenizer.encode(text[:n]))
        if got > max_model_len + 16:
            raise APIError(f"the prompt has over {got} tokens in its first {n} characters (of {len(text)}); this "
                           f"model's context is {max_model_len} tokens", param="prompt")
        n *= 2
    return tuple(tokenizer.encode(text))


def completion_prompt(body: Any, tokenizer: Any, vocab_size: int, max_chars: int = 2**62,
                      max_model_len: int = 2**62) -> tuple[int, ...]:
    """``prompt``: a string (needs the checkpoint's tokenizer), a list of token ids, or a one-element list of
    either (a batch of several prompts is not supported)."""
    prompt = _field(body, "prompt", (str, list))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this checkpoint has no tokenizer: send the prompt as a list of token ids", param="prompt")
        check_text(prompt, "prompt", max_chars)
        return encode(tokenizer, prompt, max_model_len)
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError("a batch of several prompts is not supported; send one prompt per request", param="prompt")
    return _token_ids(prompt, "prompt", vocab_size)


def chat_prompt(body: Any, tokenizer: Any, max_chars: int = 2**62) -> tuple[int, ...]:
    """``messages`` through the checkpoint's chat template."""
    messages = _field(body, "messages", list)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this checkpoint has no chat template; use /v1/completions", param="messages")
    check_text(json.dumps(messages, ensure_ascii=False), "messages", max_chars)
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


def logprobs_block(chat: bool, entries: list[tuple[int, tuple | None]], token_text, offset: int = 0) -> dict | None:
    """OpenAI's logprobs of ``entries`` ((token id, (logprob, ((alt id, logprob), ...)) or None) per token);
    ``token_text(id)`` spells a token; ``offset``: characters of text before the first (completions'
    ``text_offset``)."""
    entries = [(t, lp) for t, lp in entries if lp is not None]
    if chat:
        def one(t: int, lp: float) -> dict[str, Any]:
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
        return {"content": [{**one(t, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                            for t, (lp, alts) in entries]}
    tokens = [token_text(t) for t, _ in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{token_text(a): alp for a, alp in alts} for _, (_, alts) in entries],
            "text_offset": offsets}


def choice(chat: bool, text: str, finish_reason: str | None, delta: bool, first: bool = False,
           token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
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
