"""SiLU-and-mul: torch reference against hand formulas; Triton kernel against the reference."""

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_torch, silu_and_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(T, f, dtype, device="cpu"):
    return (3 * torch.randn(T, 2 * f, generator=torch.Generator().manual_seed(T + f))).to(device, dtype)


def test_torch_matches_formula():
    x = _x(4, 37, torch.float32).double()
    gate, up = x[:, :37], x[:, 37:]
    expected = gate / (1 + torch.exp(-gate)) * up  # silu(g) = g * sigmoid(g)
    torch.testing.assert_close(silu_and_mul_torch(x.float()).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_matches_functional_silu_in_low_precision(dtype):
    x = _x(3, 64, dtype)
    expected = (F.silu(x[:, :64].float()) * x[:, 64:].float()).to(dtype)
    torch.testing.assert_close(silu_and_mul_torch(x), expected, rtol=0, atol=0)
    assert silu_and_mul_torch(x).dtype == dtype


def test_odd_width_raises():
    with pytest.raises(ValueError, match="2F"):
        silu_and_mul_torch(torch.zeros(2, 5))


def _check_triton(T, f, dtype, device):
    x = _x(T, f, dtype, device)
    out = silu_and_mul_triton(x)
    assert out.shape == (T, f) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_torch(x), rtol=1e-5 if dtype == torch.float32 else None,
                               atol=1e-5 if dtype == torch.float32 else None)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,f", [(1, 1), (1, 96), (5, 37), (3, 1100)])
def test_triton_matches_torch(T, f, dtype):
    _check_triton(T, f, dtype, DEVICE)


@pytest.mark.interpreter
def test_triton_strided_input():
    x = _x(4, 48, torch.float32, DEVICE)
    wide = torch.cat([x, x], dim=1)[:, :96]  # row stride 192, unit column stride
    torch.testing.assert_close(silu_and_mul_triton(wide), silu_and_mul_torch(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,f", [(1, 14336), (257, 11008), (64, 96)])
def test_triton_gpu(T, f, dtype):
    _check_triton(T, f, dtype, "cuda")
