"""CPU fp32 GEMMs: the native kernel against a float64 matmul over varied shapes (panel tails, row-block tails,
odd K, bias, strided rows), its batch and thread invariance, CpuLinear's dispatch and repacking, and the fallbacks
when the kernel is turned off or cannot be built."""

import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernels import cpu_gemm, cpu_native
from kernels.cpu_gemm import NATIVE_MAX_ROWS, NATIVE_MIN_ROWS, CpuLinear, gemm_library, native_linear, pack_weight
from kernels.cpu_native import native_library


@pytest.fixture(scope="module")
def lib():
    lib = gemm_library()
    if lib is None:
        pytest.skip("native CPU GEMM unavailable here (not x86 with AVX2/AVX-512 FMA, or no C compiler)")
    return lib


def _data(M, N, K, seed=0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(K, N, generator=g).t() if transposed else torch.randn(N, K, generator=g)
    return x, w, torch.randn(N, generator=g)


def _reference(x, w, bias=None):
    return F.linear(x.double(), w.double(), None if bias is None else bias.double()).float()


@given(M=st.integers(1, 130), N=st.integers(1, 100), K=st.integers(1, 300), with_bias=st.booleans(),
       transposed=st.booleans())
def test_native_linear_matches_float64(lib, M, N, K, with_bias, transposed):
    x, w, bias = _data(M, N, K, transposed=transposed)
    bias = bias if with_bias else None
    out = native_linear(x, pack_weight(w, lib), N, bias, lib)
    assert out.shape == (M, N) and out.dtype == torch.float32
    # fp32 FMA chain over K terms of size ~1: error grows like sqrt(K) * eps * |x||w|
    torch.testing.assert_close(out, _reference(x, w, bias), atol=2e-6 * K + 1e-6, rtol=1e-5)


@pytest.mark.parametrize("N,K", [(1, 1), (33, 17), (512, 512), (1000, 1408), (32000, 64)])
def test_native_linear_model_shapes(lib, N, K):
    for M in (2, 3, 8, 9, 17, 32, 64):
        x, w, bias = _data(M, N, K, seed=M, transposed=True)
        torch.testing.assert_close(native_linear(x, pack_weight(w, lib), N, bias, lib), _reference(x, w, bias),
                                   atol=2e-6 * K + 1e-6, rtol=1e-5)


def test_packing_layout(lib):
    """Panel p holds columns [p*NR, p*NR + NR) as [K][NR], zeros past N."""
    nr = lib.tw_panel_width()
    N, K = nr + 3, 5
    w = torch.arange(N * K, dtype=torch.float32).view(N, K)
    packed = pack_weight(w, lib)
    assert packed.shape == (2, K, nr)
    assert torch.equal(packed[0], w[:nr].t()) and torch.equal(packed[1, :, :3], w[nr:].t())
    assert not packed[1, :, 3:].any()


def test_rows_do_not_depend_on_the_batch(lib):
    """Every output element is one FMA chain over k in order: a row's bits are the same whatever M, its position
    or the row block it falls in (batch invariance)."""
    x, w, bias = _data(64, 300, 200)
    packed = pack_weight(w, lib)
    full = native_linear(x, packed, 300, bias, lib)
    for m in (1, 2, 7, 8, 9, 33):
        assert torch.equal(native_linear(x[:m], packed, 300, bias, lib), full[:m])
    assert torch.equal(native_linear(x[5:6], packed, 300, bias, lib), full[5:6])


def test_threads_and_strided_rows_give_the_same_bits(lib):
    x, w, bias = _data(12, 1000, 96)
    packed = pack_weight(w, lib)
    one = native_linear(x, packed, 1000, bias, lib)
    wide = torch.zeros(12, 200)
    wide[:, 50:146] = x
    assert torch.equal(native_linear(wide[:, 50:146], packed, 1000, bias, lib), one)  # row stride 200, not K
    assert torch.equal(native_linear(x.t().contiguous().t(), packed, 1000, bias, lib), one)  # column-major x
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(native_linear(x, packed, 1000, bias, lib), one)  # panels split over threads
    finally:
        torch.set_num_threads(threads)


def test_native_linear_rejects_mismatched_inputs(lib):
    x, w, _ = _data(4, 10, 16)
    with pytest.raises(ValueError, match="16 features, the packed weight 8"):
        native_linear(x, pack_weight(w[:, :8], lib), 10, None, lib)
    with pytest.raises(ValueError, match="does not fit the packed weight"):
        native_linear(x, pack_weight(w, lib), 10 + lib.tw_panel_width(), None, lib)
    with pytest.raises(ValueError, match="2-D float32 CPU rows"):
        native_linear(x.double(), pack_weight(w, lib), 10, None, lib)


def test_cpu_linear_dispatch_and_repacking(lib):
    """NATIVE_MIN_ROWS..NATIVE_MAX_ROWS: the native kernel; 1 row below that: F.linear itself; more: oneDNN (or
    F.linear). The packed copies follow in-place weight updates (version counter) and prepack makes both ahead of
    time."""
    vb = lib.tw_vector_bytes()
    x, w, bias = _data(NATIVE_MAX_ROWS[vb] + 8, 300, 64, transposed=True)
    linear = CpuLinear()
    one = linear(x[:1], w, bias)
    if NATIVE_MIN_ROWS[vb] > 1:
        assert torch.equal(one, F.linear(x[:1], w, bias)) and linear.native is None
    else:
        assert torch.equal(one, native_linear(x[:1], linear.native, 300, bias, lib))
    assert linear.onednn is None
    small = linear(x[:NATIVE_MIN_ROWS[vb] + 3], w, bias)
    assert linear.native is not None and linear.onednn is None
    assert torch.equal(small, native_linear(x[:NATIVE_MIN_ROWS[vb] + 3], linear.native, 300, bias, lib))
    assert linear(x[:0], w, bias).shape == (0, 300)
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    assert linear.onednn is not None or not cpu_gemm.ONEDNN
    w.mul_(2)  # in place: the version counter moves, both packed copies are remade on use
    torch.testing.assert_close(linear(x[:8], w), _reference(x[:8], w), atol=1e-4, rtol=1e-5)
    assert linear.onednn is None
    fresh = CpuLinear()
    fresh.prepack(w)
    assert fresh.native is not None and (fresh.onednn is not None or not cpu_gemm.ONEDNN)
    fresh.prepack(w.double())  # not an fp32 CPU weight: nothing to pack
    assert torch.equal(fresh(x[:8], w), linear(x[:8], w))


def test_native_only_runs_every_row_count_on_one_copy(lib):
    """native_only (backend.cpu_gemm=native): past NATIVE_MAX_ROWS too, the native kernel, and no oneDNN copy is
    ever made; a deep copy keeps the choice."""
    import copy

    vb = lib.tw_vector_bytes()
    x, w, bias = _data(NATIVE_MAX_ROWS[vb] + 40, 300, 64, transposed=True)
    linear = CpuLinear(native_only=True)
    linear.prepack(w)
    assert linear.native is not None and linear.onednn is None
    assert torch.equal(linear(x, w, bias), native_linear(x, linear.native, 300, bias, lib))
    assert linear.onednn is None and copy.deepcopy(linear).native_only


def test_cpu_linear_leaves_other_dtypes_to_f_linear():
    x, w, bias = _data(8, 40, 16)
    for dtype in (torch.float64, torch.bfloat16):
        assert torch.equal(CpuLinear()(x.to(dtype), w.to(dtype), bias.to(dtype)),
                           F.linear(x.to(dtype), w.to(dtype), bias.to(dtype)))


def fresh_library(monkeypatch, tmp_path, **env):
    """native_library() and gemm_library() built anew with ``env`` and an empty kernel cache; the caches are cleared
    again after, so later tests load the usual build."""
    with monkeypatch.context() as m:
        m.setenv("TWINSERVE_CACHE", str(tmp_path))
        for k, v in env.items():
            m.setenv(k, v)
        native_library.cache_clear()
        gemm_library.cache_clear()
        try:
            return native_library(), gemm_library()
        finally:
            native_library.cache_clear()
            gemm_library.cache_clear()


def test_without_the_native_kernel_cpu_linear_still_matches(monkeypatch, tmp_path, caplog):
    """Turned off, or no working compiler: no GEMM library (a warning says why a build failed), and oneDNN /
    F.linear take those rows."""
    built, gemm = fresh_library(monkeypatch, tmp_path, TWINSERVE_NATIVE_GEMM="0")
    assert built is not None and gemm is None  # off for GEMMs only
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_native"):
        assert fresh_library(monkeypatch, tmp_path / "a", CC="/nonexistent/cc") == (None, None)
        assert fresh_library(monkeypatch, tmp_path / "b", CC="false") == (None, None)  # a compiler that fails
    assert sum("native CPU kernels not built" in r.getMessage() for r in caplog.records) == 2
    assert not list((tmp_path / "b").glob("*.so"))  # a failed build leaves nothing behind
    monkeypatch.setattr(cpu_gemm, "gemm_library", lambda: None)
    x, w, bias = _data(8, 300, 64, transposed=True)
    linear = CpuLinear()
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
    assert linear.native is None


def test_build_is_cached_per_source_and_cpu(lib, monkeypatch, tmp_path):
    calls = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or real_run(*a, **k))
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path))
    path = cpu_native._build("cc")
    assert path.parent == tmp_path and path.exists() and len(calls) == 1
    assert cpu_native._build("cc") == path and len(calls) == 1  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


def test_avx2_build_matches_float64(lib, monkeypatch, tmp_path):
    """The 256-bit variant (what -march=native builds on a CPU without AVX-512: 16-column panels, 6-row tiles),
    built explicitly so an AVX-512 machine tests it too."""
    if not {"avx2", "fma"} <= set(cpu_native._cpu_id().split()):
        pytest.skip("this CPU has no AVX2 + FMA")
    monkeypatch.setattr(cpu_native, "CFLAGS", ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"))
    avx2, _ = fresh_library(monkeypatch, tmp_path)
    assert avx2.tw_vector_bytes() == 32 and avx2.tw_panel_width() == 16
    for M, N, K in [(1, 5, 3), (6, 16, 64), (7, 17, 100), (13, 300, 512), (64, 40, 33)]:
        x, w, bias = _data(M, N, K, seed=K, transposed=True)
        torch.testing.assert_close(native_linear(x, pack_weight(w, avx2), N, bias, avx2), _reference(x, w, bias),
                                   atol=2e-6 * K + 1e-6, rtol=1e-5)
