"""Mixture-of-experts layers against transformers' (router, experts), both checkpoint layouts of the experts,
the arithmetic of an MoE checkpoint against its tensors, and what the engine refuses (MLA, shared experts, W4A16)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core import arithmetic as ar
from core.specs import ModelSpec
from engine.loader import load_model, random_model
from engine.moe import route
from kernels.ops import get_kernels
from tests.core.test_specs import from_hf, hf_config
from tests.engine.checkpoints import MOE_LAYOUTS, TINY, hf_logits, prefill_logits, tiny_checkpoint


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_router_matches_transformers(tmp_path, layout):
    hf, path = tiny_checkpoint(tmp_path, layout)
    layer = next(i for i, m in enumerate(hf.model.layers) if hasattr(m.mlp, "experts"))
    x = torch.randn(50, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    gate = hf.model.layers[layer].mlp.gate
    with torch.no_grad():
        logits, ref_weights, ref_ids = gate(x)
    spec = ModelSpec.from_pretrained(path)
    weights, ids = route(logits, spec.moe.top_k, spec.moe.norm_topk_prob)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), rtol=0, atol=0)


@pytest.mark.parametrize("kernels", ["torch", "native"])
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_experts_match_transformers(tmp_path, layout, kernels):
    """Our grouped expert application against transformers' experts module on the same routing: 60 tokens, so
    experts get several rows each (and, at top-1 over 8 experts, some none)."""
    hf, path = tiny_checkpoint(tmp_path, layout)
    layer = next(i for i, m in enumerate(hf.model.layers) if hasattr(m.mlp, "experts"))
    spec = ModelSpec.from_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(60, TINY["hidden_size"], generator=gen)
    ids = torch.stack([torch.randperm(spec.moe.num_experts, generator=gen)[:spec.moe.top_k] for _ in range(60)])
    weights = torch.rand(60, spec.moe.top_k, generator=gen)
    with torch.no_grad():
        ref = hf.model.layers[layer].mlp.experts(x, ids, weights)
    ours = load_model(path).model.layers[layer].mlp.experts
    torch.testing.assert_close(ours(x, weights, ids, get_kernels(kernels)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_fused_expert_checkpoints_load(tmp_path, layout):
    """transformers' stacked expert tensors (save_original_format=False) give the same model as per-expert ones."""
    hf, fused = tiny_checkpoint(tmp_path / "fused", layout, fused_experts=True)
    with safe_open(fused / "model.safetensors", "pt") as f:
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())  # noqa: SIM118
    _, split = tiny_checkpoint(tmp_path / "split", layout)
    with safe_open(split / "model.safetensors", "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # noqa: SIM118
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(2))
    a, b = load_model(fused), load_model(split)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    torch.testing.assert_close(prefill_logits(a, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_expert_layout_errors_name_the_tensors(tmp_path):
    _, path = tiny_checkpoint(tmp_path, "mixtral")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.1\.block_sparse_moe\.experts\.3\.w3"):
        load_model(path)
    tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"] = torch.zeros(128, 64)
    tensors["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 128)  # the same weights twice
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.down_proj is given twice"):
        load_model(path)


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_arithmetic_counts_the_checkpoint_tensors(tmp_path, layout):
    """ModelSpec arithmetic of an MoE checkpoint: total params = its tensors' sizes, weight bytes = their bytes."""
    _, path = tiny_checkpoint(tmp_path, layout)
    spec = ModelSpec.from_pretrained(path)
    with safe_open(path / "model.safetensors", "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    assert ar.total_params(spec) == sum(torch.Size(s).numel() for s in sizes.values())
    assert ar.weight_bytes(spec) == 4 * ar.total_params(spec) == sum(p.nbytes for p in load_model(path).parameters())
    # active: all but the experts each token skips, by hand from the checkpoint's tensors of one expert
    layer = ar.moe_layers(spec)[0]
    expert = sum(torch.Size(s).numel() for k, s in sizes.items() if f".layers.{layer}." in k and ".experts.0." in k)
    skipped = len(ar.moe_layers(spec)) * (spec.moe.num_experts - spec.moe.top_k) * expert
    assert expert == ar.expert_params(spec) and ar.active_params(spec) == ar.total_params(spec) - skipped


def test_mla_and_shared_experts_are_refused_with_the_simulator_named(tmp_path):
    tiny = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "vocab_size": 160}
    (tmp_path / "config.json").write_text(json.dumps({**hf_config("DeepSeek-V2-Lite"), **tiny}))
    with pytest.raises(ValueError, match=r"architecture='deepseek_v2': multi-head latent attention .* simulator"):
        load_model(tmp_path)  # refused from its config.json, before any weight is read
    with pytest.raises(ValueError, match=r"architecture='deepseek_v3'.* simulator"):
        random_model(from_hf("DeepSeek-V3", **tiny))
    shared = ModelSpec(name="s", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=160, architecture="qwen3_moe",
                       moe={"num_experts": 4, "top_k": 2, "intermediate_size": 32, "num_shared_experts": 1})
    with pytest.raises(ValueError, match=r"model\.moe\.num_shared_experts=1: shared experts .* simulator"):
        random_model(shared)


def test_w4a16_refuses_moe(tmp_path):
    _, path = tiny_checkpoint(tmp_path, "mixtral")
    with pytest.raises(ValueError, match="w4a16 does not cover MoE experts"):
        load_model(path, quant="w4a16", group_size=32)


def test_moe_layers_are_where_the_config_puts_them(tmp_path):
    hf, path = tiny_checkpoint(tmp_path, "qwen3_moe_top1")  # mlp_only_layers [1]
    model = load_model(path)
    assert [hasattr(m.mlp, "experts") for m in model.model.layers] == [True, False]
    assert [hasattr(m.mlp, "experts") for m in hf.model.layers] == [True, False]
    assert transformers.Qwen3MoeConfig.from_pretrained(path).mlp_only_layers == [1]
