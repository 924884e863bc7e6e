"""MoE grouped GEMM: the torch reference and the Triton kernel against a naive per-row float64 product (ragged and
empty expert segments, K and N off the tile sizes, the SiLU-and-mul epilogue), the routing helper's invariants, and
its round trip (route, permute, gate_up, down, combine) against a dense per-token MoE loop."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernels.grouped_gemm import GG_CONFIGS, grouped_gemm_torch, grouped_gemm_triton, route_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 16-bit results are rounded once to the output dtype (and the reference rounds the gate_up product before its
# SiLU); fp32 differs only by the order of accumulation
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.int64).cumsum(0).to(torch.int32)


def _inputs(counts: list[int], N: int, K: int, dtype: torch.dtype, device: str, seed: int = 0):
    """x [sum(counts), K] ~ N(0, 1), w [E, N, K] ~ N(0, 1 / K) (outputs of order 1), the offsets."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GPU shapes are big
    x = torch.randn(sum(counts), K, generator=g, device=device).to(dtype)
    w = (torch.randn(len(counts), N, K, generator=g, device=device) / K**0.5).to(dtype)
    return x, _offsets(counts).to(device), w


def _naive(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
    """One row at a time against its own expert's weight (found by a search of the offsets), in float64."""
    w64, bounds = w.double(), offsets.tolist()
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for r in range(x.shape[0]):
        e = next(e for e in range(w.shape[0]) if bounds[e] <= r < bounds[e + 1])
        y[r] = w64[e] @ x[r].double()
    if silu_and_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def _float64_reference(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, silu_and_mul: bool) -> torch.Tensor:
    """The per-expert loop in float64: the truth at GPU shapes, where a loop over rows would take minutes."""
    y = grouped_gemm_torch(x.double(), offsets, w.double())
    if silu_and_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref.double().abs().max().item()) if ref.numel() else 1.0
    assert err <= TOL[dtype] * scale, (err, scale)


def _check(counts, N, K, dtype, silu_and_mul, device=DEVICE, seed=0, exact=_naive, **kwargs):
    """Triton and the torch reference each against the float64 ``exact`` product, and against each other."""
    x, offsets, w = _inputs(counts, 2 * N if silu_and_mul else N, K, dtype, device, seed)
    ref = exact(x, offsets, w, silu_and_mul)
    out = grouped_gemm_triton(x, offsets, w, silu_and_mul, **kwargs)
    torch_out = grouped_gemm_torch(x, offsets, w, silu_and_mul)
    _assert_close(out, ref, dtype)
    _assert_close(torch_out, ref, dtype)
    _assert_close(out, torch_out.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_torch_reference_matches_naive(dtype, silu_and_mul):
    """Empty experts first, last and between; a 1-row and a long segment."""
    counts = [0, 5, 0, 0, 1, 37, 0]
    x, offsets, w = _inputs(counts, 24, 40, dtype, "cpu")
    _assert_close(grouped_gemm_torch(x, offsets, w, silu_and_mul), _naive(x, offsets, w, silu_and_mul), dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_triton_matches_references(dtype, silu_and_mul):
    """Row tiles at a segment's end, one expert over several tiles, N and K off the tile sizes."""
    _check([0, 70, 3, 0, 17, 0], 72, 100, dtype, silu_and_mul)


@pytest.mark.interpreter
@given(counts=st.lists(st.one_of(st.just(0), st.integers(1, 20), st.integers(21, 90)), min_size=1, max_size=8),
       N=st.integers(1, 80), K=st.integers(1, 130), silu_and_mul=st.booleans(), fp16=st.booleans(),
       seed=st.integers(0, 99))
def test_triton_matches_references_property(counts, N, K, silu_and_mul, fp16, seed):
    """E in 1..8 with empty, short and long segments (T from 0 to a few hundred), any N and K."""
    _check(counts, N, K, torch.float16 if fp16 else torch.float32, silu_and_mul, seed=seed)


@given(counts=st.lists(st.integers(0, 300), min_size=1, max_size=256),
       block_m=st.sampled_from([16, 32, 64, 128]))
def test_grid_bound_covers_every_row_tile(counts, block_m):
    """The launch sizes its grid as T // BLOCK_M + min(E, T) row tiles; the experts' tiles never need more."""
    T = sum(counts)
    assert sum(-(-c // block_m) for c in counts) <= T // block_m + min(len(counts), T)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_forced_block_m(block_m):
    """Other tile heights than the default: a segment over many tiles, another ending mid-tile."""
    _check([130, 0, 33, 1], 40, 48, torch.float32, False, block_m=block_m)


@pytest.mark.interpreter
@pytest.mark.parametrize("block_n,block_k", [(16, 16), (32, 128)])
def test_tile_shapes(monkeypatch, block_n, block_k):
    """Tiles other than the interpreter's default (the first config): several N tiles and K iterations, a K tile
    wider than K."""
    from kernels import grouped_gemm

    monkeypatch.setattr(grouped_gemm, "GG_CONFIGS", ((block_n, block_k, 4, 1), *GG_CONFIGS))
    for silu_and_mul in (False, True):
        _check([9, 0, 40], 50, 70, torch.float16, silu_and_mul)


@pytest.mark.interpreter
def test_strided_inputs_and_empty_batch():
    """A column slice of a wider x, an expert stack stored K-major (w.stride(2) != 1), and T = 0."""
    counts = [3, 0, 20]
    x, offsets, w = _inputs(counts, 24, 40, torch.float32, DEVICE)
    wide = torch.cat([x, x], dim=1)[:, 40:]
    w_kmajor = w.transpose(1, 2).contiguous().transpose(1, 2)
    ref = _naive(x, offsets, w, False)
    for impl in (grouped_gemm_triton, grouped_gemm_torch):
        _assert_close(impl(wide, offsets, w_kmajor), ref, torch.float32)
        empty = impl(x[:0], torch.zeros(4, dtype=torch.int32, device=DEVICE), w, True)
        assert empty.shape == (0, 12) and empty.dtype == torch.float32


def test_bad_inputs_raise():
    x, offsets, w = _inputs([2, 3], 6, 8, torch.float32, "cpu")
    for impl in (grouped_gemm_torch, grouped_gemm_triton):
        with pytest.raises(ValueError, match=r"x \[T, K\] and w \[E, N, K\]"):
            impl(x[:, :4], offsets, w)
        with pytest.raises(ValueError, match="int32"):
            impl(x, offsets.long(), w)
        with pytest.raises(ValueError, match=r"E \+ 1 = 3"):
            impl(x, offsets[:2], w)
        with pytest.raises(ValueError, match="share a dtype"):
            impl(x.half(), offsets, w)
        with pytest.raises(ValueError, match="2F"):
            impl(x, offsets, w[:, :5], True)
    with pytest.raises(ValueError, match="share a device"):  # host offsets suit only the torch loop
        grouped_gemm_triton(x.to("meta"), offsets, w.to("meta"))
    with pytest.raises(ValueError, match="rise from 0 to T=5"):  # the reference reads the offsets anyway
        grouped_gemm_torch(x, torch.tensor([0, 3, 4], dtype=torch.int32), w)
    with pytest.raises(ValueError, match="top_k >= 1"):
        route_tokens(torch.zeros(3, 0, dtype=torch.long), 4)


def _topk(num_tokens: int, top_k: int, num_experts: int, hot: int, seed: int):
    """Router output: top_k distinct experts per token, drawn among the first ``hot`` (the rest stay empty), and
    softmax weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=g)
    scores[:, hot:] = -torch.inf
    weights, ids = scores.topk(top_k, dim=-1)
    return ids, weights.softmax(-1)


@given(num_tokens=st.integers(0, 50), top_k=st.integers(1, 3), extra=st.integers(0, 5), seed=st.integers(0, 99),
       int32=st.booleans())
def test_routing_invariants(num_tokens, top_k, extra, seed, int32):
    num_experts = top_k + extra
    ids, _ = _topk(num_tokens, top_k, num_experts, max(top_k, num_experts - 1), seed)
    ids = ids.int() if int32 else ids
    r = route_tokens(ids, num_experts)
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert r.expert_offsets.dtype == torch.int32 and r.expert_offsets.tolist() == [0, *counts.cumsum(0).tolist()]
    flat = torch.arange(num_tokens * top_k).view(num_tokens, top_k)
    assert torch.equal(r.token_ids[r.inverse], flat // top_k)  # each pair's row holds its token ...
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), counts)
    assert torch.equal(expert_of_row[r.inverse], ids.long())  # ... in its expert's segment
    assert sorted(r.inverse.flatten().tolist()) == list(range(num_tokens * top_k))
    for e in range(num_experts):  # stable: a segment lists its tokens in order
        seg = r.token_ids[r.expert_offsets[e]:r.expert_offsets[e + 1]]
        assert torch.equal(seg, seg.sort().values)


def _dense_moe(x, ids, weights, w13, w2) -> torch.Tensor:
    """The MoE layer one token and one choice at a time, in float64: sum over j of
    weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t, j]."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(gate) * up))
    return out


def _moe(ks_gemm, x, ids, weights, w13, w2, fused: bool) -> torch.Tensor:
    """route -> permute -> gate_up (SiLU-and-mul fused, or after) -> down -> combine."""
    r = route_tokens(ids, w13.shape[0])
    xs = r.permute(x)
    if fused:
        h = ks_gemm(xs, r.expert_offsets, w13, True)
    else:
        gate, up = ks_gemm(xs, r.expert_offsets, w13).float().chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype)
    return r.combine(ks_gemm(h, r.expert_offsets, w2), weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routing_round_trip_torch(dtype):
    ids, weights = _topk(23, 2, 6, 5, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(23, 40, generator=g).to(dtype)
    w13, w2 = (torch.randn(6, 2 * 24, 40, generator=g) / 40**0.5).to(dtype), \
        (torch.randn(6, 40, 24, generator=g) / 24**0.5).to(dtype)
    ref = _dense_moe(x, ids, weights, w13, w2)
    for fused in (False, True):
        _assert_close(_moe(grouped_gemm_torch, x, ids, weights, w13, w2, fused), ref, dtype)


@pytest.mark.interpreter
@given(num_tokens=st.integers(1, 60), top_k=st.integers(1, 3), extra=st.integers(0, 5), d=st.integers(1, 70),
       f=st.integers(1, 40), fp16=st.booleans(), seed=st.integers(0, 99))
def test_routing_round_trip_triton(num_tokens, top_k, extra, d, f, fp16, seed):
    """The whole expert MLP through the Triton kernel (gate_up with the fused epilogue) equals the dense loop; one
    expert stays empty whenever there is a spare."""
    num_experts = top_k + extra
    dtype = torch.float16 if fp16 else torch.float32
    ids, weights = _topk(num_tokens, top_k, num_experts, max(top_k, num_experts - 1), seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, d, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * f, d, generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(num_experts, d, f, generator=g) / f**0.5).to(dtype)
    ref = _dense_moe(x, ids, weights, w13, w2)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = _moe(grouped_gemm_triton, *map(dev, (x, ids, weights, w13, w2)), fused=True)
    _assert_close(out.cpu(), ref, dtype)


# Qwen3-30B-A3B's experts: 128 experts, top 8, hidden 2048, expert intermediate 768
QWEN3_MOE = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 512, 4096])
@pytest.mark.parametrize("proj", ["gate_up", "gate_up_silu", "down"])
def test_triton_gpu_qwen3_moe(num_tokens, proj):
    """Qwen3-30B-A3B's expert projections in bf16 against the per-expert cuBLAS loop, from a decode step (8 rows
    over 128 experts: most empty) to a 4096-token prefill (32768 rows, ~256 per expert)."""
    m = QWEN3_MOE
    ids, _ = _topk(num_tokens, m["top_k"], m["num_experts"], m["num_experts"], seed=num_tokens)
    counts = torch.bincount(ids.flatten(), minlength=m["num_experts"]).tolist()
    N, K = (2 * m["inter"], m["hidden"]) if proj != "down" else (m["hidden"], m["inter"])
    _check(counts, N // 2 if proj == "gate_up_silu" else N, K, torch.bfloat16, proj == "gate_up_silu", "cuda",
           exact=_float64_reference)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_triton_gpu_dtypes_and_ragged(dtype, silu_and_mul):
    """fp32 (full-precision dot) and fp16 at ragged shapes: one expert (BLOCK_E = 1), K and N off every tile, empty
    experts, and 128 experts with a 4096-token prefill's spread."""
    _check([37], 100, 200, dtype, silu_and_mul, "cuda")
    _check([0, 1, 700, 0, 33, 5, 0], 300, 520, dtype, silu_and_mul, "cuda")
    ids, _ = _topk(4096, 8, 128, 128, seed=3)
    _check(torch.bincount(ids.flatten(), minlength=128).tolist(), 256, 512, dtype, silu_and_mul, "cuda",
           exact=_float64_reference)


@pytest.mark.gpu
def test_routing_and_grouped_gemm_in_a_cuda_graph():
    """route_tokens and the kernel wait for nothing on the host: one CUDA graph holds the whole expert MLP and
    replays it on new router choices."""
    m, T = QWEN3_MOE, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    E, d, f = m["num_experts"], m["hidden"], m["inter"]
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(E, 2 * f, d, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5
    w2 = torch.randn(E, d, f, device="cuda", dtype=torch.bfloat16, generator=g) / f**0.5
    scores = torch.randn(T, E, device="cuda", generator=g)
    run = lambda: _moe(grouped_gemm_triton, x, *_topk_cuda(scores, m["top_k"]), w13, w2, fused=True)  # noqa: E731
    run()  # compiles and autotunes outside the capture, as engine/cuda_graphs.py does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    scores.copy_(torch.randn(T, E, device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    _assert_close(out, run().double(), torch.bfloat16)  # eager, on the new choices
    ids, weights = _topk_cuda(scores, m["top_k"])
    ref = _dense_moe(x.cpu(), ids.cpu(), weights.cpu(), w13.cpu(), w2.cpu())
    _assert_close(out.cpu(), ref, torch.bfloat16)


def _topk_cuda(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = scores.topk(top_k, dim=-1)
    return ids, weights.softmax(-1)
