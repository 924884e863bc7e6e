"""RMSNorm with optional fused residual add (Llama pre-norm blocks): torch reference and Triton kernel.

Numerics follow HF ``LlamaRMSNorm``: normalise in fp32, cast to the input dtype, then multiply by the weight.
With ``residual`` the sum ``x + residual`` is rounded to the input dtype first (as HF adds in the model dtype),
normalised, and also returned as the new residual stream.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x must be [T, d] and weight [d], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """out = norm(x [+ residual]) * weight; returns out, or (out, x + residual) when residual is given."""
    check_rms_norm_inputs(x, weight, residual)
    h = x if residual is None else x + residual
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op (the CPU engine's path)
        out = torch.rms_norm(h, (h.shape[-1],), weight, eps)
        return out if residual is None else (out, h)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, h)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, d, eps, stride_x, stride_r, stride_o, stride_nr,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            h = h + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)  # rounded to the input dtype
            tl.store(new_r_ptr + row * stride_nr + cols, h, mask=mask)
        hf = h.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / d + eps)
        normed = (hf * inv_rms).to(h.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Triton version of :func:`rms_norm_torch` (one program per row)."""
    check_rms_norm_inputs(x, weight, residual)
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        new_r = torch.empty_like(out)
    else:
        new_r = out  # unused placeholder
    r = residual if residual is not None else x
    T, d = x.shape
    if T > 0:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(T,)](x, r, weight, out, new_r, d, eps, x.stride(0), r.stride(0), out.stride(0),
                               new_r.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(max(block // 512, 1), 8))  # ~16 fp32 values per thread
    return out if residual is None else (out, new_r)
