"""Tiny random-weight Hugging Face checkpoints and reference computations shared by the engine tests."""

from __future__ import annotations

import torch
import transformers

from engine.attention import AttentionMetadata, allocate_kv_caches
from kernels.ops import get_kernels

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160, max_position_embeddings=256)
LAYOUTS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # head_dim independent of hidden / heads (64 / 4 = 16), q/k norms
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 24}),
    # layer 0 dense (decoder_sparse_step 2), layer 1 four experts, top-2 renormalised; odd head_dim 40
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "head_dim": 40, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "decoder_sparse_step": 2}),
    # layer 0 eight experts top-1 with the raw softmax weight (no renormalisation), layer 1 dense (mlp_only_layers)
    "qwen3_moe_top1": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, {
        "num_experts": 8, "num_experts_per_tok": 1, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "mlp_only_layers": [1]}),
    # every layer eight experts of the dense width, top-2
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, {
        "num_local_experts": 8, "num_experts_per_tok": 2}),
}
MOE_LAYOUTS = ("qwen3_moe", "qwen3_moe_top1", "mixtral")
WEIGHT_STD = 0.15  # larger than HF's 0.02 so greedy argmax has clear margins
QK_NORM_STD = 0.2  # Qwen3's q/k norm weights around 1, so a norm that dropped its weight would show


def tiny_hf(layout: str = "llama", seed: int = 0, **overrides):
    """A float32 random-weight transformers model of one of LAYOUTS."""
    config_cls, model_cls, extra = LAYOUTS[layout]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * QK_NORM_STD)
            elif not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def tiny_checkpoint(tmp_path, layout: str = "llama", seed: int = 0, fused_experts: bool = False, **overrides):
    """(HF model, checkpoint directory) saved with safetensors. MoE experts are saved one tensor per expert, as hub
    checkpoints hold them (transformers' default), or with ``fused_experts`` as transformers' stacked tensors."""
    model = tiny_hf(layout, seed, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True, save_original_format=not fused_experts)
    return model, tmp_path


def prefill_logits(model, token_ids: torch.Tensor, kernels: str = "torch", block_size: int = 4,
                   kv_dtype: str = "auto") -> torch.Tensor:
    """Our logits for every position of one prompt, computed in a single step on fresh caches."""
    T = len(token_ids)
    nb = -(-T // block_size)
    caches = allocate_kv_caches(model.spec, nb + 3, block_size, model.dtype, "cpu", kv_dtype)
    blocks = torch.arange(nb + 2, 2, -1, dtype=torch.int32)[:nb]  # scattered, non-identity block ids
    slots = blocks.long().repeat_interleave(block_size)[:T] * block_size + torch.arange(T) % block_size
    meta = AttentionMetadata(slots, torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                             blocks[None], T, T)
    with torch.inference_mode():
        return model.compute_logits(model(token_ids, torch.arange(T), meta, caches, get_kernels(kernels)))


def hf_logits(hf, token_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(token_ids[None]).logits[0].float()


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def save_word_tokenizer(directory, vocab_size: int = TINY["vocab_size"], chat_template: bool = True):
    """A word-level tokenizer over ``vocab_size`` words (w0, w1, ... and a few chat words, some multi-byte), saved
    next to a tiny checkpoint so it serves text; returns the loaded ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "user", "assistant", "system", "héllo", "日本"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast
