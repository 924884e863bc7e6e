"""The decoder against transformers: full-prompt logits for every supported layout, int8 KV, W4A16, Triton."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core import arithmetic as ar
from core.specs import ModelSpec
from engine.attention import allocate_kv_caches
from engine.loader import load_model
from kernels.w4a16 import dequantize_w4
from tests.engine.checkpoints import LAYOUTS, TINY, hf_logits, prefill_logits, tiny_checkpoint


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prompt_logits_match_transformers(tmp_path, layout, kernels):
    hf, path = tiny_checkpoint(tmp_path, layout)
    model = load_model(path)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    ours, ref = prefill_logits(model, ids, kernels), hf_logits(hf, ids)
    assert ours.shape == ref.shape == (40, TINY["vocab_size"])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_layout_features_are_wired(tmp_path):
    _, qwen = tiny_checkpoint(tmp_path / "q", "qwen2")
    assert load_model(qwen).model.layers[0].self_attn.qkv_proj.bias is not None
    _, tied = tiny_checkpoint(tmp_path / "t", "llama_tied")
    assert load_model(tied).lm_head is None
    _, scaled = tiny_checkpoint(tmp_path / "s", "llama3_rope")
    spec = ModelSpec.from_pretrained(scaled)
    assert spec.rope_scaling["rope_type"] == "llama3" and spec.rope_theta == 500000.0


def test_llama3_scaling_changes_logits_past_original_length(tmp_path):
    """Guards against the scaling being silently dropped: unscaled RoPE must give different logits."""
    hf, path = tiny_checkpoint(tmp_path, "llama3_rope")
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    spec = ModelSpec.from_pretrained(path)
    unscaled = load_model(path, replace(spec, rope_scaling=None))
    assert (prefill_logits(unscaled, ids) - hf_logits(hf, ids)).abs().max() > 1e-2


def test_int8_kv_cache_stays_close(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    model = load_model(path)
    ids = torch.randint(0, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(3))
    ours, ref = prefill_logits(model, ids, kv_dtype="int8"), hf_logits(hf, ids)
    err = (ours - ref).abs().max().item()
    assert 0 < err < 0.05 * ref.abs().max().item()  # quantised, so not exact, but close


def test_w4a16_equals_model_with_dequantised_weights(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    model = load_model(path, quant="w4a16", group_size=32)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight is None and layer.mlp.down_proj.qweight.group_size == 32
    # reference: transformers with every projection replaced by its dequantised 4-bit weight
    with torch.no_grad():
        for i, ours in enumerate(model.model.layers):
            ref = hf.model.layers[i]
            qkv = dequantize_w4(ours.self_attn.qkv_proj.qweight)
            q, k, v = qkv.split([64, 32, 32])
            ref.self_attn.q_proj.weight.copy_(q)
            ref.self_attn.k_proj.weight.copy_(k)
            ref.self_attn.v_proj.weight.copy_(v)
            ref.self_attn.o_proj.weight.copy_(dequantize_w4(ours.self_attn.o_proj.qweight))
            gate, up = dequantize_w4(ours.mlp.gate_up_proj.qweight).chunk(2)
            ref.mlp.gate_proj.weight.copy_(gate)
            ref.mlp.up_proj.weight.copy_(up)
            ref.mlp.down_proj.weight.copy_(dequantize_w4(ours.mlp.down_proj.qweight))
    ids = torch.randint(0, TINY["vocab_size"], (16,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_w4a16_group_size_must_divide(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="group_size"):
        load_model(path, quant="w4a16", group_size=48)


def test_kv_memory_sizing(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    spec = ModelSpec.from_pretrained(path)
    # the engine's sizing is core.arithmetic's: 2 layers x (K, V) x 16 slots x 2 kv heads x 16 dims x 4 bytes
    assert spec.dtype == "float32"
    assert ar.kv_bytes_per_block(spec, 16) == 2 * 2 * 16 * 2 * 16 * 4
    assert ar.kv_bytes_per_block(spec, 16, 8) == 2 * 2 * 16 * 2 * (16 + 4)  # int8 + a float32 scale per slot/head
    bf16 = replace(spec, dtype="bfloat16")
    budget = 10 * ar.kv_bytes_per_block(bf16, 16) + 1
    assert ar.num_blocks_for_memory(bf16, 16, budget) == 10
    caches = allocate_kv_caches(spec, 10, 16, torch.bfloat16, "cpu")
    assert sum(c.k.nbytes + c.v.nbytes for c in caches) == budget - 1
    int8 = allocate_kv_caches(spec, 10, 16, torch.float32, "cpu", kv_dtype="int8")
    assert sum(c.k.nbytes + c.v.nbytes + c.k_scale.nbytes + c.v_scale.nbytes for c in int8) \
        == 10 * ar.kv_bytes_per_block(spec, 16, 8)
    with pytest.raises(ValueError, match="kv_dtype"):
        allocate_kv_caches(spec, 10, 16, torch.bfloat16, "cpu", kv_dtype="fp8")
    assert ar.num_blocks_for_memory(spec, 16, 100) == 0


@pytest.mark.interpreter
def test_triton_backend_matches_torch_backend(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    model = load_model(path)
    ids = torch.randint(0, TINY["vocab_size"], (12,), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(prefill_logits(model, ids, "triton"), hf_logits(hf, ids), atol=1e-3, rtol=1e-3)


def test_row_chunked_layers_match_transformers(tmp_path, monkeypatch):
    """On CPU a layer's token-wise ops run CPU_ROW_CHUNK tokens at a time; a prompt spanning several chunks
    (and a ragged last one) must give transformers' logits."""
    import engine.model

    hf, path = tiny_checkpoint(tmp_path)
    monkeypatch.setattr(engine.model, "CPU_ROW_CHUNK", 7)
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(prefill_logits(load_model(path), ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_linear_weights_keep_the_nn_linear_shape(tmp_path):
    """CPU weights live transposed in memory, yet read as [out, in] like nn.Linear's (loader, quantiser, tests)."""
    hf, path = tiny_checkpoint(tmp_path)
    proj = load_model(path).model.layers[0].mlp.down_proj.weight
    assert proj.shape == hf.model.layers[0].mlp.down_proj.weight.shape and proj.stride() == (1, proj.shape[0])
    assert torch.equal(proj, hf.model.layers[0].mlp.down_proj.weight)
