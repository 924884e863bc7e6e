"""RMSNorm: torch reference against HF LlamaRMSNorm and a float64 formula; Triton kernel against the reference."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.norm import rms_norm_torch, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _inputs(T, d, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r, w = (torch.randn(s, generator=g) for s in ((T, d), (T, d), (d,)))
    return x.to(device, dtype), r.to(device, dtype), (1 + 0.5 * w).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_matches_hf_llama_rmsnorm(dtype):
    x, r, w = _inputs(5, 96, dtype)
    hf = LlamaRMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        torch.testing.assert_close(rms_norm_torch(x, w, EPS), hf(x), rtol=0, atol=0)
        # the fused form: HF adds the residual in the model dtype, then normalises the sum
        out, new_r = rms_norm_torch(x, w, EPS, residual=r)
        torch.testing.assert_close(new_r, x + r, rtol=0, atol=0)
        torch.testing.assert_close(out, hf(x + r), rtol=0, atol=0)


def test_torch_matches_float64_formula():
    x, _, w = _inputs(4, 160, torch.float32)
    xd, wd = x.double(), w.double()
    expected = torch.stack([row / torch.sqrt((row * row).sum() / 160 + EPS) * wd for row in xd])
    torch.testing.assert_close(rms_norm_torch(x, w, EPS).double(), expected, rtol=1e-6, atol=1e-6)


def test_bad_shapes_raise():
    x, r, w = _inputs(2, 8, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_torch(x, w[:4], EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_torch(x, w, EPS, residual=r[:1])


def _check_triton(T, d, dtype, residual, device, strided=False):
    x, r, w = _inputs(T, d, dtype, device, seed=T * 1000 + d)
    if strided:  # a row view of a wider buffer, as a slice of a fused projection would be
        x = torch.cat([x, x], dim=1)[:, :d]
    # fp16: two output ulps (2^-9 relative; measured on an H200 at d=5120: 1.6e-3), bf16: torch's default (1 ulp)
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 1e-5} \
        if dtype == torch.float16 else {}
    if residual:
        out, new_r = rms_norm_triton(x, w, EPS, residual=r)
        ref_out, ref_r = rms_norm_torch(x, w, EPS, residual=r)
        torch.testing.assert_close(new_r, ref_r, rtol=0, atol=0)
    else:
        out, ref_out = rms_norm_triton(x, w, EPS), rms_norm_torch(x, w, EPS)
    assert out.dtype == dtype and out.shape == (T, d)
    # fp32 sums may differ in order; allow a couple of ulps
    torch.testing.assert_close(out, ref_out, **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else tol))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,d", [(1, 96), (3, 160), (7, 64), (2, 1000)])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_matches_torch(T, d, dtype, residual):
    _check_triton(T, d, dtype, residual, DEVICE)


@pytest.mark.interpreter
def test_triton_strided_rows_and_empty():
    _check_triton(3, 96, torch.float16, True, DEVICE, strided=True)
    x = torch.empty(0, 32, device=DEVICE)
    assert rms_norm_triton(x, torch.ones(32, device=DEVICE), EPS).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,d", [(1, 4096), (333, 5120), (64, 160)])
@pytest.mark.parametrize("residual", [False, True])
def test_triton_gpu(T, d, dtype, residual):
    _check_triton(T, d, dtype, residual, "cuda")
