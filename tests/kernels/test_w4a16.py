"""W4A16: the format's error bound, the packing layout by hand, the torch linear against a float64 matmul, and the
Triton GEMV and GEMM against the torch reference."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.w4a16 import (
    GEMV_MAX_M,
    SPLIT_K_MAX_M,
    QuantizedWeight,
    dequantize_w4,
    quantize_w4,
    w4a16_linear_torch,
    w4a16_linear_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _w(N, K, seed=0, scale=0.05):
    return scale * torch.randn(N, K, generator=torch.Generator().manual_seed(seed))


def _unpack(qw):
    return torch.stack([qw.qweight & 0xF, qw.qweight >> 4], dim=-1).reshape(qw.shape).long()


@given(N=st.integers(1, 9), groups=st.integers(1, 4), group_size=st.sampled_from([2, 16, 32, 128]),
       log_scale=st.floats(-6, 3), shift=st.floats(-1, 1), zero_point=st.booleans(), seed=st.integers(0, 99))
def test_roundtrip_error_within_half_scale(N, groups, group_size, log_scale, shift, zero_point, seed):
    K = groups * group_size
    w = (_w(N, K, seed, 1.0) + shift) * 10**log_scale  # shifted groups exercise asymmetric ranges
    qw = quantize_w4(w, group_size, zero_point)
    err = (dequantize_w4(qw).double() - w.double()).abs()
    bound = qw.scales.double().repeat_interleave(group_size, dim=1) / 2
    assert (err <= bound * (1 + 1e-5) + 1e-30).all(), (err / bound).max()
    u = _unpack(qw)
    assert u.min() >= 0 and u.max() <= 15
    assert qw.scales.dtype == torch.float16 and qw.scales.shape == (N, groups)
    if zero_point:
        assert qw.zeros.dtype == torch.float16 and (qw.zeros == qw.zeros.round()).all()
        assert qw.zeros.min() >= 0 and qw.zeros.max() <= 15
    else:
        assert qw.zeros is None


def test_zero_is_exact_and_range_is_used():
    w = _w(4, 64)
    w[:, :3] = 0.0
    for zero_point in (True, False):
        qw = quantize_w4(w, 32, zero_point)
        assert (dequantize_w4(qw)[:, :3] == 0).all()
        q = _unpack(qw) - (8 if not zero_point else 0)
        assert q.min() == (0 if zero_point else -8) or q.max() == (15 if zero_point else 7)
    zero = quantize_w4(torch.zeros(2, 32), 32)  # all-zero groups must not divide by zero
    assert (dequantize_w4(zero) == 0).all() and torch.isfinite(zero.scales).all()


def test_packing_layout_by_hand():
    # two columns per byte, low nibble first; symmetric q = nibble - 8; zero-point w = (nibble - zero) * scale
    qweight = torch.tensor([[0x8F, 0x10]], dtype=torch.uint8)  # nibbles 15, 8, 0, 1
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    sym = QuantizedWeight(qweight, scales, None, 2, (1, 4))
    assert dequantize_w4(sym).tolist() == [[3.5, 0.0, -16.0, -14.0]]
    asym = QuantizedWeight(qweight, scales, torch.tensor([[3.0, 1.0]], dtype=torch.float16), 2, (1, 4))
    assert dequantize_w4(asym).tolist() == [[6.0, 2.5, -2.0, 0.0]]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="not divisible"):
        quantize_w4(_w(4, 96), group_size=64)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_w4(torch.zeros(8))
    qw = quantize_w4(_w(4, 64), group_size=32)
    with pytest.raises(ValueError, match="K=64"):
        w4a16_linear_torch(torch.zeros(2, 32), qw)
    with pytest.raises(ValueError, match="bias"):
        w4a16_linear_torch(torch.zeros(2, 64), qw, torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("zero_point", [True, False])
def test_torch_linear_equals_dequantised_matmul(dtype, zero_point):
    qw = quantize_w4(_w(48, 256), 64, zero_point)
    x, bias = torch.randn(5, 256).to(dtype), torch.randn(48).to(dtype)
    expected = x.double() @ dequantize_w4(qw, torch.float64).T + bias.double()
    out = w4a16_linear_torch(x, qw, bias)
    assert out.dtype == dtype and out.shape == (5, 48)
    torch.testing.assert_close(out, expected.to(dtype), rtol=1e-5 if dtype == torch.float32 else None,
                               atol=1e-5 if dtype == torch.float32 else None)


def _check_triton(M, N, K, G, zero_point, with_bias, dtype, device, seed=0, **kwargs):
    qw = quantize_w4(_w(N, K, seed=M + N + K + seed), G, zero_point).to(device)
    g = torch.Generator().manual_seed(M + seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    bias = torch.randn(N, generator=g).to(device, dtype) if with_bias else None
    out, ref = w4a16_linear_triton(x, qw, bias, **kwargs), w4a16_linear_torch(x, qw, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    # fp32 accumulates in a different order; 16-bit paths also round the dequantised weight to the activation dtype
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("zero_point", [True, False])
def test_triton_matches_torch(M, zero_point, dtype):
    """The tl.dot GEMM, at decode M too (forced: the GEMV takes those by default)."""
    _check_triton(M, 100, 256, 64, zero_point, with_bias=M == 3, dtype=dtype, device=DEVICE, gemv=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("zero_point", [True, False])
def test_gemv_matches_torch(M, zero_point, dtype):
    """The dot-free GEMV at every BLOCK_M bucket (1, 2, 4, 8; 16 only when forced), odd N: a partial N tile."""
    _check_triton(M, 67, 256, 64, zero_point, with_bias=M % 2 == 1, dtype=dtype, device=DEVICE, gemv=True)


@pytest.mark.interpreter
@given(M=st.integers(1, GEMV_MAX_M), N=st.integers(1, 40), groups=st.integers(1, 3),
       group_size=st.sampled_from([16, 32, 64, 128, 512]), zero_point=st.booleans(), with_bias=st.booleans(),
       split_k=st.none() | st.integers(1, 5), fp16=st.booleans(), seed=st.integers(0, 99))
def test_gemv_matches_torch_property(M, N, groups, group_size, zero_point, with_bias, split_k, fp16, seed):
    """Small shapes (the interpreter is slow): K tiles of 16 to 256 (512-groups hold two), split-K past K's tiles."""
    _check_triton(M, N, groups * group_size, group_size, zero_point, with_bias,
                  torch.float16 if fp16 else torch.float32, DEVICE, seed=seed, split_k=split_k, gemv=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_n,block_k", [(4, 64), (8, 256), (64, 32)])
def test_gemv_tile_shapes(monkeypatch, block_n, block_k):
    """GEMV tiles other than the interpreter's default (the first config): narrow and wide N, K tiles from 32 to a
    whole 256-group, several K tiles per split."""
    from kernels import w4a16

    monkeypatch.setattr(w4a16, "GEMV_CONFIGS", ((block_n, block_k, 4, 1),))
    for M, G, split_k in ((5, 256, None), (2, 64, 2), (8, 128, 3)):
        _check_triton(M, 21, 512, G, M % 2 == 1, True, torch.float32, DEVICE, gemv=True, split_k=split_k)


@pytest.mark.parametrize("block_m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("group", [16, 32, 48, 64, 128, 256, 1024])
def test_gemv_configs_fit(block_m, group):
    """Every GEMV config cut to a launch: a power-of-two K tile that divides the group and the split unit, and a
    product tile within the per-thread register budget."""
    from kernels.w4a16 import GEMV_PRODUCTS_PER_THREAD, _fit_gemv, _gemv_block_k

    unit = _gemv_block_k(group)
    assert group % unit == 0 and unit <= 256
    configs = _fit_gemv(block_m, group)
    assert configs and len(set(configs)) == len(configs)
    for n, k, warps, _ in configs:
        assert unit % k == 0 and k & (k - 1) == 0 and n >= 1 and n & (n - 1) == 0
        assert block_m * n * k <= GEMV_PRODUCTS_PER_THREAD * 32 * warps


@pytest.mark.interpreter
def test_dispatch_by_m(monkeypatch):
    """M <= GEMV_MAX_M takes the GEMV, larger M the tl.dot GEMM; ``gemv=`` forces either (the same bits as the
    automatic choice), and the GEMV refuses M > SPLIT_K_MAX_M."""
    from kernels import w4a16

    taken = []

    class Spy:
        def __init__(self, name, launch):
            self.name, self.launch = name, launch

        def __getitem__(self, grid):
            taken.append(self.name)
            return self.launch[grid]

    monkeypatch.setattr(w4a16, "_gemv_launch", Spy("gemv", w4a16._gemv_launch))
    monkeypatch.setattr(w4a16, "_w4_launch", Spy("dot", w4a16._w4_launch))
    qw = quantize_w4(_w(24, 64), group_size=32).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    for M, path in ((1, "gemv"), (GEMV_MAX_M, "gemv"), (GEMV_MAX_M + 1, "dot"), (SPLIT_K_MAX_M + 1, "dot")):
        x = torch.randn(M, 64, generator=g).to(DEVICE)
        auto = w4a16_linear_triton(x, qw)
        assert taken[-1] == path
        forced = w4a16_linear_triton(x, qw, gemv=path == "gemv")
        assert taken[-1] == path and torch.equal(auto, forced)
        w4a16_linear_triton(x[:1], qw, gemv=False)
        assert taken[-1] == "dot"
    w4a16_linear_triton(torch.zeros(SPLIT_K_MAX_M, 64, device=DEVICE), qw, gemv=True)
    assert taken[-1] == "gemv"
    with pytest.raises(ValueError, match=f"M <= {SPLIT_K_MAX_M}"):
        w4a16_linear_triton(torch.zeros(SPLIT_K_MAX_M + 1, 64, device=DEVICE), qw, gemv=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("N,K,G", [(72, 384, 128), (16, 96, 32), (130, 160, 16)])
@pytest.mark.parametrize("gemv", [True, False])
def test_triton_group_shapes(N, K, G, gemv):
    _check_triton(5, N, K, G, True, True, torch.float16, DEVICE, gemv=gemv)


@pytest.mark.interpreter
@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("gemv", [True, False])
def test_triton_split_k_matches_torch(split_k, gemv):
    """Decode shapes sum K partitions in fp32 (bias added once, after the sum), on both paths; 5 > K tiles clamps."""
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(2, 192, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
        qw = quantize_w4(_w(40, 192), group_size=64).to(DEVICE)
        bias = torch.randn(40).to(dtype).to(DEVICE)
        ref = w4a16_linear_torch(x, qw, bias)
        out = w4a16_linear_triton(x, qw, bias, split_k=split_k, gemv=gemv)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.interpreter
def test_triton_large_m_dequantises_then_matmuls():
    from kernels.w4a16 import DEQUANT_MIN_M

    x = torch.randn(DEQUANT_MIN_M, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    qw = quantize_w4(_w(24, 64), group_size=32).to(DEVICE)
    ref = w4a16_linear_torch(x, qw)
    torch.testing.assert_close(w4a16_linear_triton(x, qw).float(), ref.float(), rtol=0, atol=2e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("N,K,G", [(72, 384, 128), (33, 160, 32), (5, 16, 16)])
@pytest.mark.parametrize("zero_point", [True, False])
def test_triton_dequantise_equals_torch(N, K, G, zero_point):
    """The one-pass dequantisation kernel gives dequantize_w4's values exactly (partial tiles on both axes)."""
    from kernels.w4a16 import dequantize_w4, dequantize_w4_triton

    qw = quantize_w4(_w(N, K), group_size=G, zero_point=zero_point).to(DEVICE)
    for dtype in (torch.float32, torch.float16):
        out = dequantize_w4_triton(qw, dtype)
        assert out.dtype == dtype and out.shape == (N, K)
        assert torch.equal(out.cpu(), dequantize_w4(qw, dtype).cpu())


@pytest.mark.interpreter
def test_triton_rejects_small_groups_and_handles_empty():
    qw = quantize_w4(_w(8, 64), group_size=8).to(DEVICE)
    with pytest.raises(ValueError, match="multiple of 16"):
        w4a16_linear_triton(torch.zeros(2, 64, device=DEVICE), qw)
    qw = quantize_w4(_w(8, 64), group_size=32).to(DEVICE)
    assert w4a16_linear_triton(torch.zeros(0, 64, device=DEVICE), qw).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8, 16, 17, 257])
@pytest.mark.parametrize("zero_point", [True, False])
def test_triton_gpu(M, zero_point, dtype):
    """Llama-sized N and K: the GEMV (M <= 8), the split-K GEMM (16), the GEMM (17) and the cuBLAS path (257)."""
    _check_triton(M, 4100, 4096, 128, zero_point, with_bias=True, dtype=dtype, device="cuda")
