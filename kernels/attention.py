"""Paged attention over one flattened varlen batch (prefill chunks after a cached prefix, and decodes).

q [T, H, D]; query_start_loc int32 [S+1]; seq_lens int32 [S] (context INCLUDING this step's tokens);
block_tables int32 [S, max_blocks]; caches [num_blocks, block_size, Hkv, D] (int8 + float32 scales
[num_blocks, block_size, Hkv] optional). Query token i of seq s sits at position seq_lens[s] - q_len[s] + i and
attends to keys at positions <= its own; query head h reads kv head h // (H // Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # torch reference stays usable without triton
    triton = None


def _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale) -> bool:
    """Validate shapes; return True when the caches are int8."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D]; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, Hkv, {q.shape[2]}]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"need query_start_loc [S+1] and block_tables [S, max_blocks] for S={num_seqs}; got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    quantised = k_cache.dtype == torch.int8
    if quantised and (k_scale is None or v_scale is None or k_scale.shape != k_cache.shape[:3]
                      or v_scale.shape != k_cache.shape[:3]):
        raise ValueError(f"int8 caches need k_scale and v_scale of shape {tuple(k_cache.shape[:3])}")
    return quantised


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, dtype) -> torch.Tensor:
    """Cache rows of `blocks` ([..., nb]) -> [..., nb * block_size, Hkv, D] in `dtype` (dequantised if int8)."""
    x = cache[blocks]
    if scale is not None:
        x = x.float() * scale[blocks].unsqueeze(-1)
    x = x.to(dtype)
    return x.reshape(*blocks.shape[:-1], -1, *cache.shape[2:])


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, *, max_query_len: int | None = None,
                          max_seq_len: int | None = None) -> torch.Tensor:
    """Reference (and CPU fast path): SDPA per prefill sequence, one padded batched SDPA for all decodes.

    max_query_len / max_seq_len are accepted (and ignored) so both backends can be called the same way.
    """
    quantised = _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    if not quantised:
        k_scale = v_scale = None
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads != num_kv_heads
    block_size = k_cache.shape[1]
    # fp16/bf16 SDPA on CPU is slow and less accurate; compute in fp32 there.
    cdtype = torch.float32 if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] stay zero
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    for s, (q_len, seq_len) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len > seq_len:
            raise ValueError(f"sequence {s}: query length {q_len} exceeds seq_len {seq_len}")
    bt = block_tables.long().clamp(0, k_cache.shape[0] - 1)  # padding entries may be -1 or junk
    decodes = [s for s, n in enumerate(q_lens) if n == 1]

    for s, (q_start, q_len, seq_len) in enumerate(zip(starts, q_lens, lens, strict=False)):
        if q_len <= 1:  # decodes are batched below
            continue
        blocks = bt[s, : -(-seq_len // block_size)]
        k = _gather(k_cache, k_scale, blocks, cdtype)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
        v = _gather(v_cache, v_scale, blocks, cdtype)[:seq_len].transpose(0, 1)
        qs = q[q_start: q_start + q_len].to(cdtype).transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # causal with the diagonal shifted by the cached prefix length
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[q_start: q_start + q_len] = o.transpose(0, 1).to(q.dtype)

    if decodes:
        idx = torch.tensor(decodes, device=q.device)
        dec_lens = seq_lens.to(q.device).long()[idx]
        max_len = max(lens[s] for s in decodes)
        blocks = bt[idx, : -(-max_len // block_size)]
        valid = torch.arange(max_len, device=q.device)[None, :] < dec_lens[:, None]  # [Nd, Lmax]
        # Zero keys/values past each context: junk (even NaN) there must not leak through 0 * NaN.
        pad = ~valid[:, :, None, None]
        k = _gather(k_cache, k_scale, blocks, cdtype)[:, :max_len].masked_fill_(pad, 0).transpose(1, 2)
        v = _gather(v_cache, v_scale, blocks, cdtype)[:, :max_len].masked_fill_(pad, 0).transpose(1, 2)
        q_rows = query_start_loc.to(q.device).long()[idx]
        qs = q[q_rows].to(cdtype).unsqueeze(2)  # [Nd, H, 1, D]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=gqa)
        out[q_rows] = o.squeeze(2).to(q.dtype)
    return out


SPLIT_MIN_SEQ_LEN = 1024  # auto split-K only when the longest decode context reaches this
SPLIT_MIN_KEYS = 256  # ... and each partition keeps at least this many keys
SPLIT_MAX = 32  # partitions per sequence; also bounds the partial buffers
PREFILL_BLOCK_M = 64  # rows (query tokens x heads of a GQA group) per program
BLOCK_N = 64  # keys per inner-loop tile (32 for fp32 with head_dim > 64, to fit shared memory)

if triton is not None:

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        sm_scale_log2, num_seqs, num_heads, num_splits, head_dim, block_size,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DECODE_ONLY: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program = one tile of BLOCK_Q query tokens x the GROUP query heads sharing kv head program_id(1),
        over one key partition (program_id(2); the whole causal range unless SPLIT)."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if DECODE_ONLY:
            seq = pid
            q_tile = pid * 0
        else:
            # Tiles of seq s are numbered from qsl[s] // BLOCK_Q + s (an over-count, so no host-side prefix sum):
            # binary-search the last seq whose first tile is <= pid.
            lo = pid * 0
            hi = lo + num_seqs - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
            seq = lo
            q_tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        tile_lo = q_tile * BLOCK_Q
        if tile_lo < q_len:
            rows = tl.arange(0, BLOCK_M)
            tok = tile_lo + rows // GROUP_PAD
            head = kvh * GROUP + rows % GROUP_PAD
            row_ok = (rows // GROUP_PAD < BLOCK_Q) & (tok < q_len) & (rows % GROUP_PAD < GROUP)
            d = tl.arange(0, BLOCK_D)
            d_ok = d < head_dim
            q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
            q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            q_pos = seq_len - q_len + tok
            kv_lo = 0
            kv_hi = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, tile_lo + BLOCK_Q))
            if SPLIT:
                part = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
                kv_lo = split * part
                kv_hi = tl.minimum(kv_hi, kv_lo + part)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
            for start in range(kv_lo, kv_hi, BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)
                k_ok = k_pos < kv_hi
                page = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
                slot = page * stride_cb + (k_pos % block_size) * stride_co + kvh * stride_ch
                kv_mask = k_ok[:, None] & d_ok[None, :]
                k = tl.load(kc_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
                v = tl.load(vc_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                if QUANT:
                    sc_off = page * stride_sb + (k_pos % block_size) * stride_so + kvh * stride_sh
                    qk = qk * tl.load(ks_ptr + sc_off, mask=k_ok, other=0.0)[None, :]
                qk = qk * sm_scale_log2
                qk = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
                p = tl.exp2(qk - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if QUANT:
                    p = p * tl.load(vs_ptr + sc_off, mask=k_ok, other=0.0)[None, :]
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
                m_i = m_new
            if SPLIT:
                base = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + split
                tl.store(part_m_ptr + base, m_i, mask=row_ok)
                tl.store(part_l_ptr + base, l_i, mask=row_ok)
                tl.store(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
            else:
                o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _split_reduce_kernel(out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, num_heads, num_splits, head_dim,
                             stride_ot, stride_oh, SPLIT_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
        """Merge the partitions of one (token, head): rescale each partial sum to the global max."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLIT_PAD)
        d = tl.arange(0, BLOCK_D)
        sp_ok = sp < num_splits
        base = (t.to(tl.int64) * num_heads + h) * num_splits + sp
        m = tl.load(part_m_ptr + base, mask=sp_ok, other=float("-inf"))
        part_l = tl.load(part_l_ptr + base, mask=sp_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        l_sum = tl.sum(part_l * w, 0)
        o = tl.load(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
        o = tl.sum(o * w[:, None], 0)
        o = tl.where(l_sum > 0, o / tl.where(l_sum > 0, l_sum, 1.0), 0.0)  # uncovered tokens stay 0
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
                 mask=d < head_dim)


def _auto_num_splits(q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seq_len: int | None,
                     seq_lens: torch.Tensor) -> int:
    """Split-K for decode when (seqs x kv heads) programs leave most SMs idle and contexts are long."""
    if q.device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    return max(1, min(SPLIT_MAX, triton.cdiv(2 * num_sms, programs), max_seq_len // SPLIT_MIN_KEYS))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           *, max_query_len: int | None = None, max_seq_len: int | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton paged attention: flash-style online softmax over paged key tiles, GQA heads packed into rows.

    max_query_len / max_seq_len are optional hints that avoid a device sync. num_splits forces the split-K
    (flash-decoding) path when > 1; by default it is chosen for decode-only batches with few, long sequences.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs the 'triton' package")
    quantised = _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    out = torch.zeros_like(q)  # rows past query_start_loc[-1] stay zero
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_attention_triton needs unit stride on head_dim and identically strided k/v caches")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    decode_only = max_query_len <= 1
    if num_splits is None:
        num_splits = _auto_num_splits(q, num_seqs, num_kv_heads, max_seq_len, seq_lens) if decode_only else 1
    if not 1 <= num_splits <= SPLIT_MAX:
        raise ValueError(f"num_splits={num_splits} must be in [1, {SPLIT_MAX}]")

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = BLOCK_N // 2 if q.dtype == torch.float32 and block_d > 64 else BLOCK_N
    if decode_only:
        block_q, block_m, num_tiles = 1, max(16, group_pad), num_seqs
    else:
        block_m = max(PREFILL_BLOCK_M, group_pad)
        block_q = block_m // group_pad
        num_tiles = num_tokens // block_q + num_seqs
    split = num_splits > 1
    if split:
        part_m = torch.full((num_tokens, num_heads, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
        part_l = torch.zeros_like(part_m)
        part_o = torch.empty((num_tokens, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out  # unused
    ks, vs = (k_scale, v_scale) if quantised else (k_cache, v_cache)  # dummies when not quantised
    if quantised and v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale must have identical strides")
    _paged_attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, query_start_loc,
        out, part_m, part_l, part_o,
        scale * 1.4426950408889634, num_seqs, num_heads, num_splits, head_dim, k_cache.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DECODE_ONLY=decode_only, SPLIT=split, QUANT=quantised,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    if split:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_o, num_heads, num_splits, head_dim, out.stride(0), out.stride(1),
            SPLIT_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
