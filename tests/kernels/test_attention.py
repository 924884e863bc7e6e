"""Paged attention: torch reference against dense causal attention in float64; Triton kernel against the reference.

Batches are built here directly (not through store_kv): each sequence's K/V lives contiguously for the dense
reference and is scattered into shuffled cache blocks; every slot no sequence owns is NaN, and block-table
padding is -1, so reading anything outside a sequence's context shows up as NaN.
"""

import math
import os
from dataclasses import dataclass, replace

import pytest
import torch

from kernels.attention import paged_attention_torch, paged_attention_triton

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
