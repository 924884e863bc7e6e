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

import numpy as np

from core.request import Request

_UNIQUE = -1  # marker mixed into hashes of requests whose content is private to them


def _salt(request: Request) -> int:
    if not request.tenant:
        return 0
    return int.from_bytes(hashlib.blake2b(request.tenant.encode(), digest_size=8).digest(), "little")


def block_hashes(request: Request, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached)."""
    n_full = request.prompt_len // block_size
    salt = _salt(request)
    out: list[int] = []
    parent = hash((salt, block_size))
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids
        for i in range(n_full):
            parent = hash((parent, ids[i * block_size:(i + 1) * block_size]))
            out.append(parent)
    elif request.hash_ids is not None:
        hb = request.tokens_per_hash_id
        for i in range(n_full):
            lo, hi = i * block_size, (i + 1) * block_size
            # (hash_id, start, end) for every content block this KV block overlaps
            key = tuple((request.hash_ids[j], max(lo, j * hb) - j * hb, min(hi, (j + 1) * hb) - j * hb)
                        for j in range(lo // hb, (hi - 1) // hb + 1))
            parent = hash((parent, key))
            out.append(parent)
    else:
        parent = hash((parent, _UNIQUE, request.id))
        for i in range(n_full):
            parent = hash((parent, i))
            out.append(parent)
    return out


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
