"""Rotary position embedding (rotate-half / GPT-NeoX / HF Llama convention): cos/sin table, torch reference and
Triton kernel.

The table is one tensor [max_positions, head_dim]: cos in the first head_dim//2 columns, sin in the rest, so a
kernel gathers one row per token. Frequencies follow HF ``modeling_rope_utils`` (computed in fp32 like HF, so the
engine's numerics track transformers).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference works without triton
    triton = None

ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(_get(scaling, "factor"))
    if kind == "llama3":
        factor = float(_get(scaling, "factor"))
        low, high = float(_get(scaling, "low_freq_factor")), float(_get(scaling, "high_freq_factor"))
        old_len = float(_get(scaling, "original_max_position_embeddings"))
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if kind in ("dynamic", "yarn", "longrope"):
        raise ValueError(f"rope scaling type {kind!r} is not implemented; supported: {ROPE_TYPES}")
    raise ValueError(f"unknown rope scaling type {kind!r}; supported: {ROPE_TYPES}")


def _get(scaling: dict, key: str):
    if key not in scaling:
        raise ValueError(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} needs key {key!r}")
    return scaling[key]


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_positions, head_dim] table: cos(p * inv_freq) then sin(p * inv_freq), each head_dim//2 wide.

    ``scaling`` is an HF ``rope_scaling`` / ``rope_parameters`` dict (key ``rope_type`` or legacy ``type``).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope: head_dim must be a positive even number, got {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"rope: max_positions must be positive, got {max_positions}")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), _inv_freq(head_dim, theta, scaling))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def check_rope_inputs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"rope: q must be [T, H, D] and k [T, Hkv, D] with D even, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rope: positions must be [T={q.shape[0]}], got {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2]:
        raise ValueError(f"rope: cos_sin must be [max_pos, D={q.shape[2]}], got {tuple(cos_sin.shape)}")


def rope_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate q [T, H, D] and k [T, Hkv, D] by their token positions; returns new (q_out, k_out)."""
    check_rope_inputs(q, k, positions, cos_sin)
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # [T, 1, D]
    half = q.shape[2] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:  # x * [cos, cos] + [x2, x1] * [-sin, sin]: HF's rounding, 4 ops
        xf = x.float()
        return (xf * cos).add_(xf.roll(half, -1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


if triton is not None:

    @triton.jit
    def _rotate_token(x_ptr, out_ptr, row, n_heads, stride_t, stride_h, cos, sin, half,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (heads < n_heads) & (cols < half)
        src = x_ptr + row * stride_t + heads * stride_h + cols
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
        dst = out_ptr + row * n_heads * 2 * half + heads * 2 * half + cols  # output is contiguous
        tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, n_q, n_k, half,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        cmask = cols < half
        cos = tl.load(cs_ptr + pos * stride_cs + cols, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + half + cols, mask=cmask, other=0.0).to(tl.float32)
        if tl.program_id(1) == 0:
            _rotate_token(q_ptr, qo_ptr, row, n_q, stride_qt, stride_qh, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
        else:
            _rotate_token(k_ptr, ko_ptr, row, n_k, stride_kt, stride_kh, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Triton version of :func:`rope_torch`: one program per (token, q-or-k). Positions are not bounds-checked."""
    check_rope_inputs(q, k, positions, cos_sin)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cos_sin = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    T, n_q, D = q.shape
    if T > 0:
        _rope_kernel[(T, 2)](q, k, q_out, k_out, positions, cos_sin, n_q, k.shape[1], D // 2,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0),
                             BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
                             BLOCK_HALF=triton.next_power_of_2(D // 2))
    return q_out, k_out
