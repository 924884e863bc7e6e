"""CUDA graphs for decode-only steps (``backend.cuda_graphs``).

A decode step of an 8B model launches a few hundred small kernels; without graphs the host's launch time, not the
GPU, sets the step time (first gpu-check, H200: ~15 ms per decode step at batch 1 to 64 against a 3-5 ms
bandwidth bound). Each batch-size bucket's forward pass (embedding, layers, final norm, LM head) is captured once
over static input buffers; a decode-only step copies its inputs into the buffers of the smallest bucket that
holds it and replays that graph. Padding rows write no KV (slot -1, which the KV store skips) and attend over one
token of a block they never change; their logits are dropped. Sampling stays outside the graph.

The attention's launch settings are fixed at capture: its split-K choice is made for ``max_seq_len`` = the
model's whole context (the kernel sizes each split from the sequence's actual length, so shorter contexts only
leave some splits with less work).
"""

from __future__ import annotations

import bisect

import torch

from engine.attention import AttentionMetadata, KVCache
from engine.model import LlamaForCausalLM
from kernels.ops import KernelSet

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """One captured decode forward per batch-size bucket, sharing one memory pool and one set of static inputs."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], kernels: KernelSet, block_size: int,
                 max_batch: int = BATCH_BUCKETS[-1]) -> None:
        self.model, self.kv_caches, self.kernels = model, kv_caches, kernels
        self.buckets = [b for b in BATCH_BUCKETS if b <= max_batch] or [1]
        self.max_seq_len = model.cos_sin.shape[0]
        dev, n = model.device, self.buckets[-1]
        blocks_per_seq = -(-self.max_seq_len // block_size)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=dev)
        self.positions = torch.zeros(n, dtype=i64, device=dev)
        self.slots = torch.full((n,), -1, dtype=i64, device=dev)
        self.seq_lens = torch.ones(n, dtype=i32, device=dev)
        self.tables = torch.zeros(n, blocks_per_seq, dtype=i32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=i32, device=dev)  # one query token per sequence
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:b], self.query_start[:b + 1], self.seq_lens[:b], self.tables[:b], 1,
                                 self.max_seq_len)
        hidden = self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_caches, self.kernels)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs then fit in the pool the largest reserved).
        Each bucket runs once eagerly first, so Triton compiles and autotunes outside the capture."""
        pool = None
        for b in reversed(self.buckets):
            self._forward(b)
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.model.device)

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_blocks <= self.tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B sequences (one token each, in batch order). The tensor is a
        view of the graph's output: read it before the next replay."""
        n = input_ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # padding rows: skip the KV write, attend over one token
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][:n]
