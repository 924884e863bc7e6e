"""Grouped GEMM for Mixture-of-Experts layers: every expert's routed rows times that expert's weight, in one call.

Layout: x [T, K] holds the routed rows sorted by expert; ``expert_offsets`` int32 [E + 1] gives expert e the rows
``offsets[e]:offsets[e + 1]`` (offsets[0] = 0, non-decreasing, offsets[E] = T; an expert may have none); w
[E, N, K] stacks the experts' weights, each in nn.Linear layout. Output y [T, N] in x's dtype:
y[r] = x[r] @ w[e(r)].T, where e(r) is the expert whose segment holds row r.
With ``silu_and_mul=True`` w is the gate_up projection [E, 2F, K] (each expert's F gate rows, then its F up rows,
the layout silu_and_mul takes) and y [T, F] = silu(x @ gate.T) * (x @ up.T): the SwiGLU activation in the GEMM's
epilogue, which saves writing and re-reading the [T, 2F] intermediate.

Routing: :func:`route_tokens` turns the router's top-k expert ids into that order (which token each sorted row
is, the offsets, and the inverse that finds each (token, choice) pair's row); :meth:`MoERouting.permute` gathers
the sorted rows and :meth:`MoERouting.combine` sums each token's top-k outputs with the router weights. An expert
MLP (``ks`` a KernelSet, x [num_tokens, hidden], w13 [E, 2F, hidden], w2 [E, hidden, F]):

    route = route_tokens(topk_ids, E)
    h = ks.grouped_gemm(route.permute(x), route.expert_offsets, w13, True)  # [num_tokens * top_k, F]
    out = route.combine(ks.grouped_gemm(h, route.expert_offsets, w2), topk_weights)  # [num_tokens, hidden]
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from kernels.activation import silu_and_mul_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


@dataclass(frozen=True)
class MoERouting:
    """One batch's (token, choice) pairs in expert order: sorted row r is token ``token_ids[r]``, and the pair
    (t, j) of ``topk_ids`` sits at sorted row ``inverse[t, j]``."""

    token_ids: torch.Tensor  # int64 [num_tokens * top_k]; within one expert's segment, tokens in ascending order
    expert_offsets: torch.Tensor  # int32 [E + 1], as grouped_gemm takes them
    inverse: torch.Tensor  # int64 [num_tokens, top_k]

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states x [num_tokens, K] -> the grouped GEMM's input [num_tokens * top_k, K] (one row per pair)."""
        return x.index_select(0, self.token_ids)

    def combine(self, y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sorted expert outputs y [num_tokens * top_k, N] -> [num_tokens, N]: out[t] = sum over j of
        topk_weights[t, j] * y[inverse[t, j]]. A gather and one [1, top_k] x [top_k, N] product per token, which
        is deterministic, unlike a scatter-add (atomics on GPU). The weights are cast to y's dtype."""
        num_tokens, top_k = self.inverse.shape
        rows = y.index_select(0, self.inverse.flatten()).view(num_tokens, top_k, y.shape[1])
        return torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def route_tokens(topk_ids: torch.Tensor, num_experts: int) -> MoERouting:
    """The expert order for the router's choices ``topk_ids`` [num_tokens, top_k] (ids in [0, num_experts)).
    Torch ops that never wait for the device, so a CUDA graph can hold them: a stable sort of the flattened ids,
    the offsets by a binary search of the sorted ids for each expert id, the inverse by one scatter."""
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"route_tokens: topk_ids must be [num_tokens, top_k >= 1], got {tuple(topk_ids.shape)}")
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    bounds = torch.arange(num_experts + 1, device=topk_ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)  # offsets[e] = number of ids below e
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return MoERouting(order // topk_ids.shape[1], offsets, inverse.view(topk_ids.shape))


def _check_grouped(x: torch.Tensor, expert_offsets: torch.Tensor, w: torch.Tensor, silu_and_mul: bool) -> int:
    """Validate shapes and dtypes (not the offsets' values: on GPU that would wait for the device); return y's
    width."""
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_gemm: need x [T, K] and w [E, N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if expert_offsets.shape != (w.shape[0] + 1,) or expert_offsets.dtype != torch.int32:
        raise ValueError(f"grouped_gemm: expert_offsets must be int32 [E + 1 = {w.shape[0] + 1}], got "
                         f"{expert_offsets.dtype} {tuple(expert_offsets.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_gemm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if silu_and_mul and w.shape[1] % 2:
        raise ValueError(f"grouped_gemm: silu_and_mul needs w [E, 2F, K], got N={w.shape[1]}")
    return w.shape[1] // 2 if silu_and_mul else w.shape[1]


def grouped_gemm_torch(x: torch.Tensor, expert_offsets: torch.Tensor, w: torch.Tensor,
                       silu_and_mul: bool = False) -> torch.Tensor:
    """y [T, N] = x[r] @ w[e(r)].T per row (see the module docstring), [T, F] with ``silu_and_mul``: one matmul
    per non-empty expert over its contiguous rows, in x's dtype (the CPU path; on GPU a loop of cuBLAS calls after
    reading the offsets back to the host)."""
    _check_grouped(x, expert_offsets, w, silu_and_mul)
    bounds = expert_offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(lo > hi for lo, hi in itertools.pairwise(bounds)):
        raise ValueError(f"grouped_gemm: expert_offsets must rise from 0 to T={x.shape[0]}, got {bounds}")
    y = x.new_empty((x.shape[0], w.shape[1]))
    for e, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        if hi > lo:
            torch.mm(x[lo:hi], w[e].T, out=y[lo:hi])
    return silu_and_mul_torch(y) if silu_and_mul else y


# Rows per tile: the average rows per expert (T / E) rounded up to a power of two, within [16, MAX_BLOCK_M]. 16 is
# tl.dot's smallest M; decode batches give most experts a row or two, so a bigger tile would be mostly masked.
# Prefill segments hold hundreds of rows; 64 keeps the masked part of each segment's last tile small (half a tile
# per expert on average), and bench_gpu times 128 next to it at the prefill shapes.
MAX_BLOCK_M = 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages) to autotune on a GPU; the interpreter runs the first. Decode tiles read
# weights once (memory-bound: the deeper K tile and pipeline); prefill tiles are compute-bound (wide N, 8 warps).
GG_CONFIGS = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 4))

if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, off_ptr, y_ptr, E, N, K, stride_xm, stride_we, stride_wn, stride_ym,
                             SILU: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of y (N: y's width). Program p computes N tile p % n_tiles of row tile
        p // n_tiles, row tiles counted through the experts' segments in order; programs past the last tile
        return at once. N tiles run fastest, so the programs in flight together cover a few experts' row tiles
        whole: each x tile is read from memory once, each expert's weights once per wave (L2 serves the rest)."""
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        tile, pid_n = pid // n_tiles, pid % n_tiles
        # The expert owning row tile `tile`: each program reads the E + 1 offsets (a few hundred bytes, L2 hits),
        # counts every expert's row tiles and takes the first expert whose tiles end past `tile`. Padding lanes
        # (>= E) add no tiles, so past the last tile the count reaches BLOCK_E >= E.
        re = tl.arange(0, BLOCK_E)
        lo = tl.load(off_ptr + re, mask=re < E, other=0)
        hi = tl.load(off_ptr + re + 1, mask=re < E, other=0)
        tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(tiles, 0)
        expert = tl.sum((ends <= tile).to(tl.int32), 0)
        if expert >= E:
            return
        mine = re == expert
        first_tile = tl.sum(tl.where(mine, ends - tiles, 0), 0)
        row_end = tl.sum(tl.where(mine, hi, 0), 0)
        rm = tl.sum(tl.where(mine, lo, 0), 0) + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask, n_mask = rm < row_end, rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        w_cols = w_expert + rn[None, :].to(tl.int64) * stride_wn  # [1, BLOCK_N]: a [BLOCK_K, BLOCK_N] tile of w[e].T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SILU:  # the up rows sit N (= F) rows below the gate rows
            up_cols = w_expert + (rn + N)[None, :].to(tl.int64) * stride_wn
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = rk < K - k0
            a = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            b = tl.load(w_cols + (k0 + rk)[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if SILU:
                b = tl.load(up_cols + (k0 + rk)[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(a, b, acc_up, input_precision=DOT_PRECISION)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    _AUTOTUNE = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter runs the first config
    _gg_launch = _grouped_gemm_kernel
    if _AUTOTUNE:
        _gg_launch = triton.autotune(
            [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in GG_CONFIGS],
            key=["N", "K", "BLOCK_E", "BLOCK_M", "SILU", "DOT_PRECISION"],
        )(_grouped_gemm_kernel)


def grouped_gemm_triton(x: torch.Tensor, expert_offsets: torch.Tensor, w: torch.Tensor, silu_and_mul: bool = False,
                        *, block_m: int | None = None) -> torch.Tensor:
    """Triton version of :func:`grouped_gemm_torch`: one launch, fp32 accumulation, any of fp16 / bf16 / fp32
    (fp32 multiplies in full precision, not tf32). Nothing waits for the device, so a CUDA graph can hold it; the
    autotuner benchmarks on the first call per (N, K, E, BLOCK_M, dtype), which must come before capture. x and w
    must be on one device with the offsets; w not contiguous along K is copied on every call.

    Programs map to (expert, row tile) inside the kernel, from the offsets, rather than through a tile table: a
    table needs the tile count on the host (a device-to-host wait) or a worst-case-sized table built by a few more
    small kernels, each costing at decode about what the GEMM does. The grid is sized by a bound instead: expert e
    has ceil(n_e / BLOCK_M) row tiles, at most n_e // BLOCK_M + 1 when n_e > 0, so all of them take at most
    T // BLOCK_M + min(E, T); the spare programs return at once. ``block_m`` forces the rows per tile (a power of
    two >= 16; tuning data), else the average rows per expert decides it (see MAX_BLOCK_M)."""
    n_out = _check_grouped(x, expert_offsets, w, silu_and_mul)
    if not x.device == w.device == expert_offsets.device:
        raise ValueError(f"grouped_gemm_triton: x, expert_offsets and w must share a device, got {x.device}, "
                         f"{expert_offsets.device} and {w.device}")
    (T, K), E = x.shape, w.shape[0]
    y = torch.empty((T, n_out), dtype=x.dtype, device=x.device)
    if T == 0 or n_out == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    if block_m is None:
        block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(triton.cdiv(T, E))))
    row_tiles = T // block_m + min(E, T)
    grid = lambda meta: (row_tiles * triton.cdiv(n_out, meta["BLOCK_N"]),)  # noqa: E731
    fixed = {} if _AUTOTUNE else {"BLOCK_N": GG_CONFIGS[0][0], "BLOCK_K": GG_CONFIGS[0][1]}
    _gg_launch[grid](x, w, expert_offsets.contiguous(), y, E, n_out, K, x.stride(0), w.stride(0), w.stride(1),
                     y.stride(0), SILU=silu_and_mul, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                     BLOCK_E=triton.next_power_of_2(E), BLOCK_M=block_m, **fixed)
    return y
