"""The native backend's C ops (kernels.cpu_native): RMSNorm against a float64 formula and the torch reference,
RoPE bit for bit against the torch reference, row (batch) and thread invariance, strided inputs, the fallbacks to
torch for other dtypes, and clear errors for bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.executor import resolve_kernels
from kernels.cpu_native import native_library, rms_norm_native, rope_native
from kernels.norm import rms_norm_torch
from kernels.rope import rope_cos_sin, rope_torch

EPS = 1e-5


@pytest.fixture(scope="module", autouse=True)
def lib():
    if native_library() is None:
        pytest.skip("native CPU kernels unavailable here (not x86 with AVX2/AVX-512 FMA, or no C compiler)")


def _rows(T, d, seed=0, width=None):
    """x, r [T, d] (x a column slice of a wider tensor when width > d: a row stride that is not d) and w [d]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, width or d, generator=g)[:, :d]
    return x, torch.randn(T, d, generator=g), 1 + 0.5 * torch.randn(d, generator=g)


def _norm64(h, w):
    h = h.double()
    return h / torch.sqrt((h * h).mean(-1, keepdim=True) + EPS) * w.double()


@given(T=st.integers(1, 70), d=st.integers(1, 300), strided=st.booleans())
def test_rms_norm_matches_float64_and_the_reference(T, d, strided):
    x, r, w = _rows(T, d, seed=T * d, width=d + 7 if strided else None)
    out = rms_norm_native(x, w, EPS)
    torch.testing.assert_close(out.double(), _norm64(x, w), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, rms_norm_torch(x, w, EPS), rtol=2e-6, atol=1e-6)
    out, new_r = rms_norm_native(x, w, EPS, residual=r)
    assert torch.equal(new_r, x + r)  # the residual stream is the rounded sum, as HF adds in the model dtype
    torch.testing.assert_close(out.double(), _norm64(x + r, w), rtol=1e-5, atol=1e-6)
    assert out.is_contiguous() and new_r.is_contiguous()


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_rows_do_not_depend_on_the_batch(threads):
    """A row's bits are the same alone or among 99 others (rows >= 64 also split over threads)."""
    x, r, w = _rows(100, 512, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, new_r = rms_norm_native(x, w, EPS, residual=r)
        for i in (0, 37, 99):
            alone, alone_r = rms_norm_native(x[i:i + 1], w, EPS, residual=r[i:i + 1])
            assert torch.equal(out[i:i + 1], alone) and torch.equal(new_r[i:i + 1], alone_r)
    finally:
        torch.set_num_threads(before)


def test_rms_norm_other_dtypes_and_bad_shapes():
    x, r, w = _rows(4, 96)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        xs, rs, ws = x.to(dtype), r.to(dtype), w.to(dtype)
        assert torch.equal(rms_norm_native(xs, ws, EPS), rms_norm_torch(xs, ws, EPS))
        assert all(torch.equal(a, b) for a, b in zip(rms_norm_native(xs, ws, EPS, rs), rms_norm_torch(xs, ws, EPS, rs),
                                                     strict=True))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_native(x, w[:5], EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_native(x, w, EPS, residual=r[:2])


def _qkv(T, H, Hkv, D, seed=0):
    """q [T, H, D] and k [T, Hkv, D] as views of one [T, (H + 2 Hkv) D] projection, as the model splits it."""
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=torch.Generator().manual_seed(seed))
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, H, D), k.view(T, Hkv, D)


@given(T=st.integers(1, 80), H=st.integers(1, 6), Hkv=st.integers(1, 3), half=st.integers(1, 40),
       seed=st.integers(0, 3))
def test_rope_is_the_reference_bit_for_bit(T, H, Hkv, half, seed):
    D = 2 * half
    q, k = _qkv(T, H, Hkv, D, seed)
    table = rope_cos_sin(D, 300, 10000.0)
    positions = torch.randint(0, 300, (T,), generator=torch.Generator().manual_seed(seed))
    for ours, ref in zip(rope_native(q, k, positions, table), rope_torch(q, k, positions, table), strict=True):
        assert ours.shape == ref.shape and ours.is_contiguous()
        assert torch.equal(ours, ref)


def test_rope_threads_other_dtypes_and_bad_input():
    q, k = _qkv(100, 8, 4, 64, seed=5)
    table = rope_cos_sin(64, 512, 500000.0)
    positions = torch.arange(100) * 5
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert all(torch.equal(a, b) for a, b in zip(rope_native(q, k, positions, table),
                                                     rope_torch(q, k, positions, table), strict=True))
    finally:
        torch.set_num_threads(before)
    half = (q.half(), k.half(), positions, table.half())
    assert all(torch.equal(a, b) for a, b in zip(rope_native(*half), rope_torch(*half), strict=True))
    with pytest.raises(IndexError, match="position 512 of token 3 is outside the table's 512 positions"):
        rope_native(q, k, torch.tensor([0, 1, 2, 512] + [0] * 96), table)
    with pytest.raises(IndexError, match="position -1"):
        rope_native(q, k, torch.full((100,), -1), table)
    with pytest.raises(ValueError, match="positions must be"):
        rope_native(q, k, positions[:5], table)


def test_native_backend_is_the_cpu_default():
    assert resolve_kernels("auto", "cpu") == "native" and resolve_kernels("auto", "cuda:0") == "triton"
    assert resolve_kernels("torch", "cpu") == "torch"
