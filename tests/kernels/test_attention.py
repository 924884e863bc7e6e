"""Paged attention: torch reference against dense causal attention in float64; Triton kernel against the reference.

Batches are built here directly (not through store_kv): each sequence's K/V lives contiguously for the dense
reference and is scattered into shuffled cache blocks; every slot no sequence owns is NaN, and block-table
padding is -1, so reading anything outside a sequence's context shows up as NaN.
"""

import math
import os
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import DecodeCache, paged_attention_torch, paged_attention_triton, plan_attention

INTERP = [pytest.mark.interpreter,
          pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


@dataclass(frozen=True)
class Case:
    seqs: tuple[tuple[int, int], ...]  # (cached context before this step, query tokens this step)
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    num_splits: int | None = None
    int8: bool = False


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    keys: list  # per seq [L, Hkv, D] float64 (what the cache holds, dequantised)
    values: list
    raw_keys: list  # per seq [L, Hkv, D] float64 before int8 quantisation
    raw_values: list

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                1 / math.sqrt(self.q.shape[-1]), self.k_scale, self.v_scale)


def _quantise(x):
    """Per (token, head) symmetric int8, written independently of kernels.kv_store."""
    scale = x.abs().amax(-1) / 127
    return torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8), scale.float()


def make_batch(case: Case, device="cpu", seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = case.block_size, case.kv_heads, case.head_dim
    lens = [ctx + n for ctx, n in case.seqs]
    blocks_per_seq = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 2  # padded rows
    block_tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    cache_dtype = torch.int8 if case.int8 else case.dtype
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan")) if not case.int8 else \
        torch.randint(-127, 128, (num_blocks, bs, hkv, d), generator=g, dtype=torch.int8)
    v_cache = k_cache.clone()
    k_scale = torch.full((num_blocks, bs, hkv), float("nan")) if case.int8 else None
    v_scale = k_scale.clone() if case.int8 else None
    keys, values, raw_keys, raw_values = [], [], [], []
    for s, n in enumerate(lens):
        owned = [perm.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        raw_keys.append(k.double())
        raw_values.append(v.double())
        pos = torch.arange(n)
        blk, off = torch.tensor(owned)[pos // bs], pos % bs
        if case.int8:
            (kq, ks), (vq, vs) = _quantise(k), _quantise(v)
            k_cache[blk, off], v_cache[blk, off], k_scale[blk, off], v_scale[blk, off] = kq, vq, ks, vs
            keys.append(kq.double() * ks.double()[..., None])
            values.append(vq.double() * vs.double()[..., None])
        else:
            k, v = k.to(case.dtype), v.to(case.dtype)
            k_cache[blk, off], v_cache[blk, off] = k.float(), v.float()
            keys.append(k.double())
            values.append(v.double())
    q_lens = [n for _, n in case.seqs]
    q = torch.randn(sum(q_lens), case.heads, d, generator=g).to(case.dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return Batch(q.to(device), k_cache.to(cache_dtype).to(device), v_cache.to(cache_dtype).to(device),
                 block_tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), qsl.to(device),
                 to(k_scale), to(v_scale), keys, values, raw_keys, raw_values)


def dense_attention(batch: Batch, keys=None, values=None) -> torch.Tensor:
    """Textbook causal softmax attention per sequence on contiguous float64 K/V."""
    keys, values = keys or batch.keys, values or batch.values
    q = batch.q.cpu().double()
    group = q.shape[1] // keys[0].shape[1]
    starts = batch.query_start_loc.tolist()
    out = torch.zeros_like(q)
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        qs = q[starts[s]: starts[s + 1]]
        k = keys[s].repeat_interleave(group, dim=1)
        v = values[s].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) / math.sqrt(q.shape[-1])
        q_pos = torch.arange(seq_len - qs.shape[0], seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[starts[s]: starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


REFERENCE_CASES = [
    Case(((0, 37), (20, 13), (40, 1), (70, 1), (0, 1), (16, 16)), heads=8, kv_heads=2, dtype=torch.float32),
    Case(((0, 37), (20, 13), (40, 1), (70, 1)), heads=4, kv_heads=4, head_dim=128, dtype=torch.float16),
    Case(((5, 11), (0, 1)), heads=8, kv_heads=1, block_size=8, dtype=torch.bfloat16),
    Case(((33, 1), (9, 1), (64, 1)), heads=4, kv_heads=1, dtype=torch.float32),  # decode only
    Case(((0, 40), (3, 5), (0, 1), (47, 1)), heads=4, kv_heads=2, dtype=torch.float32, int8=True),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=range(len(REFERENCE_CASES)))
def test_torch_reference_matches_dense(case):
    batch = make_batch(case)
    out = paged_attention_torch(*batch.args())
    assert out.dtype == case.dtype and out.shape == batch.q.shape
    tol = TOL[case.dtype] if case.dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=0, atol=tol)


def test_int8_within_quantisation_bound():
    """int8 KV against the unquantised dense result, within a bound derived from the quantisation error:
    |out - out'| <= max|dV| + (exp(2 max|dScore|) - 1) max|V| (softmax ratios move by at most exp(2 dScore))."""
    case = Case(((0, 24), (30, 6), (50, 1)), heads=4, kv_heads=2, dtype=torch.float32, int8=True)
    batch = make_batch(case)
    exact = dense_attention(batch, batch.raw_keys, batch.raw_values)
    err = (paged_attention_torch(*batch.args()).double() - exact).abs().max().item()
    starts, scale = batch.query_start_loc.tolist(), 1 / math.sqrt(case.head_dim)
    group = case.heads // case.kv_heads
    d_score = scale * max(
        torch.einsum("qhgd,khd->qhgk", batch.q[starts[s]: starts[s + 1]].double().unflatten(1, (-1, group)),
                     batch.raw_keys[s] - batch.keys[s]).abs().max().item()
        for s in range(len(case.seqs)))
    d_v = max((a - b).abs().max().item() for a, b in zip(batch.raw_values, batch.values, strict=True))
    max_v = max(v.abs().max().item() for v in batch.raw_values)
    bound = d_v + math.expm1(2 * d_score) * max_v
    assert 0 < err <= bound, (err, bound)


def test_bad_inputs_raise():
    batch = make_batch(Case(((0, 3),), heads=3, kv_heads=2, dtype=torch.float32))
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_torch(*batch.args())
    batch = make_batch(Case(((0, 3),), dtype=torch.float32))
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_torch(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc[:1], 0.1)
    batch = make_batch(Case(((0, 3),), dtype=torch.float32, int8=True))
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                               batch.query_start_loc, 0.1)


F16, F32 = torch.float16, torch.float32
TRITON_CASES = {
    "mixed_gqa4": Case(((0, 37), (20, 13), (40, 1), (5, 1)), heads=4, kv_heads=1),
    "mixed_gqa1_d128_fp32": Case(((3, 20), (0, 1), (31, 1), (15, 2)), heads=2, kv_heads=2, head_dim=128, dtype=F32),
    "prefill_only_gqa8": Case(((0, 16), (16, 17), (7, 9)), heads=8, kv_heads=1),
    "decode_only_d128": Case(((99, 1), (15, 1), (0, 1)), heads=4, kv_heads=1, head_dim=128),
    "decode_only_split3": Case(((99, 1), (15, 1), (0, 1)), heads=4, kv_heads=1, head_dim=128, num_splits=3),
    "one_long_decode_split4_gqa8": Case(((200, 1),), heads=8, kv_heads=1, dtype=F32, num_splits=4),
    "one_prefill_mid_block": Case(((9, 33),), heads=2, kv_heads=1, block_size=8, dtype=F32),
    "mixed_split2": Case(((4, 20), (60, 1)), heads=4, kv_heads=2, num_splits=2),
    "block32_gqa8_d128": Case(((0, 65), (31, 1)), heads=8, kv_heads=1, head_dim=128, block_size=32, dtype=F32),
    "int8_mixed": Case(((0, 24), (30, 6), (50, 1)), heads=4, kv_heads=1, int8=True),
    "int8_decode_split2_fp32": Case(((90, 1), (3, 1)), heads=4, kv_heads=2, dtype=F32, int8=True, num_splits=2),
    # block table read once per tile: pages larger than a tile, and a block size that is no power of two
    "block128_mixed": Case(((150, 20), (0, 70), (130, 1)), heads=4, kv_heads=2, block_size=128, dtype=F32),
    "block128_int8_split2": Case(((200, 3), (70, 1)), heads=4, kv_heads=1, block_size=128, int8=True, num_splits=2),
    "block12_mixed": Case(((30, 9), (50, 1)), heads=4, kv_heads=2, block_size=12, dtype=F32),
    # whole key tiles before the diagonal skip the causal mask; chunks after a long prefix, split too
    "long_prefix_chunks_split3": Case(((170, 40), (64, 64), (5, 1)), heads=8, kv_heads=2, num_splits=3),
}


def _triton_params():
    params = []
    for name, case in TRITON_CASES.items():
        params.append(pytest.param("cpu", case, id=f"cpu-{name}", marks=INTERP))
        params.append(pytest.param("cuda", case, id=f"cuda-{name}", marks=pytest.mark.gpu))
        if case.dtype == F16:  # the interpreter cannot do bf16 arithmetic; GPUs can
            params.append(pytest.param("cuda", replace(case, dtype=torch.bfloat16), id=f"cuda-bf16-{name}",
                                       marks=pytest.mark.gpu))
    return params


@pytest.mark.parametrize(("device", "case"), _triton_params())
def test_triton_matches_torch(device, case):
    batch = make_batch(case, device)
    args = batch.args()
    out = paged_attention_triton(*args, num_splits=case.num_splits)
    assert out.dtype == case.dtype and out.shape == batch.q.shape
    # Reference in fp32 (same int8 cache when quantised) so the tolerance measures the kernel's rounding only.
    up = lambda x: x.float() if x.dtype != torch.int8 else x  # noqa: E731
    ref = paged_attention_torch(batch.q.float(), up(batch.k_cache), up(batch.v_cache), *args[3:])
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=TOL[case.dtype])
    # the hints must not change the result
    q_lens = [n for _, n in case.seqs]
    hinted = paged_attention_triton(*args, num_splits=case.num_splits, max_query_len=max(q_lens),
                                    max_seq_len=int(batch.seq_lens.max()))
    torch.testing.assert_close(hinted, out, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_long_context_gpu(dtype):
    """Realistic sizes: 8 decodes at ~2k context, Llama-8B heads; auto split-K vs no split vs the reference."""
    case = Case(tuple((2000 + 37 * i, 1) for i in range(8)), heads=32, kv_heads=8, head_dim=128, dtype=dtype)
    batch = make_batch(case, "cuda")
    ref = paged_attention_torch(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), *batch.args()[3:])
    for splits in (None, 1, 8):
        out = paged_attention_triton(*batch.args(), num_splits=splits)
        torch.testing.assert_close(out.float(), ref, rtol=0, atol=TOL[dtype])


# --- the torch path's per-step plan, this step's k/v, and the DecodeCache ---------------------------------------

PLAN_CASES = [
    # three fresh prompts of one length (one batched SDPA), two alike chunks after a prefix, padded decodes
    Case(((0, 8), (0, 8), (0, 8), (4, 8), (4, 8), (30, 1), (10, 1)), heads=8, kv_heads=2, dtype=torch.float32),
    Case(((0, 37), (20, 13), (40, 1), (70, 1)), heads=4, kv_heads=4, head_dim=128, dtype=torch.float16),
    Case(((0, 40), (3, 5), (0, 1), (47, 1)), heads=4, kv_heads=2, dtype=torch.float32, int8=True),
]


def _step_kv(batch: Batch, case: Case, raw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys / values [T, Hkv, D] in the model dtype, as the engine hands them to attention."""
    keys, values = (batch.raw_keys, batch.raw_values) if raw else (batch.keys, batch.values)
    k = torch.cat([keys[s][ctx:] for s, (ctx, _) in enumerate(case.seqs)]).to(case.dtype)
    v = torch.cat([values[s][ctx:] for s, (ctx, _) in enumerate(case.seqs)]).to(case.dtype)
    return k, v


@pytest.mark.parametrize("case", PLAN_CASES, ids=range(len(PLAN_CASES)))
def test_shared_plan_and_step_kv_match_dense(case):
    """One plan reused by two calls ("layers"), with this step's k/v given, equals the dense reference; for int8
    the unquantised k/v must be ignored (attention reads what the cache holds)."""
    batch = make_batch(case)
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, case.block_size)
    k, v = _step_kv(batch, case, raw=True)
    tol = TOL[case.dtype] if case.dtype != torch.float32 else 1e-5
    for _ in range(2):
        out = paged_attention_torch(*batch.args(), plan=plan, k=k, v=v)
        torch.testing.assert_close(out.double(), dense_attention(batch), rtol=0, atol=tol)
    if case is PLAN_CASES[0]:  # alike consecutive prefills share one SDPA
        assert [(g.num_seqs, g.q_len, g.seq_len) for g in plan.prefills] == [(3, 8, 8), (2, 8, 12)]


def test_plan_and_step_kv_are_validated():
    case = Case(((0, 5), (3, 1)), dtype=torch.float32)
    batch = make_batch(case)
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 8)
    with pytest.raises(ValueError, match="block_size 8"):
        paged_attention_torch(*batch.args(), plan=plan)
    k, v = _step_kv(batch, case, raw=False)
    with pytest.raises(ValueError, match=r"k and v must be \[T, Hkv, D\]"):
        paged_attention_torch(*batch.args(), k=k[:-1], v=v[:-1])
    bad = replace(batch, seq_lens=torch.tensor([4, 4], dtype=torch.int32))  # 5 query tokens, 4 in context
    with pytest.raises(ValueError, match="sequence 0: query length 5 exceeds seq_len 4"):
        paged_attention_torch(*bad.args())


def _decode_steps(schedule: list[list[int]], lengths: list[int], int8: bool, seed: int = 0,
                  plan_only: frozenset[int] = frozenset()):
    """Run decode steps over one paged cache with a DecodeCache. ``schedule[i]`` lists the sequences decoding at
    step i, in batch order; each decode appends one token to its sequence. Steps in ``plan_only`` store their
    tokens and build a plan that no layer runs. Yields per run step (output, dense float64 reference, cache)."""
    g = torch.Generator().manual_seed(seed)
    bs, hkv, heads, d = 4, 2, 4, 16
    steps_per_seq = [sum(s in step for step in schedule) for s in range(len(lengths))]
    blocks_per_seq = [-(-(n + k) // bs) for n, k in zip(lengths, steps_per_seq, strict=True)]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(nb)] for nb in blocks_per_seq]
    shape = (num_blocks, bs, hkv, d)
    if int8:
        k_cache, v_cache = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2))
        k_scale, v_scale = torch.full(shape[:3], float("nan")), torch.full(shape[:3], float("nan"))
    else:
        k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        k_scale = v_scale = None
    keys = [[] for _ in lengths]
    values = [[] for _ in lengths]

    def write(s: int) -> None:  # the next token of sequence s, written as store_kv would
        pos = len(keys[s])
        blk, off = tables[s][pos // bs], pos % bs
        kt, vt = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
        if int8:
            (kq, ks), (vq, vs) = _quantise(kt), _quantise(vt)
            k_cache[blk, off], v_cache[blk, off], k_scale[blk, off], v_scale[blk, off] = kq, vq, ks, vs
            kt, vt = kq.double() * ks.double()[:, None], vq.double() * vs.double()[:, None]
        else:
            k_cache[blk, off], v_cache[blk, off] = kt, vt
        keys[s].append(kt.double())
        values[s].append(vt.double())

    for s, n in enumerate(lengths):
        for _ in range(n):
            write(s)
    dc = DecodeCache(bytes_per_token=2 * hkv * d * 4)
    for n_step, step in enumerate(schedule):
        for s in step:
            write(s)
        width = max(len(tables[s]) for s in step)
        bt = torch.full((len(step), width), -1, dtype=torch.int32)
        for i, s in enumerate(step):
            bt[i, :len(tables[s])] = torch.tensor(tables[s], dtype=torch.int32)
        seq_lens = torch.tensor([len(keys[s]) for s in step], dtype=torch.int32)
        qsl = torch.arange(len(step) + 1, dtype=torch.int32)
        q = torch.randn(len(step), heads, d, generator=g)
        plan = plan_attention(bt, seq_lens, qsl, bs, dc)
        if n_step in plan_only:
            continue
        args = (q, k_cache, v_cache, bt, seq_lens, qsl, d ** -0.5, k_scale, v_scale)
        outs = [paged_attention_torch(*args, plan=plan) for _ in range(2)]  # two "layers" on one cache
        assert torch.equal(outs[0], outs[1])
        ref = Batch(q, k_cache, v_cache, bt, seq_lens, qsl, k_scale, v_scale,
                    [torch.stack(keys[s]) for s in step], [torch.stack(values[s]) for s in step], [], [])
        yield outs[0], dense_attention(ref), dc


def test_decode_cache_appends_and_rebuilds_exactly():
    """Stable batches append (no gather), a longer run outgrows the capacity, a dropped or reordered sequence
    rebuilds, and so does a layer that missed a step; every step equals dense attention, with NaN in every unowned
    slot."""
    schedule = [[0, 1, 2]] * 6 + [[0, 2]] * 3 + [[2, 0]] * 2 + [[0, 1, 2]] * 40
    for int8 in (False, True):
        caches = []
        for out, ref, dc in _decode_steps(schedule, [5, 12, 1], int8, plan_only=frozenset({4, 20})):
            torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
            caches.append(dc)
        assert caches[-1].appends >= 40 and caches[-1].rebuilds >= 5


@settings(max_examples=15)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True), min_size=1, max_size=12),
       st.lists(st.integers(1, 9), min_size=4, max_size=4))
def test_decode_cache_any_schedule_matches_dense(schedule, lengths):
    for out, ref, _ in _decode_steps(schedule, lengths, int8=False):
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_decode_cache_too_big_gathers_instead():
    dc = DecodeCache(bytes_per_token=1 << 20, max_bytes=8 << 20)  # room for 8 tokens
    a = lambda x: np.array(x, dtype=np.int64)  # noqa: E731
    assert dc.advance(a([3, 3]), a([[0], [1]]), 4) is None and dc.capacity == 0
    assert dc.advance(a([2]), a([[0]]), 4) is False and dc.capacity >= 3
    assert dc.advance(a([3]), a([[0, -1]]), 4) is True  # junk past the blocks in use does not matter
    assert dc.advance(a([4]), a([[1]]), 4) is False  # other blocks: a different sequence
