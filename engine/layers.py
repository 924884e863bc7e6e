"""The engine's basic layers: linear layers over the CPU GEMM choice (or the W4A16 kernel) and RMSNorm, with
their parameters laid out as the loader and the CPU kernels expect."""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_gemm import CpuLinear
from kernels.ops import KernelSet
from kernels.w4a16 import QuantizedWeight, quantize_w4


def param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    """An uninitialised frozen parameter: the loader or init_random fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def linear_weight(out_features: int, in_features: int, dtype: torch.dtype, device, *stack: int) -> nn.Parameter:
    """[*stack, out, in] like nn.Linear's (``stack``: leading dims of stacked weights, e.g. experts). On CPU its
    memory is [*stack, in, out] (a transposed view): MKL's small-batch GEMM (decode) runs ~20% faster on that layout
    with bit-identical results; prefill-sized GEMMs are unaffected."""
    if torch.device(device).type != "cpu":
        return param(*stack, out_features, in_features, dtype=dtype, device=device)
    return nn.Parameter(torch.empty(*stack, in_features, out_features, dtype=dtype, device=device).transpose(-1, -2),
                        requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). ``quantize`` swaps W for a 4-bit QuantizedWeight; forward then runs the W4A16 kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = linear_weight(out_features, in_features, dtype, device)
        self.bias = param(out_features, dtype=dtype, device=device) if bias else None
        self.qweight: QuantizedWeight | None = None
        self.matmul = CpuLinear()

    def quantize(self, group_size: int, zero_point: bool = True) -> None:
        self.qweight = quantize_w4(self.weight.data, group_size, zero_point)
        self.weight = None  # free the 16-bit copy
        self.matmul = CpuLinear()  # and any packed copy of it

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        if self.qweight is not None:
            return kernels.w4a16_linear(x, self.qweight, self.bias)
        return self.matmul(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kernels: KernelSet):
        """Returns (norm(x + residual), x + residual); the first layer has no residual yet."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps), x
        return kernels.rms_norm(x, self.weight, self.eps, residual)
