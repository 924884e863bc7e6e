"""Model arithmetic from a ModelSpec: parameter counts, weight and KV bytes, FLOPs, KV capacity.

Bit widths: ``weight_bits`` in 16/8/4 and ``kv_bits`` in 16/8, where 16 means *not quantised*: stored in the
model dtype (2 bytes for bfloat16/float16, 4 for float32). Weight-only quantisation covers the decoder's linear
weight matrices (q/k/v/o, gate/up/down); embeddings, the LM head, norms and biases stay in the model dtype, as
AWQ/GPTQ checkpoints do by default. Each quantised group of ``group_size`` weights carries one 16-bit scale.
"""

from __future__ import annotations

import math

from core.specs import ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
WEIGHT_BITS = (16, 8, 4)
KV_BITS = (16, 8)
SCALE_BYTES = 2  # one 16-bit scale per quantisation group


def check_quant(weight_bits: int, kv_bits: int, group_size: int) -> None:
    if weight_bits not in WEIGHT_BITS:
        raise ValueError(f"cost_model.weight_bits={weight_bits!r}; allowed: {list(WEIGHT_BITS)}")
    if kv_bits not in KV_BITS:
        raise ValueError(f"cost_model.kv_bits={kv_bits!r}; allowed: {list(KV_BITS)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"cost_model.group_size={group_size!r}; allowed: an integer >= 1")


def act_bytes(m: ModelSpec) -> int:
    """Bytes per activation / unquantised weight element (the model dtype)."""
    return DTYPE_BYTES[m.dtype]


def attention_params_per_layer(m: ModelSpec) -> int:
    """q, k, v, o weight matrices: d·(H·Dh) + 2·d·(Hkv·Dh) + (H·Dh)·d."""
    d, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return d * q + 2 * d * kv + q * d


def mlp_params_per_layer(m: ModelSpec) -> int:
    """Gated MLP (gate, up, down): 3·d·F."""
    return 3 * m.hidden_size * m.intermediate_size


def linear_params_per_layer(m: ModelSpec) -> int:
    """Weight matrices of one decoder layer: what weight-only quantisation compresses."""
    return attention_params_per_layer(m) + mlp_params_per_layer(m)


def params_per_layer(m: ModelSpec) -> int:
    """Linear weights + q/k/v biases (Qwen2) + the two RMSNorm weights."""
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.attention_bias else 0
    return linear_params_per_layer(m) + bias + 2 * m.hidden_size


def embedding_params(m: ModelSpec) -> int:
    return m.vocab_size * m.hidden_size


def total_params(m: ModelSpec) -> int:
    """Layers + embeddings + untied LM head + final norm."""
    head = 0 if m.tie_word_embeddings else embedding_params(m)
    return m.num_layers * params_per_layer(m) + embedding_params(m) + head + m.hidden_size


def quantised_params(m: ModelSpec) -> int:
    return m.num_layers * linear_params_per_layer(m)


def linear_weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """Bytes of the decoder's linear weights: b/8 per weight + one 16-bit scale per group when quantised."""
    n = quantised_params(m)
    if weight_bits == 16:
        return float(n * act_bytes(m))
    return n * weight_bits / 8 + n * SCALE_BYTES / group_size


def weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """All weights as stored. For a 16-bit model this is W·[(1 − f) + f·b/16 + f/G] with f = quantised fraction."""
    check_quant(weight_bits, 16, group_size)
    rest = total_params(m) - quantised_params(m)
    return rest * act_bytes(m) + linear_weight_bytes(m, weight_bits, group_size)


def kv_bytes_per_element(m: ModelSpec, kv_bits: int = 16) -> float:
    return float(act_bytes(m)) if kv_bits == 16 else kv_bits / 8


def kv_bytes_per_token(m: ModelSpec, kv_bits: int = 16) -> float:
    """K and V of every layer: 2 · L · Hkv · Dh · bytes per element."""
    check_quant(16, kv_bits, 1)
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * kv_bytes_per_element(m, kv_bits)


def linear_flops_per_token(m: ModelSpec) -> float:
    """2 FLOPs (multiply + add) per linear weight, all layers; excludes the LM head."""
    return 2.0 * quantised_params(m)


def lm_head_flops_per_token(m: ModelSpec) -> float:
    """Per sampled token (one logits row): 2·V·d."""
    return 2.0 * m.vocab_size * m.hidden_size


def attention_flops_per_pair(m: ModelSpec) -> float:
    """Per (query, key) pair summed over layers: 4·H·Dh per layer (QK^T and PV, 2 FLOPs per MAC each)."""
    return 4.0 * m.num_heads * m.head_dim * m.num_layers


def flops_per_token(m: ModelSpec, context: int = 0, sampled: bool = True) -> float:
    """One token attending to ``context`` keys (itself included), with its logits row if ``sampled``."""
    head = lm_head_flops_per_token(m) if sampled else 0.0
    return linear_flops_per_token(m) + head + attention_flops_per_pair(m) * context


def elementwise_bytes_per_token(m: ModelSpec, tp: int = 1) -> float:
    """Activation traffic of the memory-bound ops per token per device, all layers.

    Per layer: two RMSNorms (read + write d each: 4d), two residual adds (read 2d, write d each: 6d), replicated
    on every tensor-parallel device; SwiGLU activation (read 2F, write F) and RoPE on q and k (read + write), split
    across devices.
    """
    per_layer = 10 * m.hidden_size + (3 * m.intermediate_size + 2 * (m.num_heads + m.num_kv_heads) * m.head_dim) / tp
    return float(act_bytes(m) * m.num_layers * per_layer)


def kv_heads_per_device(m: ModelSpec, tp: int) -> int:
    """KV heads each tensor-parallel device stores; replicated when tp > Hkv (as vLLM does)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"cost_model.tp={tp!r}; allowed: an integer >= 1")
    if m.num_heads % tp:
        raise ValueError(f"cost_model.tp={tp} must divide model.num_heads={m.num_heads}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ValueError(f"cost_model.tp={tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other")
    return max(1, m.num_kv_heads // tp)


def max_concurrent_seqs(m: ModelSpec, kv_budget_bytes: float, context: int, kv_bits: int = 16, tp: int = 1) -> int:
    """Sequences of ``context`` tokens whose KV fits in ``kv_budget_bytes`` per device (0 if the budget is < 0).

    Ignores activation workspace and paged-block rounding: an upper bound on what an engine admits.
    """
    if context < 1:
        raise ValueError(f"context={context}; allowed: an integer >= 1")
    per_token = kv_bytes_per_token(m, kv_bits) * kv_heads_per_device(m, tp) / m.num_kv_heads
    return max(0, math.floor(kv_budget_bytes / (context * per_token)))
