"""The engine's ``core.interfaces.KVTransport``: real copies of KV blocks between two replicas' KV tensors."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.runner import ModelRunner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchKVTransport:
    """Copies a request's blocks from one replica's KV tensors to another's, every layer's K and V (and int8
    scales), in this process: a gather and a scatter per tensor, device to device on a GPU. Returns the copy's
    time on ``stopwatch`` (the engine's step clock), synchronised on both devices, as the transfer's duration."""

    def __init__(self, runners: Sequence[ModelRunner], stopwatch: Callable[[], float] = time.perf_counter) -> None:
        self.runners = list(runners)
        self.stopwatch = stopwatch

    def transfer(self, src: int, dst: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                 num_tokens: int) -> float:
        a, b = self.runners[src], self.runners[dst]
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"transfer of {len(src_blocks)} blocks into {len(dst_blocks)}")
        _sync(a.device)
        _sync(b.device)
        t0 = self.stopwatch()
        with torch.inference_mode():
            si = torch.tensor(src_blocks, dtype=torch.long, device=a.device)
            di = torch.tensor(dst_blocks, dtype=torch.long, device=b.device)
            for s, d in zip(a.kv_caches, b.kv_caches, strict=True):
                for x, y in ((s.k, d.k), (s.v, d.v), (s.k_scale, d.k_scale), (s.v_scale, d.v_scale)):
                    if x is not None:
                        y.index_copy_(0, di, x.index_select(0, si).to(b.device, non_blocking=True))
        _sync(a.device)
        _sync(b.device)
        return self.stopwatch() - t0
