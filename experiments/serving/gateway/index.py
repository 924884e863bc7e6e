"""What the gateway knows of each backend's prefix cache: the chained block hashes of the prompts it sent there.

A prompt becomes a sequence of *keys*: its token ids when it comes as ids, or when the backend's tokenizer is
available (``BackendSpec.tokenizer`` / ``gateway.tokenizer``: text through ``encode``, messages through the chat
template). Without a tokenizer, text is cut into pieces of ``CHARS_PER_TOKEN`` characters (OpenAI's rule of thumb
of ~4 characters per token), each piece one key (its CRC-32): the *character proxy*. Equal text prefixes give equal
key prefixes in both cases, so the sharing the backend sees is seen here too, at block granularity: keys are hashed
``block_size`` at a time, chained (``core.prompt.block_hashes``, the simulator's own hashing), full blocks only.

Each backend's index maps a block hash to the time it was last sent there, oldest first. It forgets blocks the
backend has likely evicted: beyond ``capacity`` blocks (the backend's KV pool, when known) the least recently sent
go, and any block sent more than ``max_age_s`` ago.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from core.prompt import block_hashes
from core.request import Request

CHARS_PER_TOKEN = 4


def proxy_keys(text: str) -> tuple[int, ...]:
    """The character proxy: one key per ``CHARS_PER_TOKEN`` characters."""
    return tuple(zlib.crc32(text[i:i + CHARS_PER_TOKEN].encode()) for i in range(0, len(text), CHARS_PER_TOKEN))


def messages_text(messages: Sequence[Any]) -> str:
    """Chat messages as one string (role and content of each, in order) for the character proxy."""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else json.dumps(content)}")
    return "\n".join(parts)


def prompt_keys(body: Mapping[str, Any], chat: bool, tokenizer: Any | None) -> tuple[int, ...]:
    """The keys of a request body's prompt (empty when it has none the gateway can read: the backend decides)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ()
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                return tuple(int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"]))
            except Exception:  # noqa: BLE001 - a template that rejects these messages: the backend will say why
                pass
        return proxy_keys(messages_text(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt)) if tokenizer is not None else proxy_keys(prompt)
    return ()


def key_hashes(keys: tuple[int, ...], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``keys``."""
    if not keys:
        return []
    return block_hashes(Request("gateway", 0.0, len(keys), 1, prompt_token_ids=keys), block_size)


class PrefixIndex:
    """One backend's blocks as the gateway sent them: hash -> last time sent, least recently sent first."""

    def __init__(self, capacity: int, max_age_s: float) -> None:
        self.capacity, self.max_age_s = capacity, max_age_s
        self._sent: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def expire(self, now: float) -> None:
        sent = self._sent
        while sent and (len(sent) > self.capacity or next(iter(sent.values())) < now - self.max_age_s):
            sent.popitem(last=False)

    def match(self, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of ``hashes`` this backend holds (as far as the gateway knows)."""
        self.expire(now)
        n = 0
        for h in hashes:
            if h not in self._sent:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int], now: float) -> None:
        """The prompt with these blocks was sent now: all of them are the most recently used."""
        for h in hashes:
            self._sent[h] = now
            self._sent.move_to_end(h)
        self.expire(now)
