"""Prompt content: chained block hashes for the prefix cache, and deterministic token materialisation.

A block's identity is the tokens fed to the model plus extra keys (the tenant / cache salt), chained
through the parent block's hash, so equal hashes mean equal prefixes. Requests that carry Mooncake-style
``hash_ids`` (each id = ``tokens_per_hash_id`` fixed pseudo-random tokens) are hashed by the ids that cover
each block, which gives exactly the sharing their materialised tokens would give, without building
the tokens (the simulator never needs them; the engine calls ``materialize``).

Hashes use Python's tuple hash of ints, which does not depend on PYTHONHASHSEED, so runs are
reproducible; the tenant string goes in through a 64-bit blake2b digest for the same reason.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import numpy as np

from core.request import Request

_UNIQUE = -1  # marker mixed into hashes of requests whose content is private to them


def _salt(request: Request) -> int:
    if not request.tenant:
        return 0
    return int.from_bytes(hashlib.blake2b(request.tenant.encode(), digest_size=8).digest(), "little")


def _prompt_key(request: Request, index: int, lo: int, hi: int) -> object:
    """The content of prompt tokens [lo, hi) of block ``index``, as a block hash key: the token ids themselves, the
    (hash_id, start, end) pieces of every content block they overlap, or the block's index (private content)."""
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids[lo:hi]
    if request.hash_ids is not None:
        hb = request.tokens_per_hash_id
        return tuple((request.hash_ids[j], max(lo, j * hb) - j * hb, min(hi, (j + 1) * hb) - j * hb)
                     for j in range(lo // hb, (hi - 1) // hb + 1))
    return index


def _root(request: Request, block_size: int) -> int:
    """The hash every chain of this request's blocks starts from: the salt, and the request's id if its content is
    private to it."""
    parent = hash((_salt(request), block_size))
    if request.prompt_token_ids is None and request.hash_ids is None:
        parent = hash((parent, _UNIQUE, request.id))
    return parent


def block_hashes(request: Request, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached)."""
    out: list[int] = []
    parent = _root(request, block_size)
    for i in range(request.prompt_len // block_size):
        parent = hash((parent, _prompt_key(request, i, i * block_size, (i + 1) * block_size)))
        out.append(parent)
    return out


def extend_block_hashes(request: Request, hashes: list[int], output_ids: Sequence[int], block_size: int,
                        num_blocks: int) -> None:
    """Append to ``hashes`` (the chained hashes of the request's first blocks, at least its full prompt blocks) those
    of its next full blocks of prompt + output tokens, up to ``num_blocks`` blocks in all or as many as are full.
    A block past the prompt's full ones is keyed by its prompt tail (if any) and its output tokens: vLLM's prefix
    cache holds generated tokens' blocks too (``KVCacheManager``'s ``vllm`` mode). With token ids the key is the
    block's tokens, whichever side they come from, so a later prompt that repeats prompt + outputs (the next turn of
    a chat) hits these blocks, as in vLLM."""
    prompt_len = request.prompt_len
    num_blocks = min(num_blocks, (prompt_len + len(output_ids)) // block_size)
    parent = hashes[-1] if hashes else _root(request, block_size)
    for i in range(len(hashes), num_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        head = _prompt_key(request, i, lo, prompt_len) if lo < prompt_len else ()
        tail = tuple(output_ids[max(lo, prompt_len) - prompt_len:hi - prompt_len])
        parent = hash((parent, head + tail if request.prompt_token_ids is not None else (head, tail)))
        hashes.append(parent)


def content_block(hash_id: int, size: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """The fixed pseudo-random tokens a content hash id stands for."""
    rng = np.random.default_rng([seed, 0x7A1C, hash_id & 0xFFFFFFFFFFFF])
    return rng.integers(0, vocab_size, size, dtype=np.int64)


def materialize(request: Request, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids to feed the model: the given ids, the hash-id blocks, or tokens private to this request."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.hash_ids is not None:
        hb = request.tokens_per_hash_id
        n_ids = -(-request.prompt_len // hb)
        parts = [content_block(h, hb, vocab_size, seed) for h in request.hash_ids[:n_ids]]
        return np.concatenate(parts)[:request.prompt_len].tolist()
    rng = np.random.default_rng([seed, 0x5EED, zlib.crc32(request.id.encode())])
    return rng.integers(0, vocab_size, request.prompt_len, dtype=np.int64).tolist()
