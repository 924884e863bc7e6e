"""Paged attention over one flattened varlen batch (prefill chunks after a cached prefix, and decodes).

q [T, H, D]; query_start_loc int32 [S+1]; seq_lens int32 [S] (context INCLUDING this step's tokens);
block_tables int32 [S, max_blocks]; caches [num_blocks, block_size, Hkv, D] (int8 + float32 scales
[num_blocks, block_size, Hkv] optional). Query token i of seq s sits at position seq_lens[s] - q_len[s] + i and
attends to keys at positions <= its own; query head h reads kv head h // (H // Hkv).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # torch reference stays usable without triton
    triton = None
    _attn_launch = _paged_attn_kernel = None


def check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale) -> bool:
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


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype) -> torch.Tensor:
    """Cache rows at `slots` (int64 [n]) -> [n, Hkv, D] in `dtype` (dequantised if int8)."""
    x = cache.flatten(0, 1).index_select(0, slots)  # a view of the cache when it is contiguous, as the store needs
    if scale is not None:
        x = x.float() * scale.flatten(0, 1).index_select(0, slots).unsqueeze(-1)
    return x.to(dtype)


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Consecutive sequences with the same query length (> 1) and context length, attended in one batched SDPA."""

    q_start: int  # first query row of the group; its sequences' rows follow each other
    num_seqs: int
    q_len: int
    seq_len: int
    slots: torch.Tensor  # int64 [num_seqs * seq_len]: cache slot of every context position
    mask: torch.Tensor | None  # bool [q_len, seq_len], causal shifted by the cached prefix; None: no prefix


DECODE_CACHE_HEADROOM = 32  # most tokens a rebuilt DecodeCache leaves each sequence to grow into
DECODE_CACHE_MAX_BYTES = 32 << 20  # per layer (K and V); bigger decode batches gather every step instead


class DecodeCache:
    """Contiguous copies [Nd, Hkv, capacity, D] of the decoding sequences' K/V, kept from one step to the next.

    Paged decode attention gathers every sequence's whole context out of its blocks, in every layer and step, and
    on CPU that copy costs about as much as the attention itself. When a step decodes the same sequences as the
    previous step, in the same order, each one token longer and on the same blocks, the copies only lack the token
    just stored: appending it replaces the gather. Any other step rebuilds the copies from the paged cache (the
    blocks stay the truth; this is a cache of them). Owned by one runner; its plans carry it to every layer.
    """

    def __init__(self, bytes_per_token: int, max_bytes: int = DECODE_CACHE_MAX_BYTES) -> None:
        """``bytes_per_token``: one token's K and V in one layer, in the dtype attention computes in."""
        self.max_tokens = max_bytes // bytes_per_token
        # k_cache.data_ptr() -> (K, V, step): a layer's copies and the step they are up to date with
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.step = 0  # counts plans; a layer appends only onto copies it brought up to date one step earlier
        self.lens = self.tables = np.zeros((0, 0), dtype=np.int64)  # the last step's decodes: lengths, blocks
        self.capacity = 0
        self.run = 0  # steps appended since the last rebuild
        self.appends = self.rebuilds = 0  # totals, for tests and benchmarks
        self.owners: tuple = ()  # who the copies belong to (the runner's request ids), see ``claim``

    def claim(self, owners: tuple) -> None:
        """Name the sequences this step decodes. Lengths and blocks alone cannot tell a new sequence from the
        last step's one token longer (a new request can get a finished one's blocks back): other owners force a
        rebuild."""
        if owners != self.owners:
            self.owners = owners
            self.lens = self.tables = np.zeros((0, 0), dtype=np.int64)

    def advance(self, lens: np.ndarray, tables: np.ndarray, block_size: int) -> bool | None:
        """Record this step's decodes: int64 context lengths [Nd] and block-table rows [Nd, W]. True: append to
        the copies, False: rebuild them (capacity updated), None: too big to keep, gather instead."""
        prev_lens, prev_tables, self.lens, self.tables = self.lens, self.tables, lens, tables
        self.step += 1
        if len(prev_lens) == len(lens) and lens.max() <= self.capacity and (lens == prev_lens + 1).all():
            w = min(prev_tables.shape[1], tables.shape[1])
            held = np.arange(w)[None, :] < -(-prev_lens[:, None] // block_size)  # blocks of the last context
            if ((tables[:, :w] == prev_tables[:, :w]) | ~held).all():
                self.run += 1
                self.appends += 1
                return True
        self.layers.clear()
        # Room to grow, sized on how long the last batch lasted: a batch that changes every step gathers little
        # more than its contexts; a stable one rebuilds every DECODE_CACHE_HEADROOM steps.
        self.capacity = int(lens.max()) + min(DECODE_CACHE_HEADROOM, 2 * self.run + 2)
        self.run = 0
        if len(lens) * self.capacity > self.max_tokens:
            self.capacity = 0
            return None
        self.rebuilds += 1
        return False


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """paged_attention_torch's work split for one step. It depends only on the step's metadata, not on the layer,
    so the engine builds it once per step (plan_attention) and every layer reuses it."""

    block_size: int
    num_tokens: int  # query_start_loc[-1]; output rows past it stay zero
    prefills: tuple[PrefillGroup, ...]
    decode_rows: torch.Tensor | None  # int64 [Nd]: the query row of each single-token sequence
    decode_slots: torch.Tensor | None  # int64 [Nd * width]; padding repeats the sequence's first slot (finite data)
    decode_mask: torch.Tensor | None  # bool [Nd, 1, 1, Lmax]: True on real context positions; None: no padding
    all_decode: bool  # every sequence decodes, rows in order: the decode output is the whole output
    decode_len: int = 0  # Lmax, the longest decode context; width is Lmax, or the DecodeCache capacity
    decode_cache: DecodeCache | None = None
    decode_append: torch.Tensor | None = None  # int64 [2, Nd]: DecodeCache (sequence, position) of each new token
    decode_new_slots: torch.Tensor | None = None  # int64 [Nd]: cache slot of each new token
    decode_step: int = 0  # the DecodeCache step this plan brings the copies to


def _context_slots(bt: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """int64 [len(bt), length]: cache slots of positions 0..length-1 of each block-table row (positions past the
    table's width land in its last column; callers mask or redirect them)."""
    pos = np.arange(length)
    return bt[:, np.minimum(pos // block_size, bt.shape[1] - 1)] * block_size + pos % block_size


def _host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def plan_attention(block_tables: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray,
                   query_start_loc: torch.Tensor | np.ndarray, block_size: int,
                   decode_cache: DecodeCache | None = None, device: torch.device | str | None = None) -> AttentionPlan:
    """Split a step into batched prefill groups and one padded decode batch, with their cache slots and masks.
    With ``decode_cache`` (consecutive steps of one runner), decodes read its copies instead of gathering.
    Host-side work on small index arrays, so numpy (far cheaper per op than torch); the inputs may be numpy
    arrays already (the engine's runner has them), and the plan's tensors go to ``device`` (default: the block
    tables' device)."""
    dev = torch.device(device) if device is not None else getattr(block_tables, "device", torch.device("cpu"))
    to_dev = torch.from_numpy if dev.type == "cpu" else lambda a: torch.from_numpy(a).to(dev)
    starts = _host(query_start_loc).astype(np.int64)
    lens = _host(seq_lens).astype(np.int64)
    q_lens = starts[1:] - starts[:-1]
    too_long = q_lens > lens
    if too_long.any():
        s = int(too_long.argmax())
        raise ValueError(f"sequence {s}: query length {q_lens[s]} exceeds seq_len {lens[s]}")
    # Entries past a sequence's blocks may be -1 or junk: only slots of real positions are ever read (padding is
    # redirected below), so they need no cleaning.
    bt = _host(block_tables).astype(np.int64)
    is_decode = q_lens == 1
    all_decode = bool(is_decode.all()) and len(lens) > 0
    prefills = []
    if not all_decode:
        runs: list[list] = []  # [q_start, q_len, seq_len, seq indices]: consecutive prefills alike
        for s in np.nonzero(q_lens > 1)[0].tolist():
            q_start, q_len, seq_len = int(starts[s]), int(q_lens[s]), int(lens[s])
            last = runs[-1] if runs else None
            if last and (last[1], last[2]) == (q_len, seq_len) and last[0] + len(last[3]) * q_len == q_start:
                last[3].append(s)
            else:
                runs.append([q_start, q_len, seq_len, [s]])
        for q_start, q_len, seq_len, seqs in runs:
            mask = None
            if q_len < seq_len:  # causal, shifted by the cached prefix
                mask = to_dev(np.arange(seq_len)[None, :] <= np.arange(seq_len - q_len, seq_len)[:, None])
            prefills.append(PrefillGroup(q_start, len(seqs), q_len, seq_len,
                                         to_dev(_context_slots(bt[seqs], seq_len, block_size).reshape(-1)), mask))
    rows = slots = mask = append = new_slots = None
    max_len = 0
    if all_decode:
        dec_starts, dec_lens, tables = starts[:-1], lens, bt
    else:
        decodes = np.nonzero(is_decode)[0]
        dec_starts, dec_lens, tables = starts[decodes], lens[decodes], bt[decodes]
    nd = len(dec_lens)
    if nd:
        max_len = int(dec_lens.max())
        width, cached = max_len, None
        if decode_cache is not None:
            cached = decode_cache.advance(dec_lens, tables, block_size)
            if cached is None:
                decode_cache = None
            else:
                width = decode_cache.capacity
        slots = _context_slots(tables, width, block_size)
        last = dec_lens - 1  # position of each decode's new token
        valid = np.arange(width) <= last[:, None]
        if cached:
            append = to_dev(np.stack([np.arange(nd), last]))
            new_slots = to_dev(slots[np.arange(nd), last])
        # Padding points at a slot the sequence owns: a masked key then weighs 0 against finite values, never
        # junk (even NaN) from an unowned slot, which 0 * NaN would leak.
        slots = to_dev(np.where(valid, slots, slots[:, :1]).reshape(-1))
        rows = to_dev(dec_starts)
        if dec_lens.min() < max_len:
            mask = to_dev(np.ascontiguousarray(valid[:, None, None, :max_len]))
    else:
        decode_cache = None
    all_decode = all_decode and int(starts[-1]) == nd
    return AttentionPlan(block_size, int(starts[-1]), tuple(prefills), rows, slots, mask, all_decode, max_len,
                         decode_cache, append, new_slots, decode_cache.step if decode_cache else 0)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, *, max_query_len: int | None = None,
                          max_seq_len: int | None = None, plan: AttentionPlan | None = None,
                          k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """Reference (and CPU fast path): one SDPA per group of like prefills, one padded SDPA for all decodes.

    ``plan``: plan_attention's result for these block_tables / seq_lens / query_start_loc (built here when None).
    ``k``, ``v``: this step's keys / values [T, Hkv, D] as just stored; when given, prefills without a cached
    prefix attend to them directly instead of reading them back (not for int8 caches, which attention must see
    quantised). max_query_len / max_seq_len are accepted (and ignored) so both backends can be called the same way.
    """
    quantised = check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    if not quantised:
        k_scale = v_scale = None
    block_size = k_cache.shape[1]
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, block_size)
    elif plan.block_size != block_size:
        raise ValueError(f"plan was built for block_size {plan.block_size}, the cache has {block_size}")
    direct = k is not None and v is not None and not quantised
    if direct and (k.shape != v.shape or k.shape != (q.shape[0], *k_cache.shape[2:])):
        raise ValueError(f"k and v must be [T, Hkv, D] = {(q.shape[0], *k_cache.shape[2:])}; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    gqa = Hkv != H
    # fp16/bf16 SDPA on CPU is slow and less accurate; compute in fp32 there.
    cdtype = torch.float32 if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    new_kv = (k, v) if direct else None
    if plan.all_decode and plan.num_tokens == T and T > 0:
        return _decode(q, k_cache, v_cache, k_scale, v_scale, plan, scale, cdtype, new_kv).to(q.dtype)
    out = torch.empty_like(q)
    out[plan.num_tokens:] = 0
    for g in plan.prefills:
        n, rows = g.num_seqs, slice(g.q_start, g.q_start + g.num_seqs * g.q_len)
        qs = q[rows].to(cdtype).reshape(n, g.q_len, H, D).transpose(1, 2)
        if direct and g.mask is None:
            ks, vs = (x[rows].to(k_cache.dtype).to(cdtype) for x in (k, v))
        else:
            ks, vs = _gather(k_cache, k_scale, g.slots, cdtype), _gather(v_cache, v_scale, g.slots, cdtype)
        ks, vs = (x.reshape(n, g.seq_len, Hkv, D).transpose(1, 2) for x in (ks, vs))
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, is_causal=g.mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[rows] = o.transpose(1, 2).reshape(-1, H, D)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode(q, k_cache, v_cache, k_scale, v_scale, plan, scale, cdtype,
                                        new_kv).to(q.dtype)
    return out


def _decode(q, k_cache, v_cache, k_scale, v_scale, plan: AttentionPlan, scale: float, cdtype,
            new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """All single-token queries as one padded SDPA -> [Nd, H, D]. The G query heads sharing a kv head act as G
    query rows of that head (no causal structure within a decode), so SDPA runs plain multi-head, no GQA.
    DecodeCache copies are [Nd, Hkv, capacity, D]: SDPA reads each head's keys contiguously (~25% faster than
    through the paged layout's strides at 32 sequences). ``new_kv``: this step's k, v [T, Hkv, D] exactly as
    stored, appended as they are instead of being read back from the cache."""
    H, D = q.shape[1:]
    Hkv = k_cache.shape[2]
    rows = plan.decode_rows
    qs = q.reshape(-1, Hkv, H // Hkv, D) if plan.all_decode else q.index_select(0, rows).view(-1, Hkv, H // Hkv, D)
    nd = qs.shape[0]
    dc, key = plan.decode_cache, k_cache.data_ptr()
    entry = dc.layers.get(key) if dc is not None else None
    if plan.decode_append is not None and entry is not None and entry[2] == plan.decode_step - 1:
        kv = entry[:2]
        if new_kv is None:
            new_kv = tuple(_gather(c, s, plan.decode_new_slots, cdtype) for c, s in ((k_cache, k_scale),
                                                                                     (v_cache, v_scale)))
        elif not plan.all_decode:
            new_kv = tuple(x.index_select(0, rows) for x in new_kv)
        seqs, positions = plan.decode_append
        for buf, x in zip(kv, new_kv, strict=True):
            buf[seqs, :, positions] = x.to(cdtype)
    else:  # no DecodeCache, rebuilding it, or this layer missed a step (e.g. a plan that never ran): gather
        kv = tuple(_gather(c, s, plan.decode_slots, cdtype).view(nd, -1, Hkv, D).transpose(1, 2)
                   for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
        if dc is not None:
            kv = tuple(x.contiguous() for x in kv)
    if dc is not None:
        dc.layers[key] = (*kv, plan.decode_step)
    ks, vs = (x[:, :, :plan.decode_len] for x in kv)
    o = F.scaled_dot_product_attention(qs.to(cdtype), ks, vs, attn_mask=plan.decode_mask, scale=scale)
    return o.reshape(nd, H, D)


SPLIT_MIN_SEQ_LEN = 1024  # auto split-K only when the longest context reaches this
SPLIT_MIN_KEYS = 256  # ... and each partition keeps at least this many keys
SPLIT_MAX = 32  # partitions per sequence; also bounds the partial buffers
PREFILL_BLOCK_M = 64  # rows (query tokens x heads of a GQA group) per program
BLOCK_N = 64  # keys per inner-loop tile (32 for fp32 with head_dim > 64, to fit shared memory)
# Launch settings tried by triton.autotune on a GPU, per (GQA group, head_dim, step kind, dtype); the interpreter
# takes the first.
ATTN_CONFIGS = ((4, 2), (4, 3), (8, 2), (8, 3))  # (num_warps, num_stages)

if triton is not None:

    @triton.jit
    def _attn_tile(q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, block_size, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                   kv_off, sc_kv_off, d, d_ok, sm_scale_log2, stride_cb, stride_co, stride_sb, stride_so,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, QUANT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
        """One BLOCK_N key tile of the online softmax. The block table is read once per tile: one entry when a
        page holds the tile (PAGE >= BLOCK_N), BLOCK_N // PAGE entries otherwise (PAGE: the block size when it is a
        power of two; 0 reads one entry per key). Only CAUSAL (diagonal or last) tiles mask keys."""
        k_pos = start + tl.arange(0, BLOCK_N)
        if PAGE == 0:
            page = tl.load(bt_row + k_pos // block_size, mask=k_pos < kv_hi, other=0).to(tl.int64)
            off = k_pos % block_size
        elif PAGE >= BLOCK_N:
            page = tl.load(bt_row + start // PAGE).to(tl.int64)
            off = start % PAGE + tl.arange(0, BLOCK_N)
        else:
            first = start + tl.arange(0, BLOCK_N // PAGE) * PAGE
            pages = tl.load(bt_row + first // PAGE, mask=first < kv_hi, other=0).to(tl.int64)
            page = tl.reshape(tl.broadcast_to(pages[:, None], (BLOCK_N // PAGE, PAGE)), (BLOCK_N,))
            off = tl.arange(0, BLOCK_N) % PAGE
        slot = page * stride_cb + off * stride_co + kv_off
        k_ok = k_pos < kv_hi  # all true in a whole tile below kv_hi; compiled only into the masks that use it
        kv_mask = (k_ok[:, None] & d_ok[None, :]) if CAUSAL else d_ok[None, :]
        k = tl.load(kc_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
        v = tl.load(vc_ptr + slot[:, None] + d[None, :], mask=kv_mask, other=0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if QUANT:
            sc_off = page * stride_sb + off * stride_so + sc_kv_off
            qk = qk * tl.load(ks_ptr + sc_off, mask=k_ok, other=0.0)[None, :]
        qk = qk * sm_scale_log2
        if CAUSAL:
            qk = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            p = p * tl.load(vs_ptr + sc_off, mask=k_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
    def _paged_attn_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
        out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
        sm_scale_log2, num_seqs, num_heads, num_splits, head_dim, block_size,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
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
            # keys every row of the tile sees (up to its first query's position): whole tiles there skip the mask
            visible = tl.minimum(kv_hi, seq_len - q_len + tile_lo + 1)
            full_hi = kv_lo + tl.maximum(visible - kv_lo, 0) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
            kv_off, sc_kv_off = kvh * stride_ch, kvh * stride_sh
            for start in range(kv_lo, full_hi, BLOCK_N):
                m_i, l_i, acc = _attn_tile(q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, block_size, kc_ptr,
                                           vc_ptr, ks_ptr, vs_ptr, kv_off, sc_kv_off, d, d_ok, sm_scale_log2,
                                           stride_cb, stride_co, stride_sb, stride_so, BLOCK_N, PAGE, False,
                                           QUANT, DOT_PRECISION)
            for start in range(full_hi, kv_hi, BLOCK_N):
                m_i, l_i, acc = _attn_tile(q, m_i, l_i, acc, start, kv_hi, q_pos, bt_row, block_size, kc_ptr,
                                           vc_ptr, ks_ptr, vs_ptr, kv_off, sc_kv_off, d, d_ok, sm_scale_log2,
                                           stride_cb, stride_co, stride_sb, stride_so, BLOCK_N, PAGE, True,
                                           QUANT, DOT_PRECISION)
            if SPLIT:
                base = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + split
                tl.store(part_m_ptr + base, m_i, mask=row_ok)
                tl.store(part_l_ptr + base, l_i, mask=row_ok)
                tl.store(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
            else:
                o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
                tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit(do_not_specialize=["num_seqs", "num_splits"])
    def _split_reduce_kernel(out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, qsl_ptr, num_seqs, num_heads, num_splits,
                             head_dim, stride_ot, stride_oh, SPLIT_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
        """Merge the partitions of one (token, head): rescale each partial sum to the global max. Tokens past
        query_start_loc[-1] (whose partials nobody wrote) come out 0."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLIT_PAD)
        d = tl.arange(0, BLOCK_D)
        sp_ok = sp < tl.where(t < tl.load(qsl_ptr + num_seqs), num_splits, 0)
        base = (t.to(tl.int64) * num_heads + h) * num_splits + sp
        m = tl.load(part_m_ptr + base, mask=sp_ok, other=float("-inf"))
        part_l = tl.load(part_l_ptr + base, mask=sp_ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(sp_ok, tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)), 0.0)
        l_sum = tl.sum(part_l * w, 0)
        o = tl.load(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
        o = tl.sum(o * w[:, None], 0)
        o = tl.where(l_sum > 0, o / tl.where(l_sum > 0, l_sum, 1.0), 0.0)  # uncovered tokens stay 0
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
                 mask=d < head_dim)

    _attn_launch = _paged_attn_kernel
    if os.environ.get("TRITON_INTERPRET") != "1":
        _attn_launch = triton.autotune(
            [triton.Config({}, num_warps=w, num_stages=st) for w, st in ATTN_CONFIGS],
            key=["GROUP", "BLOCK_D", "BLOCK_N", "PAGE", "DECODE_ONLY", "SPLIT", "QUANT", "DOT_PRECISION"],
        )(_paged_attn_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_num_splits(q: torch.Tensor, programs: int, max_seq_len: int | None, seq_lens: torch.Tensor) -> int:
    """Split-K (flash-decoding) when the step's programs leave most SMs idle and contexts are long: decode batches,
    and mixed steps whose prefill chunks are short next to long-context decodes."""
    if q.device.type != "cuda":
        return 1
    num_sms = _num_sms(q.device)
    if programs >= num_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())  # a device sync: the engine passes it
    if max_seq_len < SPLIT_MIN_SEQ_LEN:
        return 1
    return max(1, min(SPLIT_MAX, triton.cdiv(2 * num_sms, programs), max_seq_len // SPLIT_MIN_KEYS))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           *, max_query_len: int | None = None, max_seq_len: int | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Triton paged attention: flash-style online softmax over paged key tiles, GQA heads packed into rows.

    max_query_len / max_seq_len: the step's host-side metadata. With both given no device-to-host sync happens
    (the engine always passes them), and output rows past query_start_loc[-1] are left undefined instead of zeroed
    (the engine has none). num_splits forces the split-K path when > 1; by default it is chosen when the step has
    few programs for the GPU and long contexts.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs the 'triton' package")
    quantised = check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    hinted = max_query_len is not None and max_seq_len is not None
    out = torch.empty_like(q) if hinted else torch.zeros_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out.zero_()
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("paged_attention_triton needs unit stride on head_dim and identically strided k/v caches")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # a device sync
    decode_only = max_query_len <= 1

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
    if num_splits is None:
        num_splits = _auto_num_splits(q, num_tiles * num_kv_heads, max_seq_len, seq_lens)
    if not 1 <= num_splits <= SPLIT_MAX:
        raise ValueError(f"num_splits={num_splits} must be in [1, {SPLIT_MAX}]")
    split = num_splits > 1
    if split:  # every (token, head, split) of a real token is written by the kernel: no fill needed
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty((num_tokens, num_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out  # unused
    ks, vs = (k_scale, v_scale) if quantised else (k_cache, v_cache)  # dummies when not quantised
    if quantised and v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale must have identical strides")
    block_size = k_cache.shape[1]
    page = block_size if block_size & (block_size - 1) == 0 else 0  # powers of two: table read once per tile
    launch = {} if _attn_launch is not _paged_attn_kernel else {"num_warps": ATTN_CONFIGS[0][0],
                                                                "num_stages": ATTN_CONFIGS[0][1]}
    _attn_launch[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, query_start_loc,
        out, part_m, part_l, part_o,
        scale * 1.4426950408889634, num_seqs, num_heads, num_splits, head_dim, block_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PAGE=page, DECODE_ONLY=decode_only, SPLIT=split, QUANT=quantised,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch,
    )
    if split:
        _split_reduce_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_o, query_start_loc, num_seqs, num_heads, num_splits, head_dim,
            out.stride(0), out.stride(1), SPLIT_PAD=triton.next_power_of_2(SPLIT_MAX), BLOCK_D=block_d,  # one variant
        )
    return out
