"""Group-wise 4-bit weight-only quantisation (W4A16): format, quantiser, torch reference and Triton GEMM.

Format: weight [N, K] (nn.Linear layout) split along K into groups of ``group_size``; each group has one fp16
scale and, in zero-point mode, one fp16 zero point. Stored nibbles u are in [0, 15]:
- zero-point (asymmetric) mode: w ~= (u - zero) * scale;
- symmetric mode (zeros is None): w ~= (u - 8) * scale, i.e. q = u - 8 in [-8, 7].
``qweight`` is uint8 [N, K // 2]: the low nibble holds column 2j, the high nibble column 2j + 1.
Scales are rounded *up* to fp16 so the group range always fits, which makes |w - dequant(w)| <= scale / 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None
    _w4_launch = _w4a16_kernel = None

SYMMETRIC_OFFSET = 8  # stored nibble = q + 8 in symmetric mode
MAX_BLOCK_K = 64


@dataclass(frozen=True)
class QuantizedWeight:
    """A 4-bit weight of logical shape (N, K); see the module docstring for the layout."""

    qweight: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # fp16 [N, K // group_size]
    zeros: torch.Tensor | None  # fp16 [N, K // group_size], or None for symmetric
    group_size: int
    shape: tuple[int, int]

    def to(self, device: torch.device | str) -> QuantizedWeight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device), zeros, self.group_size, self.shape)


def _check_group(K: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"w4a16: group_size must be a positive even number, got {group_size}")
    if K % group_size:
        raise ValueError(f"w4a16: K={K} is not divisible by group_size={group_size}")


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= x for x >= 0 (so a rounded scale never shrinks the representable range)."""
    h = x.half()
    h = torch.where(h.float() < x, (h.view(torch.int16) + 1).view(torch.float16), h)
    if torch.isinf(h).any():
        raise ValueError("w4a16: weights too large for fp16 scales")
    return h


def quantize_w4(w: torch.Tensor, group_size: int = 128, zero_point: bool = True) -> QuantizedWeight:
    """Round-to-nearest 4-bit quantisation of w [N, K] with one scale (and zero point) per group along K."""
    if w.dim() != 2:
        raise ValueError(f"w4a16: weight must be [N, K], got {tuple(w.shape)}")
    N, K = w.shape
    _check_group(K, group_size)
    wg = w.float().reshape(N, K // group_size, group_size)
    lo = wg.amin(-1).clamp(max=0.0)  # the range always includes 0, so zero is exact
    hi = wg.amax(-1).clamp(min=0.0)
    scale = (hi - lo) / 15 if zero_point else torch.maximum(-lo / 8, hi / 7)
    scales = _round_up_fp16(torch.where(scale > 0, scale, torch.ones_like(scale)))  # all-zero group: any scale
    s = scales.float().unsqueeze(-1)
    if zero_point:
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
        u = (torch.round(wg / s) + zeros.unsqueeze(-1)).clamp(0, 15)
        zeros = zeros.half()
    else:
        zeros = None
        u = torch.round(wg / s).clamp(-8, 7) + SYMMETRIC_OFFSET
    u = u.reshape(N, K).to(torch.uint8)
    return QuantizedWeight(u[:, 0::2] | (u[:, 1::2] << 4), scales, zeros, group_size, (N, K))


def dequantize_w4(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] weight reconstructed from ``qw`` (computed in fp32, returned as ``dtype``)."""
    N, K = qw.shape
    u = torch.stack([qw.qweight & 0xF, qw.qweight >> 4], dim=-1).reshape(N, K // qw.group_size, qw.group_size)
    zero = SYMMETRIC_OFFSET if qw.zeros is None else qw.zeros.float().unsqueeze(-1)
    return ((u.float() - zero) * qw.scales.float().unsqueeze(-1)).reshape(N, K).to(dtype)


def _check_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] != qw.shape[1]:
        raise ValueError(f"w4a16_linear: x must be [M, K={qw.shape[1]}], got {tuple(x.shape)}")
    if bias is not None and bias.shape != (qw.shape[0],):
        raise ValueError(f"w4a16_linear: bias must be [N={qw.shape[0]}], got {tuple(bias.shape)}")
    _check_group(qw.shape[1], qw.group_size)


def w4a16_linear_torch(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qw).T (+ bias) -> [M, N] in x's dtype; dequantise then matmul in fp32 (the CPU path)."""
    _check_linear(x, qw, bias)
    out = x.float() @ dequantize_w4(qw).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


SPLIT_K_MAX_M = 16  # decode-shaped GEMMs (M <= this) split K when the N tiles leave the GPU's SMs idle
SPLIT_K_MAX = 8
DEQUANT_MIN_M = 256  # prefill-shaped GEMMs (M >= this): dequantise to 16 bit once, then cuBLAS
WARMUP_M = (1, 32, 64, DEQUANT_MIN_M)  # one M per compiled variant (BLOCK_M 16 / 32 / 64, the cuBLAS path)
W4_CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3))  # (BLOCK_N, num_warps, num_stages) to autotune


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


if triton is not None:

    @triton.jit(do_not_specialize=["M", "k_per_split"])
    def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_qn,
                      stride_sn, stride_om, stride_os, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                      HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """out[split] = x[:, K range of program_id(2)] @ dequant(w)^T. The weight is read as int32 words (eight
        nibbles, one load each), unpacked in registers: column 8i + j of a word row is bits 4j..4j+3."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rk = tl.arange(0, BLOCK_K)
        rw = tl.arange(0, BLOCK_K // 8)
        m_mask, n_mask = rm < M, rn < N
        shift = (tl.arange(0, 8) * 4)[None, :, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = split * k_per_split
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):  # BLOCK_K divides GROUP and K
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None],
                        other=0.0)
            words = tl.load(qw_ptr + rn[None, :].to(tl.int64) * stride_qn + (k0 // 8 + rw)[:, None],
                            mask=n_mask[None, :], other=0)  # int32 [BLOCK_K // 8, BLOCK_N]
            u = tl.reshape((words[:, None, :] >> shift) & 0xF, (BLOCK_K, BLOCK_N)).to(tl.float32)
            g = k0 // GROUP
            scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_ZERO:
                zero = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
            else:
                zero = tl.full((BLOCK_N,), 8.0, tl.float32)
            w = (u - zero[None, :]) * scale[None, :]
            if FP32_DOT:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(a.dtype), acc)  # A16: weights meet activations in 16 bit, fp32 accumulate
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + split.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on, GROUP: tl.constexpr,
                        HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        """out[N, K] = dequant(w) in out's dtype, one pass: each program unpacks a [BLOCK_N, 8 * BLOCK_W] tile."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        rk = tl.program_id(1) * BLOCK_W * 8 + tl.arange(0, BLOCK_W * 8)
        n_mask = (rn < N)[:, None]
        words = tl.load(qw_ptr + rn[:, None].to(tl.int64) * stride_qn + rw[None, :],
                        mask=n_mask & (rw < K // 8)[None, :], other=0)  # int32 [BLOCK_N, BLOCK_W]
        shift = (tl.arange(0, 8) * 4)[None, None, :]
        u = tl.reshape((words[:, :, None] >> shift) & 0xF, (BLOCK_N, BLOCK_W * 8)).to(tl.float32)
        mask = n_mask & (rk < K)[None, :]
        g = rn[:, None].to(tl.int64) * stride_sn + (rk // GROUP)[None, :]
        scale = tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + g, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = 8.0
        tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
                 ((u - zero) * scale).to(out_ptr.dtype.element_ty), mask=mask)

    _w4_launch = _w4a16_kernel
    if os.environ.get("TRITON_INTERPRET") != "1":
        _w4_launch = triton.autotune(
            [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in W4_CONFIGS],
            key=["N", "K", "GROUP", "BLOCK_M", "BLOCK_K", "HAS_ZERO", "HAS_BIAS", "FP32_DOT"],
        )(_w4a16_kernel)


def dequantize_w4_triton(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_w4` in one kernel pass (read 4 bits, write 16 per weight): the prefill path's cost before
    cuBLAS, where the torch version's half-dozen full-size temporaries cost more than the GEMM itself."""
    (N, K), block_n, block_w = qw.shape, 32, 16
    qweight = qw.qweight.contiguous().view(torch.int32)
    scales = qw.scales.contiguous()
    zeros = qw.zeros.contiguous() if qw.zeros is not None else scales
    out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    _dequant_kernel[(triton.cdiv(N, block_n), triton.cdiv(K // 8, block_w))](
        qweight, scales, zeros, out, N, K, qweight.stride(0), scales.stride(0), out.stride(0), GROUP=qw.group_size,
        HAS_ZERO=qw.zeros is not None, BLOCK_N=block_n, BLOCK_W=block_w)
    return out


def w4a16_linear_triton(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, *,
                        split_k: int | None = None) -> torch.Tensor:
    """Triton version of :func:`w4a16_linear_torch`: dequantises inside the GEMM (tiles over M, N, K). Decode
    shapes (M <= SPLIT_K_MAX_M) split K across programs when N alone fills few SMs (``split_k`` forces a
    count; the partial sums add up in fp32); prefill shapes (M >= DEQUANT_MIN_M) dequantise once and use cuBLAS."""
    _check_linear(x, qw, bias)
    block_k = min(MAX_BLOCK_K, qw.group_size & -qw.group_size)  # largest power of two dividing the group
    if block_k < 16:
        raise ValueError(f"w4a16_linear_triton: group_size must be a multiple of 16, got {qw.group_size}")
    x = x if x.stride(1) == 1 else x.contiguous()
    (M, K), N = x.shape, qw.shape[0]
    if M == 0:
        return torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M >= DEQUANT_MIN_M and split_k is None and x.dtype != torch.float32:
        return F.linear(x, dequantize_w4_triton(qw, x.dtype), bias)
    block_m = max(16, min(64, triton.next_power_of_2(M)))
    k_tiles = K // block_k
    if split_k is None:
        n_tiles = triton.cdiv(N, W4_CONFIGS[0][0])
        split_k = 1 if M > SPLIT_K_MAX_M else max(1, min(SPLIT_K_MAX, k_tiles, 2 * _num_sms(x.device) // n_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty partitions
    qweight = qw.qweight.contiguous().view(torch.int32)  # [N, K // 8]: K is a multiple of 16
    scales = qw.scales.contiguous()
    zeros = qw.zeros.contiguous() if qw.zeros is not None else scales  # placeholder pointer when symmetric
    out = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    has_bias = bias is not None and split_k == 1
    grid = lambda meta: (triton.cdiv(M, block_m), triton.cdiv(N, meta["BLOCK_N"]), split_k)  # noqa: E731
    launch = {} if _w4_launch is not _w4a16_kernel else {"BLOCK_N": W4_CONFIGS[0][0]}
    _w4_launch[grid](x, qweight, scales, zeros, bias if has_bias else out, out, M, N, K, k_per_split,
                     x.stride(0), qweight.stride(0), scales.stride(0), out.stride(1), out.stride(0),
                     GROUP=qw.group_size, HAS_ZERO=qw.zeros is not None, HAS_BIAS=has_bias,
                     FP32_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_K=block_k, **launch)
    if split_k == 1:
        return out[0]
    out = out.sum(0)
    return (out if bias is None else out + bias.float()).to(x.dtype)
