"""The int8 screen of the LM head (kernels.greedy_screen, cpu_screen.c), in this CPU's build and in the AVX2 build
(7-bit x, VPMADDUBSW) where the CPU runs it: its tokens are the argmax of the native GEMM's fp32 logits for any
shapes and scales (hypothesis), on exact ties, and where the int8 approximation ranks the true winner far below
another token; its error bound holds (a float64 formula against the fp32 logits) and is the one the C code applies
(candidate counts); rows it cannot screen and weights it cannot pack fall back (None)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_native
from kernels.cpu_gemm import native_linear, pack_weight
from kernels.cpu_native import argmax_rows, native_library
from kernels.greedy_screen import MAX_FEATURES, GreedyScreen, ScreenWeights, screen_library

needs_screen = pytest.mark.skipif(screen_library() is None,
                                  reason="the screen needs the native library on an AVX2 or AVX-512 VNNI CPU")


@pytest.fixture(scope="module", params=["native", "avx2"])
def lib(request, tmp_path_factory):
    """The screen's library: this CPU's build, and the 256-bit one (-mavx2 -mfma: what a CPU without AVX-512 VNNI
    builds), compiled explicitly so an AVX-512 machine tests it too."""
    if request.param == "native":
        if screen_library() is None:
            pytest.skip("this CPU's build has no screen (no AVX2 or AVX-512 VNNI, or no native library)")
        return screen_library()
    if not {"avx2", "fma"} <= set(cpu_native._cpu_id().split()):
        pytest.skip("this CPU has no AVX2 + FMA")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cpu_native, "CFLAGS", ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared"))
        m.setenv("TWINSERVE_CACHE", str(tmp_path_factory.mktemp("avx2")))
        native_library.cache_clear()
        try:
            avx2 = native_library()
        finally:
            native_library.cache_clear()
    assert avx2.tw_screen_panel_width() == 16 and avx2.tw_screen_x_max() == 63
    return avx2


def full_argmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the screen must reproduce: the argmax of the native GEMM's fp32 logits."""
    lib = native_library()
    return argmax_rows(native_linear(x, pack_weight(w, lib), w.shape[0], None, lib))


def screened(x: torch.Tensor, w: torch.Tensor, lib) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(x.shape[0], dtype=torch.int32)
    tokens = ScreenWeights(w, lib).argmax(x, lib, counts)
    assert tokens is not None
    return tokens, counts


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 300), n=st.integers(1, 200), x_scale=st.sampled_from([1e-3, 1, 1e3]),
       w_scale=st.sampled_from([1e-4, 0.02, 10]), seed=st.integers(0, 2 ** 16), transposed=st.booleans())
def test_tokens_are_the_fp32_argmax(lib, m, k, n, x_scale, w_scale, seed, transposed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * x_scale
    w = torch.randn(n, k, generator=g) * w_scale
    if transposed:  # engine.model keeps CPU weights [in, out]: the screen copies the rows it recomputes
        w = w.t().contiguous().t()
    tokens, counts = screened(x, w, lib)
    assert torch.equal(tokens, full_argmax(x, w))
    assert ((counts >= 1) & (counts <= n)).all()


def test_near_duplicate_rows_and_exact_ties_take_the_first_maximum(lib):
    """Rows 1 ulp apart and identical rows: every one of them is a candidate, the fp32 logits decide."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 96, generator=g) * 0.05
    w = base.repeat(64, 1)
    w[5:40, 3] = torch.nextafter(w[5:40, 3], torch.tensor(1.0))  # 1 ulp up in one weight
    w = torch.cat([torch.randn(100, 96, generator=g) * 0.01, w])
    x = torch.randn(7, 96, generator=g)
    x[0] = 0.0  # all logits +0: the first index
    tokens, counts = screened(x, w, lib)
    assert torch.equal(tokens, full_argmax(x, w))
    assert tokens[0] == 0 and counts[0] == w.shape[0]


@pytest.mark.parametrize("a_first", [True, False])
def test_the_winner_survives_when_int8_ranks_it_far_below(lib, a_first):
    """Row A's int8 copy rounds every weight down by 0.49 of a step, row B's up: int8 puts B ahead of A by 92% of
    A's error bound (Cauchy-Schwarz is tight here: constant x, constant rounding), yet A's fp32 logit is larger.
    A bound 10% too small would lose A."""
    k, s = 64, 0.01
    x = torch.ones(2, k)
    a = torch.full((k,), s * 50.49)
    b = torch.full((k,), s * 49.51)
    b[: int(0.9 * k)] = s * 50.51
    a[0] = b[0] = 127 * s  # the largest weight sets both rows' int8 scale to s
    g = torch.Generator().manual_seed(0)
    filler = torch.randn(40, k, generator=g) * s
    w = torch.cat([filler, a[None], b[None]] if a_first else [filler, b[None], a[None]])
    winner = 40 if a_first else 41
    assert int(full_argmax(x[:1], w)) == winner  # A is the fp32 argmax
    tokens, counts = screened(x, w, lib)
    assert tokens.tolist() == [winner, winner]
    assert (counts == 2).all()  # only A and B: the bound is tight enough to drop every filler row


def _quantised_rows(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """cpu_screen.c's quantisation of x to integers in [-levels, levels] (float32 arithmetic): scales [M] and the
    integers [M, K]."""
    amax = np.abs(x).max(axis=1).astype(np.float32)
    s = amax / np.float32(levels)
    inv = np.where(amax > 0, np.float32(levels) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return s, np.clip(np.rint(x * inv[:, None]), -levels, levels)


def test_error_bound_holds_and_is_the_one_the_kernel_applies(lib):
    """With the packed weight's own int8 copy, per-row scales and norms: the float64 approximation is within the
    bound of the native GEMM's fp32 logits for every token, and the kernel recomputes as many tokens as that bound
    leaves (up to a token at the rounding edge)."""
    g = torch.Generator().manual_seed(3)
    m, k, n = 16, 200, 3000
    x = torch.randn(m, k, generator=g)
    x[3] *= 1e-3
    x[4, 7] = 40.0  # an outlier channel: coarse int8 steps for that row
    w = torch.randn(n, k, generator=g) * 0.02
    packed = ScreenWeights(w, lib)
    qw = packed.panels.to(torch.float64).transpose(1, 2).reshape(-1, packed.panels.shape[1] * 4)[:n, :k]
    sw, dw, w2 = (t[:n].double().numpy() for t in (packed.scale, packed.dw, packed.w2))
    sx, qx = _quantised_rows(x.numpy(), lib.tw_screen_x_max())
    x64 = x.double().numpy()
    dx = x64 - sx.astype(np.float64)[:, None] * qx
    approx = sx.astype(np.float64)[:, None] * sw[None] * (qx @ qw.numpy().T)
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    xn = np.linalg.norm(x64, axis=1)
    bound = (sx * np.linalg.norm(qx, axis=1))[:, None] * dw[None] \
        + (np.linalg.norm(dx, axis=1) + (gamma + 2.0 ** -22) * xn)[:, None] * w2[None]
    exact = native_linear(x, pack_weight(w, native_library()), n, None, native_library()).double().numpy()
    assert (np.abs(exact - approx) <= bound).all()
    _, counts = screened(x, w, lib)
    expected = (approx + bound >= (approx - bound).max(axis=1, keepdims=True)).sum(axis=1)
    assert np.abs(counts.numpy() - expected).max() <= 1
    assert expected.max() < n // 10  # a real screen, not everything


@needs_screen
def test_rows_it_cannot_screen_and_weights_it_cannot_pack_give_none():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(50, 32, generator=g)
    screen = GreedyScreen()
    for bad in (float("nan"), float("inf"), 1e30):  # 1e30: products could overflow fp32
        x = torch.randn(3, 32, generator=g)
        x[1, 5] = bad
        assert screen(x, w) is None
    assert screen(torch.randn(2, 32, dtype=torch.float64), w.double()) is None  # fp32 only
    assert screen(torch.randn(2, 31), w) is None  # features do not match
    w_nan = w.clone()
    w_nan[3, 3] = float("nan")
    assert GreedyScreen()(torch.randn(2, 32), w_nan) is None
    assert GreedyScreen().prepack(torch.zeros(4, MAX_FEATURES + 1)) is None  # int32 sums could overflow


@needs_screen
def test_repacks_when_the_weight_changes_in_place():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(300, 64, generator=g), torch.randn(4, 64, generator=g)
    screen = GreedyScreen()
    assert torch.equal(screen(x, w), full_argmax(x, w))
    first = screen.prepack(w)
    w.mul_(-1)
    assert screen.prepack(w) is not first
    assert torch.equal(screen(x, w), full_argmax(x, w))


@needs_screen
def test_tokens_do_not_depend_on_the_batch_or_threads():
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(5000, 128, generator=g) * 0.02, torch.randn(19, 128, generator=g)
    screen = GreedyScreen()
    alone = torch.cat([screen(x[i:i + 1], w) for i in range(19)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = screen(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, screen(x, w)) and torch.equal(alone, two)


def test_without_the_screen_library_it_declines(monkeypatch):
    """No screen in the build (no AVX2, no native library): None, and the engine computes the logits."""
    from kernels import greedy_screen

    monkeypatch.setattr(greedy_screen, "screen_library", lambda: None)
    assert GreedyScreen()(torch.randn(2, 8), torch.randn(10, 8)) is None
