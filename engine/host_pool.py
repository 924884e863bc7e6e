"""The engine's host KV tier: host tensors shaped like the runner's KV caches, and the step's block copies.

Host block ids are the ``core.host_tier.HostTier``'s, device block ids the ``KVCacheManager``'s, as everywhere in
the engine. Copies run in the order the step lists them (``core.batch.BlockCopy``), before the forward pass.
On CPU the host pool is a second set of CPU tensors (the code path of a GPU engine, with memcpy as the link); on
CUDA it is pinned memory and every copy is asynchronous on the current stream, which orders them before the
forward pass that follows (vLLM's ``swap_blocks`` does the same, one ``cudaMemcpyAsync`` per block and tensor).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from core.batch import BlockCopy
from engine.attention import KVCache


def _tensors(cache: KVCache) -> list[torch.Tensor]:
    return [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]


def _segments(copies: Sequence[BlockCopy]) -> Iterator[tuple[bool, list[int], list[int]]]:
    """Consecutive copies of one direction as (to_host, source blocks, destination blocks), split wherever a
    destination repeats: each segment is one gather / scatter with distinct destinations, and segments run in
    order, so the result is that of the copies one by one."""
    to_host, src, dst, seen = None, [], [], set()
    for c in copies:
        s, d = (c.device_block, c.host_block) if c.to_host else (c.host_block, c.device_block)
        if c.to_host != to_host or d in seen:
            if src:
                yield to_host, src, dst
            to_host, src, dst, seen = c.to_host, [], [], set()
        src.append(s)
        dst.append(d)
        seen.add(d)
    if src:
        yield to_host, src, dst


class HostKVPool:
    """``num_blocks`` host blocks for every layer's K/V (and int8 scales) of ``caches``."""

    def __init__(self, caches: list[KVCache], num_blocks: int) -> None:
        device = caches[0].k.device
        pin = device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)

        self.device = device
        self.pairs = [(t, host(t)) for cache in caches for t in _tensors(cache)]  # (device tensor, host tensor)
        self.bytes_per_block = sum(h[0].numel() * h.element_size() for _, h in self.pairs)

    def apply(self, copies: Sequence[BlockCopy]) -> None:
        """Perform ``copies`` in order (device -> host for swap-out / spill, host -> device for swap-in / load)."""
        for to_host, src, dst in _segments(copies):
            if self.device.type == "cpu":
                s, d = torch.tensor(src), torch.tensor(dst)
                for dev, host in self.pairs:
                    a, b = (dev, host) if to_host else (host, dev)
                    b.index_copy_(0, d, a.index_select(0, s))
            else:
                for dev, host in self.pairs:
                    a, b = (dev, host) if to_host else (host, dev)
                    for i, j in zip(src, dst, strict=True):
                        b[j].copy_(a[i], non_blocking=True)
