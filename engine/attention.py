"""Paged attention for one flattened varlen step: the step's metadata and the per-layer KV cache tensors.

How many blocks a memory budget holds is ``core.arithmetic.num_blocks_for_memory`` (its bytes per block are
these tensors' bytes; tests/core/test_arithmetic.py checks that against ``allocate_kv_caches``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core import arithmetic
from core.checks import check_choice
from core.specs import ModelSpec
from kernels.attention import AttentionPlan

KV_DTYPES = tuple(arithmetic.KV_DTYPE_BITS)  # "auto" (the model dtype), "int8"
INT8_SCALE_DTYPE = torch.float32  # one scale per (slot, kv head), as kernels.kv_store writes them
assert INT8_SCALE_DTYPE.itemsize == arithmetic.KV_INT8_SCALE_BYTES, "core.arithmetic must count the scales stored"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (S sequences, T tokens, all on the model's device)."""

    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token's K/V
    query_start_loc: torch.Tensor  # int32 [S + 1]: offsets of each sequence's tokens in the flat batch
    seq_lens: torch.Tensor  # int32 [S]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    max_query_len: int
    max_seq_len: int
    plan: AttentionPlan | None = None  # torch backend: the step's attention split, shared by every layer


@dataclass(frozen=True, slots=True)
class KVCache:
    """One layer's paged K/V: [num_blocks, block_size, Hkv, D]; int8 caches carry per-slot scales."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # float32 [num_blocks, block_size, Hkv] when int8
    v_scale: torch.Tensor | None = None


def paged_attention(kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's k, v [T, Hkv, D] in the cache, then attend q [T, H, D] over the cached context."""
    kernels.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    # the host-side maxima spare the Triton kernel a device-to-host sync per layer
    extra = {} if meta.plan is None else {"plan": meta.plan, "k": k, "v": v}
    return kernels.attention(q, cache.k, cache.v, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                             cache.k_scale, cache.v_scale, max_query_len=meta.max_query_len,
                             max_seq_len=meta.max_seq_len, **extra)


def allocate_kv_caches(spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str, kv_dtype: str = "auto",
                       num_kv_heads: int | None = None) -> list[KVCache]:
    """One KVCache per layer, uninitialised: a slot is always written before attention reads it.
    ``num_kv_heads``: the heads this rank holds (tensor parallelism), default the model's."""
    check_choice(kv_dtype, "kv_dtype", KV_DTYPES)
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
    shape = (num_blocks, block_size, num_kv_heads or spec.num_kv_heads, spec.head_dim)
    int8 = kv_dtype == "int8"
    caches = []
    for _ in range(spec.num_layers):
        k, v = (torch.empty(shape, dtype=torch.int8 if int8 else dtype, device=device) for _ in range(2))
        scales = [torch.empty(shape[:3], dtype=INT8_SCALE_DTYPE, device=device) for _ in range(2)] if int8 else []
        caches.append(KVCache(k, v, *scales))
    return caches
