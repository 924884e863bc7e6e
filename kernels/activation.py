"""SiLU-and-mul (the SwiGLU gate of Llama MLPs): torch reference and Triton kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None


def check_silu_and_mul_input(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: x must be [T, 2F], got {tuple(x.shape)}")


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[T, 2F] -> [T, F] = silu(x[:, :F]) * x[:, F:], computed in fp32."""
    check_silu_and_mul_input(x)
    if x.dtype == torch.float32:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, f, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + f + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_torch`."""
    check_silu_and_mul_input(x)
    x = x if x.stride(1) == 1 else x.contiguous()
    T, f = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, f), dtype=x.dtype, device=x.device)
    if T > 0 and f > 0:
        block = min(1024, triton.next_power_of_2(f))
        _silu_and_mul_kernel[(T, triton.cdiv(f, block))](x, out, f, x.stride(0), out.stride(0), BLOCK=block)
    return out
