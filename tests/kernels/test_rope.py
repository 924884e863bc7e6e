"""RoPE: cos/sin table and torch reference against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb and
against rotation invariants; Triton kernel against the torch reference."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rope import rope_cos_sin, rope_torch, rope_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # short original context so all three bands occur below 4096
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3}


def _qk(T, H, Hkv, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g).to(device, dtype), torch.randn(T, Hkv, D, generator=g).to(device, dtype)


def _hf(q, k, positions, head_dim, theta, scaling):
    params = {"rope_type": "default", "rope_theta": theta} | (scaling or {})
    config = LlamaConfig(hidden_size=head_dim * q.shape[1], num_attention_heads=q.shape[1],
                         num_key_value_heads=k.shape[1], head_dim=head_dim, max_position_embeddings=4096,
                         rope_parameters=params)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # HF layout is [batch, heads, seq, dim]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1), cos[0], sin[0]


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0)])
def test_torch_matches_transformers(name, head_dim, theta):
    q, k = _qk(9, 4, 2, head_dim, torch.float32)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 1000, 3000, 4095])
    q_hf, k_hf, cos_hf, sin_hf = _hf(q, k, positions, head_dim, theta, SCALINGS[name])
    table = rope_cos_sin(head_dim, 4096, theta, SCALINGS[name], torch.float32, "cpu")
    half = head_dim // 2
    torch.testing.assert_close(table[positions, :half], cos_hf[:, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(table[positions, half:], sin_hf[:, :half], rtol=0, atol=1e-6)
    q_out, k_out = rope_torch(q, k, positions, table)
    torch.testing.assert_close(q_out, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf, rtol=1e-5, atol=1e-5)


def test_table_by_hand_and_rotation_invariants():
    D, theta = 8, 10000.0
    table = rope_cos_sin(D, 50, theta, None, torch.float64, "cpu")
    p, i = 7, 3  # angle of pair i at position p is p * theta^(-2i/D)
    angle = torch.tensor(p * theta ** (-2 * i / D))
    assert torch.isclose(table[p, i], angle.cos().to(table.dtype), atol=1e-6)
    assert torch.isclose(table[p, D // 2 + i], angle.sin().to(table.dtype), atol=1e-6)
    q, k = _qk(1, 1, 1, D, torch.float64)
    rot = lambda x, pos: rope_torch(x, x, torch.tensor([pos]), table)[0]
    # rotations keep norms, and <rope(q, m), rope(k, n)> depends only on m - n
    torch.testing.assert_close(rot(q, 11).norm(), q.norm())
    torch.testing.assert_close((rot(q, 20) * rot(k, 15)).sum(), (rot(q, 7) * rot(k, 2)).sum())
    torch.testing.assert_close(rot(q, 0), q)


def test_positions_rewritten_in_place_are_read_again():
    """Nothing is cached between calls: a positions buffer reused with new values (as a static decode input is)
    rotates by the new positions."""
    table = rope_cos_sin(8, 50, 10000.0)
    q, k = _qk(2, 2, 1, 8, torch.float32)
    pos = torch.tensor([3, 4])
    rope_torch(q, k, pos, table)
    pos.copy_(torch.tensor([9, 10]))
    for got, want in zip(rope_torch(q, k, pos, table), rope_torch(q, k, torch.tensor([9, 10]), table), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_linear_scaling_is_position_division():
    base = rope_cos_sin(64, 64, 10000.0, None, torch.float32, "cpu")
    scaled = rope_cos_sin(64, 64, 10000.0, {"type": "linear", "factor": 4.0}, torch.float32, "cpu")
    torch.testing.assert_close(scaled[[0, 4, 8, 60]], base[[0, 1, 2, 15]], rtol=0, atol=1e-5)


def test_bad_scaling_and_shapes_raise():
    with pytest.raises(ValueError, match="yarn"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        rope_cos_sin(64, 16, 10000.0, {"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="bogus"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "bogus"})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_cos_sin(64, 16, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="head_dim"):
        rope_cos_sin(63, 16, 10000.0)
    q, k = _qk(2, 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="cos_sin"):
        rope_torch(q, k, torch.tensor([0, 1]), rope_cos_sin(32, 16, 10000.0))
    with pytest.raises(ValueError, match="positions"):
        rope_torch(q, k, torch.tensor([0]), rope_cos_sin(64, 16, 10000.0))


def _check_triton(T, H, Hkv, D, dtype, device, strided=False, table_dtype=torch.float32):
    q, k = _qk(T, H, Hkv, D, dtype, device, seed=T + H + D)
    if strided:  # q and k as views of one fused qkv projection output
        qkv = torch.cat([q.flatten(1), k.flatten(1), k.flatten(1)], dim=1)
        q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
        assert T == 1 or not q.is_contiguous()  # torch gives a one-row view contiguous strides
    table = rope_cos_sin(D, 512, 10000.0, LLAMA3, table_dtype, device)
    positions = torch.randint(0, 512, (T,), generator=torch.Generator().manual_seed(T)).to(device)
    q_out, k_out = rope_triton(q, k, positions, table)
    q_ref, k_ref = rope_torch(q, k, positions, table)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 64), (7, 3, 1, 128), (5, 8, 8, 96), (2, 6, 2, 64)])
def test_triton_matches_torch(T, H, Hkv, D, dtype):
    _check_triton(T, H, Hkv, D, dtype, DEVICE)


@pytest.mark.interpreter
def test_triton_strided_qkv_views_and_fp16_table():
    _check_triton(3, 4, 2, 64, torch.float16, DEVICE, strided=True, table_dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 32, 8, 128), (300, 32, 8, 128), (17, 14, 2, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_triton_gpu(T, H, Hkv, D, dtype, strided):
    _check_triton(T, H, Hkv, D, dtype, "cuda", strided=strided)
