"""Write this step's K/V into the paged cache (optionally int8, one symmetric scale per token and head).

Layout: caches [num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size + offset;
int8 scales [num_blocks, block_size, num_kv_heads] float32. A slot of -1 is padding and is skipped.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch reference stays usable without triton
    triton = None

INT8_MAX = 127.0
INT8_SCALE_FLOOR = 1e-8  # keeps an all-zero head from producing scale 0 (and 0/0 on quantise)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: returns (q int8 like x, scale float32 of x.shape[:-1]).

    Rounds half away from zero (the Triton kernel does the same, so both agree bit for bit on CPU).
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).clamp_min(INT8_SCALE_FLOOR)
    y = xf / scale.unsqueeze(-1)
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int8, in float32."""
    return q.float() * scale.unsqueeze(-1)


def check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    """Validate shapes; return True when the caches are int8."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D]; got k={tuple(k.shape)} v={tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, {k.shape[1]}, {k.shape[2]}]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}]; got {tuple(slot_mapping.shape)}")
    quantised = k_cache.dtype == torch.int8
    if quantised:
        if k_scale is None or v_scale is None:
            raise ValueError("int8 k_cache/v_cache need k_scale and v_scale")
        if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_cache.shape[:3]:
            raise ValueError(f"k_scale/v_scale must be {tuple(k_cache.shape[:3])}; "
                             f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    return quantised


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Scatter k, v [T, Hkv, D] into the caches at slot_mapping (in place); -1 slots are skipped."""
    quantised = check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731  [num_slots, ...]; caches must be contiguous
    if not quantised and slot_mapping.device.type == "cpu" and len(slot_mapping) and slot_mapping.min() >= 0:
        slots = slot_mapping.long()  # no padding (the engine's steps): two copies, no masking
        flat(k_cache).index_copy_(0, slots, k.to(k_cache.dtype))
        flat(v_cache).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if quantised:
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        flat(k_cache)[slots] = kq
        flat(v_cache)[slots] = vq
        flat(k_scale)[slots] = ks
        flat(v_scale)[slots] = vs
    else:
        flat(k_cache)[slots] = k.to(k_cache.dtype)
        flat(v_cache)[slots] = v.to(v_cache.dtype)


if triton is not None:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cb, stride_co, stride_ch, stride_sb, stride_so, stride_sh,
                         block_size, num_heads, head_dim,
                         QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per token: copy (or quantise) all its kv heads into its slot."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // block_size
            off = slot % block_size
            h = tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
            k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
            cache_off = blk * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :]
            if QUANT:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                ks = tl.maximum(tl.max(tl.abs(k), axis=1) / 127.0, 1e-8)
                vs = tl.maximum(tl.max(tl.abs(v), axis=1) / 127.0, 1e-8)
                ky = k / ks[:, None]
                vy = v / vs[:, None]
                # round half away from zero, same as quantize_int8
                kq = tl.where(ky >= 0, tl.floor(ky + 0.5), -tl.floor(-ky + 0.5))
                vq = tl.where(vy >= 0, tl.floor(vy + 0.5), -tl.floor(-vy + 0.5))
                kq = tl.minimum(tl.maximum(kq, -127.0), 127.0)
                vq = tl.minimum(tl.maximum(vq, -127.0), 127.0)
                tl.store(kc_ptr + cache_off, kq.to(tl.int8), mask=mask)
                tl.store(vc_ptr + cache_off, vq.to(tl.int8), mask=mask)
                scale_off = blk * stride_sb + off * stride_so + h * stride_sh
                tl.store(ks_ptr + scale_off, ks, mask=h < num_heads)
                tl.store(vs_ptr + scale_off, vs, mask=h < num_heads)
            else:
                tl.store(kc_ptr + cache_off, k.to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(vc_ptr + cache_off, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Triton version of store_kv_torch (same contract)."""
    if triton is None:
        raise RuntimeError("store_kv_triton needs the 'triton' package")
    quantised = check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("store_kv_triton needs unit stride on head_dim and identically strided k/v caches")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    ks, vs = (k_scale, v_scale) if quantised else (k_cache, v_cache)  # dummies when not quantised
    if quantised and v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale must have identical strides")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        k_cache.shape[1], num_heads, head_dim,
        QUANT=quantised, BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
