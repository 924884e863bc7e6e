"""The native backend's C ops (kernels.cpu_native): RMSNorm against a float64 formula and the torch reference,
RoPE, the KV store and greedy argmax bit for bit against torch, SiLU-and-mul within a few ulp, decode attention
against dense float64 attention and the torch reference (decode-only and mixed steps, GQA, head sizes off the vector
width, NaN in every slot nobody owns), row (batch) and thread invariance, strided inputs, the fallbacks to torch for
other dtypes, huge-page weight memory, and clear errors for bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.executor import resolve_kernels
from kernels.activation import silu_and_mul_torch
from kernels.attention import paged_attention_torch, plan_attention
from kernels.cpu_native import (
    HUGE_PAGE,
    argmax_rows,
    huge_page_empty,
    native_library,
    paged_attention_native,
    rms_norm_native,
    rope_native,
    silu_and_mul_native,
    store_kv_native,
)
from kernels.kv_store import store_kv_torch
from kernels.norm import rms_norm_torch
from kernels.rope import rope_cos_sin, rope_torch
from tests.kernels.test_attention import Case, dense_attention, make_batch

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


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 5])), min_size=1, max_size=6),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16, 24, 64, 80]),
       block_size=st.sampled_from([4, 16, 12]), seed=st.integers(0, 3))
def test_decode_attention_matches_dense_and_the_reference(seqs, kv_heads, group, head_dim, block_size, seed):
    """Decodes in C, prefill chunks (q_len 5) through the torch path, in one call: against textbook attention in
    float64 and the torch reference. Unowned slots hold NaN, so a read outside a context would show."""
    case = Case(tuple(seqs), heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                dtype=torch.float32)
    b = make_batch(case, seed=seed)
    out = paged_attention_native(*b.args()[:7])
    assert out.shape == b.q.shape and out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_attention(b), rtol=0, atol=2e-6)
    torch.testing.assert_close(out, paged_attention_torch(*b.args()[:7]), rtol=0, atol=2e-6)
    # as the engine calls it: host maxima given, and for steps with a prefill chunk the runner's plan
    q_lens = b.query_start_loc.diff()
    plan = None if q_lens.max() == 1 else plan_attention(b.block_tables, b.seq_lens, b.query_start_loc,
                                                          block_size)
    again = paged_attention_native(*b.args()[:7], max_query_len=int(q_lens.max()),
                                   max_seq_len=int(b.seq_lens.max()), plan=plan)
    assert torch.equal(again, out)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_rows_do_not_depend_on_the_batch(threads):
    """A decode's output bits are the same alone or in a batch, on one thread or two."""
    b = make_batch(Case(((40, 1), (7, 1), (100, 1), (0, 1)), heads=8, kv_heads=2, dtype=torch.float32), seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention_native(*b.args()[:7])
        for s in range(4):
            alone = paged_attention_native(b.q[s:s + 1], b.k_cache, b.v_cache, b.block_tables[s:s + 1],
                                           b.seq_lens[s:s + 1], torch.tensor([0, 1], dtype=torch.int32), b.args()[6])
            assert torch.equal(alone, out[s:s + 1])
    finally:
        torch.set_num_threads(before)


def test_decode_attention_softmax_extremes():
    """Scores far apart (exp underflows for all but one key) and all equal (uniform weights)."""
    b = make_batch(Case(((30, 1),), heads=2, kv_heads=1, dtype=torch.float32), seed=1)
    for q in (b.q * 1e3, b.q * 0):
        b.q = q
        torch.testing.assert_close(paged_attention_native(*b.args()[:7]).double(), dense_attention(b), rtol=0,
                                   atol=2e-5)


def test_decode_attention_fallbacks_and_bad_input():
    b = make_batch(Case(((20, 1), (3, 4)), heads=4, kv_heads=2, dtype=torch.float16), seed=2)
    assert torch.equal(paged_attention_native(*b.args()), paged_attention_torch(*b.args()))  # fp16: the torch path
    b = make_batch(Case(((20, 1), (3, 1)), heads=4, kv_heads=2, dtype=torch.float32, int8=True), seed=2)
    assert torch.equal(paged_attention_native(*b.args()), paged_attention_torch(*b.args()))  # int8 KV: same
    b = make_batch(Case(((20, 1), (3, 1)), heads=4, kv_heads=2, dtype=torch.float32), seed=2)
    args = list(b.args()[:7])
    tables = b.block_tables.clone()
    tables[1, 0] = b.k_cache.shape[0]  # a block id past the cache
    with pytest.raises(ValueError, match=r"sequence 1 .*block id outside \[0, "):
        paged_attention_native(*args[:3], tables, *args[4:])
    with pytest.raises(ValueError, match="sequence 0 has seq_len 999"):
        paged_attention_native(*args[:4], torch.tensor([999, 4], dtype=torch.int32), *args[5:])
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_native(b.q[:, :3], *args[1:])


@given(rows=st.integers(1, 9), n=st.integers(1, 200), levels=st.sampled_from([3, 1000]), strided=st.booleans(),
       special=st.sampled_from(["none", "nan", "-inf", "inf"]), seed=st.integers(0, 5))
def test_argmax_rows_is_torch_max_indices(rows, n, levels, strided, special, seed):
    """Index for index as torch's max(dim=-1).indices: ties (few distinct values) to the first maximum, a NaN
    anywhere wins (its first index), infinities, rows shorter than a vector, strided rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, n + (5 if strided else 0)), generator=g).float()[:, :n]
    if special != "none":
        at = torch.randint(0, n, (rows,), generator=g)
        x[torch.arange(rows), at] = float(special)
        x[0, n - 1] = float(special)
    assert torch.equal(argmax_rows(x), x.max(dim=-1).indices)


def test_argmax_rows_sizes_threads_and_fallbacks():
    x = torch.randn(33, 32000, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(argmax_rows(x), x.max(dim=-1).indices)
    finally:
        torch.set_num_threads(before)
    for y in (x.double(), x.half(), x[0]):  # other dtypes, 1-D: torch itself
        assert torch.equal(argmax_rows(y), y.max(dim=-1).indices)


def test_huge_page_empty_is_an_ordinary_tensor():
    """Big: 2 MiB-aligned, contiguous, and its memory outlives every name but the tensor's own; small: plain."""
    import gc

    t = huge_page_empty((300, 4099), torch.float32)
    assert t.shape == (300, 4099) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.copy_(torch.arange(300 * 4099, dtype=torch.float32).view(300, 4099))
    view = t[7:9]
    del t
    gc.collect()
    assert view[1, 5].item() == 8 * 4099 + 5
    small = huge_page_empty((3, 4), torch.float16)
    assert small.shape == (3, 4) and small.dtype == torch.float16


@given(T=st.integers(1, 70), f=st.integers(1, 100), scale=st.sampled_from([0.1, 3.0, 40.0]), strided=st.booleans(),
       seed=st.integers(0, 3))
def test_silu_and_mul_matches_the_reference(T, f, scale, strided, seed):
    """Within 4 ulp of torch's silu(gate) * up (gates from tiny to past exp's range), with a row stride that is
    not 2F; below -87 a gate's sigmoid is ~1e-38 instead of a denormal, hence the absolute floor."""
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, 2 * f + (3 if strided else 0), generator=g))[:, :2 * f]
    out = silu_and_mul_native(x)
    assert out.shape == (T, f) and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_torch(x), rtol=5e-7, atol=1e-30)


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_and_mul_rows_do_not_depend_on_the_batch(threads):
    x = 4 * torch.randn(100, 2 * 1408, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = silu_and_mul_native(x)
        assert all(torch.equal(silu_and_mul_native(x[i:i + 1]), out[i:i + 1]) for i in (0, 63, 99))
    finally:
        torch.set_num_threads(before)
    for dtype in (torch.float16, torch.bfloat16):  # the torch path
        assert torch.equal(silu_and_mul_native(x.to(dtype)), silu_and_mul_torch(x.to(dtype)))
    with pytest.raises(ValueError, match=r"x must be \[T, 2F\]"):
        silu_and_mul_native(x[:, :7])


def test_store_kv_is_the_reference_and_rejects_bad_slots():
    """Bit for bit the torch store (v a view of a fused projection, -1 padding skipped); a slot past the cache
    raises before anything is written; int8 caches take the torch path."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.zeros(10, 4, 2, 8), torch.zeros(10, 4, 2, 8)
    ref_k, ref_v = kc.clone(), vc.clone()
    k = torch.randn(6, 2, 8, generator=g)
    v = torch.randn(6, 50, generator=g)[:, 10:26].view(6, 2, 8)
    slots = torch.tensor([3, 7, -1, 39, 0, 12])
    store_kv_native(k, v, kc, vc, slots)
    store_kv_torch(k, v, ref_k, ref_v, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    before = kc.clone()
    with pytest.raises(IndexError, match="slot 40 of token 2 is outside the cache's 40 slots"):
        store_kv_native(k, v, kc, vc, torch.tensor([1, 2, 40, 3, 4, 5]))
    with pytest.raises(IndexError, match="slot -2 of token 0"):
        store_kv_native(k, v, kc, vc, torch.tensor([-2, 2, 4, 3, 4, 5]))
    assert torch.equal(kc, before)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        store_kv_native(k, v, kc, vc, slots[:2])
    scales = [torch.zeros(10, 4, 2) for _ in range(4)]
    q8 = [torch.zeros(10, 4, 2, 8, dtype=torch.int8) for _ in range(4)]
    store_kv_native(k, v, q8[0], q8[1], slots, scales[0], scales[1])
    store_kv_torch(k, v, q8[2], q8[3], slots, scales[2], scales[3])
    assert all(torch.equal(a, b) for a, b in ((q8[0], q8[2]), (q8[1], q8[3]), (scales[0], scales[2])))
