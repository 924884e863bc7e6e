"""Group-wise 4-bit weight-only quantisation (W4A16): format, quantiser, torch reference, Triton GEMV and GEMM.

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
# M <= this runs the dot-free GEMV. Its fp32 work per weight is M FMAs next to ~5 ops to dequantise it, so it grows
# with M (M = 8: ~2x that of M = 1; M = 16: ~3.5x), while tl.dot's 16-row MMA tile costs the same for any M <= 16
# and is at least half idle only up to M = 8. bench_gpu times both paths at M = 1 and 16 to check the cut.
GEMV_MAX_M = 8
GEMV_MAX_BLOCK_K = 256
GEMV_PRODUCTS_PER_THREAD = 64  # fp32 values of the GEMV's [BLOCK_M, BLOCK_N, BLOCK_K] product per thread (registers)
# One M per compiled variant: GEMV BLOCK_M 1 / 2 / 4 / 8 (M = 1, 2, 3-4, 5-8), GEMM BLOCK_M 16 with split-K
# (M = 9-16), 32 and 64 without (17-32, 33-255), the cuBLAS path (M >= DEQUANT_MIN_M).
WARMUP_M = (1, 2, 4, 8, 16, 32, 64, DEQUANT_MIN_M)
W4_CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (128, 8, 3))  # (BLOCK_N, num_warps, num_stages) to autotune
# (BLOCK_N, BLOCK_K, num_warps, num_stages) to autotune the GEMV, each cut to the launch by _fit_gemv: wide K tiles
# over few columns, and one narrower K tile over more (group 128 cuts every 256 to 128)
GEMV_CONFIGS = ((32, 256, 4, 3), (16, 256, 4, 4), (64, 256, 8, 3), (64, 64, 4, 4))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _gemv_block_k(group: int) -> int:
    """The GEMV's widest K tile: the largest power of two dividing the group, at most GEMV_MAX_BLOCK_K. Split-K
    partitions are whole multiples of it, so any narrower power-of-two tile a config picks divides them too."""
    return min(GEMV_MAX_BLOCK_K, group & -group)


def _fit_gemv(block_m: int, group: int) -> list[tuple[int, int, int, int]]:
    """GEMV_CONFIGS cut to one launch, order kept, duplicates dropped: BLOCK_K to :func:`_gemv_block_k`, then
    BLOCK_N so that a thread holds at most GEMV_PRODUCTS_PER_THREAD values of the product (>= 2 for M <= 16)."""
    k_unit = _gemv_block_k(group)
    cut = [(n, min(k, k_unit), warps, stages) for n, k, warps, stages in GEMV_CONFIGS]
    return list(dict.fromkeys((min(n, GEMV_PRODUCTS_PER_THREAD * 32 * warps // (block_m * k)), k, warps, stages)
                              for n, k, warps, stages in cut))


def _split_k(K: int, k_unit: int, n_tiles: int, device: torch.device, split_k: int | None) -> tuple[int, int]:
    """(splits, K per split): ``split_k`` if given, else enough K partitions that the N tiles make two programs
    per SM (at most SPLIT_K_MAX). A partition is whole ``k_unit`` tiles and none is empty."""
    k_tiles = K // k_unit
    if split_k is None:
        split_k = max(1, min(SPLIT_K_MAX, k_tiles, 2 * _num_sms(device) // n_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * k_unit
    return triton.cdiv(K, k_per_split), k_per_split


if triton is not None:

    @triton.jit
    def _w4_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, stride_qn, stride_sn, GROUP: tl.constexpr,
                 HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
        """dequant(w)[rn, k0 : k0 + BLOCK_K]^T, fp32 [BLOCK_K, BLOCK_N] (BLOCK_K divides GROUP: one scale per
        column). The weight is read as int32 words (eight nibbles, one load each), unpacked in registers: column
        8i + j of a word row is bits 4j..4j+3. ALIGNED tells the compiler k0 is a multiple of BLOCK_K, which
        allows 16-byte weight loads (the GEMM does not pass it yet: its loads would change, unmeasured)."""
        kw = k0 // 8
        if ALIGNED:
            kw = tl.multiple_of(kw, BLOCK_K // 8)
        rw = tl.arange(0, BLOCK_K // 8)
        shift = (tl.arange(0, 8) * 4)[None, :, None]
        words = tl.load(qw_ptr + rn[None, :].to(tl.int64) * stride_qn + (kw + rw)[:, None],
                        mask=n_mask[None, :], other=0)  # int32 [BLOCK_K // 8, BLOCK_N]
        u = tl.reshape((words[:, None, :] >> shift) & 0xF, (BLOCK_K, BLOCK_N)).to(tl.float32)
        g = k0 // GROUP
        scale = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + rn * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 8.0, tl.float32)
        return (u - zero[None, :]) * scale[None, :]

    @triton.jit
    def _store_split(acc, b_ptr, out_ptr, rm, rn, m_mask, n_mask, split, stride_om, stride_os,
                     HAS_BIAS: tl.constexpr):
        """out[split, rm, rn] = acc (+ bias, which the launcher asks for only when there is one split)."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + split.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit(do_not_specialize=["M", "k_per_split"])
    def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_qn,
                      stride_sn, stride_om, stride_os, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                      HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """out[split] = x[:, K range of program_id(2)] @ dequant(w)^T, one [BLOCK_M, BLOCK_N] tile by tl.dot."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        rk = tl.arange(0, BLOCK_K)
        m_mask, n_mask = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = split * k_per_split
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):  # BLOCK_K divides GROUP and K
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None],
                        other=0.0)
            w = _w4_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, stride_qn, stride_sn, GROUP, HAS_ZERO, BLOCK_N,
                         BLOCK_K, False)
            if FP32_DOT:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w.to(a.dtype), acc)  # A16: weights meet activations in 16 bit, fp32 accumulate
        _store_split(acc, b_ptr, out_ptr, rm, rn, m_mask, n_mask, split, stride_om, stride_os, HAS_BIAS)

    # stride_os (= M * N) is not specialised either, so each BLOCK_M bucket compiles once whatever M's factors
    @triton.jit(do_not_specialize=["M", "k_per_split", "stride_os"])
    def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_qn,
                           stride_sn, stride_om, stride_os, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """:func:`_w4a16_kernel` for decode shapes without tl.dot: a program holds all M rows (BLOCK_M >= M) of
        BLOCK_N columns and adds each K tile's broadcast product x[m, k] * w[k, n], summed over k, in fp32."""
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        rk = tl.arange(0, BLOCK_K)
        m_mask, n_mask = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = split * k_per_split
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per_split), BLOCK_K):  # BLOCK_K divides GROUP and k_per_split
            a = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0)
            w = _w4_tile(qw_ptr, s_ptr, z_ptr, rn, n_mask, k0, stride_qn, stride_sn, GROUP, HAS_ZERO, BLOCK_N,
                         BLOCK_K, True)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
        _store_split(acc, b_ptr, out_ptr, rm, rn, m_mask, n_mask, split, stride_om, stride_os, HAS_BIAS)

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

    _AUTOTUNE = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter runs each kernel's first config
    _w4_launch, _gemv_launch = _w4a16_kernel, _w4a16_gemv_kernel
    if _AUTOTUNE:
        _w4_launch = triton.autotune(
            [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in W4_CONFIGS],
            key=["N", "K", "GROUP", "BLOCK_M", "BLOCK_K", "HAS_ZERO", "HAS_BIAS", "FP32_DOT"],
        )(_w4a16_kernel)
        _gemv_launch = triton.autotune(
            [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in GEMV_CONFIGS],
            key=["N", "K", "GROUP", "BLOCK_M", "HAS_ZERO", "HAS_BIAS"],
            prune_configs_by={"early_config_prune": lambda configs, named_args, **kw: [
                triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                for n, k, w, st in _fit_gemv(kw["BLOCK_M"], kw["GROUP"])]},
        )(_w4a16_gemv_kernel)


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
                        split_k: int | None = None, gemv: bool | None = None) -> torch.Tensor:
    """Triton version of :func:`w4a16_linear_torch`, dequantising inside the kernel. By M: up to GEMV_MAX_M a
    dot-free GEMV, then a tl.dot GEMM tiled over M, N, K; from DEQUANT_MIN_M one dequantisation, then cuBLAS.
    Decode shapes (the GEMV, and the GEMM up to SPLIT_K_MAX_M) split K across programs when N alone fills few SMs
    (``split_k`` forces a count; the partial sums add up in fp32). ``gemv`` forces the GEMV (M <= SPLIT_K_MAX_M)
    or rules it out, to compare the paths; None chooses by M."""
    _check_linear(x, qw, bias)
    block_k = min(MAX_BLOCK_K, qw.group_size & -qw.group_size)  # largest power of two dividing the group
    if block_k < 16:
        raise ValueError(f"w4a16_linear_triton: group_size must be a multiple of 16, got {qw.group_size}")
    x = x if x.stride(1) == 1 else x.contiguous()
    (M, K), N = x.shape, qw.shape[0]
    gemv = M <= GEMV_MAX_M if gemv is None else gemv
    if gemv and M > SPLIT_K_MAX_M:
        raise ValueError(f"w4a16_linear_triton: the GEMV takes M <= {SPLIT_K_MAX_M}, got M={M}")
    if M == 0:
        return torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M >= DEQUANT_MIN_M and split_k is None and x.dtype != torch.float32:
        return F.linear(x, dequantize_w4_triton(qw, x.dtype), bias)
    if gemv:
        block_m = triton.next_power_of_2(M)
        k_unit, n_tiles = _gemv_block_k(qw.group_size), triton.cdiv(N, _fit_gemv(block_m, qw.group_size)[0][0])
    else:
        block_m = max(16, min(64, triton.next_power_of_2(M)))
        k_unit, n_tiles = block_k, triton.cdiv(N, W4_CONFIGS[0][0])
        split_k = 1 if split_k is None and M > SPLIT_K_MAX_M else split_k
    split_k, k_per_split = _split_k(K, k_unit, n_tiles, x.device, split_k)
    qweight = qw.qweight.contiguous().view(torch.int32)  # [N, K // 8]: K is a multiple of 16
    scales = qw.scales.contiguous()
    zeros = qw.zeros.contiguous() if qw.zeros is not None else scales  # placeholder pointer when symmetric
    out = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    has_bias = bias is not None and split_k == 1
    args = (x, qweight, scales, zeros, bias if has_bias else out, out, M, N, K, k_per_split, x.stride(0),
            qweight.stride(0), scales.stride(0), out.stride(1), out.stride(0))
    consts = dict(GROUP=qw.group_size, HAS_ZERO=qw.zeros is not None, HAS_BIAS=has_bias, BLOCK_M=block_m)
    if gemv:
        # the interpreter: the first config, BLOCK_N not cut (registers cost nothing there, and programs are slow)
        fixed = {} if _AUTOTUNE else {"BLOCK_N": GEMV_CONFIGS[0][0], "BLOCK_K": min(GEMV_CONFIGS[0][1], k_unit)}
        _gemv_launch[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split_k)](*args, **consts, **fixed)
    else:
        fixed = {} if _AUTOTUNE else {"BLOCK_N": W4_CONFIGS[0][0]}
        grid = lambda meta: (triton.cdiv(M, block_m), triton.cdiv(N, meta["BLOCK_N"]), split_k)  # noqa: E731
        _w4_launch[grid](*args, **consts, FP32_DOT=x.dtype == torch.float32, BLOCK_K=block_k, **fixed)
    if split_k == 1:
        return out[0]
    out = out.sum(0)
    return (out if bias is None else out + bias.float()).to(x.dtype)
