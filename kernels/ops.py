"""Backend registry: one KernelSet of same-signature ops per backend: "torch" (the references), "native" (RMSNorm,
RoPE, SiLU-and-mul, the KV store and decode attention in C on fp32 CPU tensors, kernels.cpu_native, the rest (W4A16,
the MoE grouped GEMM) the references: the CPU engine's default) or "triton" (GPU kernels)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BACKENDS = ("torch", "native", "triton")
CPU_GEMMS = ("auto", "native")  # fp32 CPU GEMMs (kernels.cpu_gemm): the faster kernel per row count | native only


@dataclass(frozen=True)
class KernelSet:
    """The ops the engine's model calls; every backend fills every field with the same signatures."""

    rms_norm: Callable
    rope: Callable
    silu_and_mul: Callable
    store_kv: Callable
    attention: Callable
    w4a16_linear: Callable
    grouped_gemm: Callable  # MoE experts: (x [T, K] sorted by expert, int32 offsets [E + 1], w [E, N, K], silu_and_mul)


def get_kernels(backend: str) -> KernelSet:
    """KernelSet for ``backend`` in BACKENDS. Imports are lazy so the torch path never needs triton."""
    if backend in ("torch", "native"):
        from kernels.activation import silu_and_mul_torch
        from kernels.attention import paged_attention_torch
        from kernels.grouped_gemm import grouped_gemm_torch
        from kernels.kv_store import store_kv_torch
        from kernels.norm import rms_norm_torch
        from kernels.rope import rope_torch
        from kernels.w4a16 import w4a16_linear_torch

        if backend == "native":
            from kernels import cpu_native as c

            return KernelSet(c.rms_norm_native, c.rope_native, c.silu_and_mul_native, c.store_kv_native,
                             c.paged_attention_native, w4a16_linear_torch, grouped_gemm_torch)
        return KernelSet(rms_norm_torch, rope_torch, silu_and_mul_torch, store_kv_torch, paged_attention_torch,
                         w4a16_linear_torch, grouped_gemm_torch)
    if backend == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError("kernel backend 'triton' needs the triton package (pip install triton)") from e
        from kernels.activation import silu_and_mul_triton
        from kernels.attention import paged_attention_triton
        from kernels.grouped_gemm import grouped_gemm_triton
        from kernels.kv_store import store_kv_triton
        from kernels.norm import rms_norm_triton
        from kernels.rope import rope_triton
        from kernels.w4a16 import w4a16_linear_triton

        return KernelSet(rms_norm_triton, rope_triton, silu_and_mul_triton, store_kv_triton, paged_attention_triton,
                         w4a16_linear_triton, grouped_gemm_triton)
    raise ValueError(f"unknown kernel backend {backend!r}; allowed: {', '.join(BACKENDS)}")
