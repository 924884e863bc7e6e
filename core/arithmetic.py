"""Model arithmetic from a ModelSpec, counting what the engine stores: parameter counts, weight and KV bytes,
FLOPs, KV blocks and sequences for a memory budget. The one place this is computed: the roofline, the estimate
tool, pool sizing (experiments.build), the engine's KV sizing and the prefix-work coefficients all call it.

Bit widths: ``weight_bits`` in 16/8/4 and ``kv_bits`` in 16/8, where 16 means *not quantised*: stored in the
model dtype (2 bytes for bfloat16/float16, 4 for float32).

Weights: weight-only quantisation covers the decoder's linear weight matrices (q/k/v/o, gate/up/down); embeddings,
the LM head, norms and biases stay in the model dtype, as AWQ/GPTQ checkpoints do by default. Each quantised group
of ``group_size`` weights (along the input dimension) carries a 16-bit scale *and* a 16-bit zero point, as the
engine's W4A16 format stores them (kernels/w4a16.py: fp16 ``scales`` and ``zeros`` per group, whatever the model
dtype). So n quantised weights take n·b/8 + n·4/G bytes; relative to a 16-bit model with quantised fraction f,
W·[(1 − f) + f·b/16 + 2f/G]. 8-bit weights are a what-if format (the engine has no W8 path); they are counted with
the same per-group scale + zero point, so the two quantised widths are comparable.

KV: K and V of every layer and KV head per token. An int8 KV cache also stores one float32 scale per (token,
KV head) for K and one for V (engine/attention.py, kernels/kv_store.py), so per token it takes
2·L·Hkv·(Dh + 4) bytes, not 2·L·Hkv·Dh: at head_dim 128 int8 holds 2·128/(128 + 4) = 1.94x the tokens of 16-bit KV,
not 2x.

numpy-free and torch-free: plain Python arithmetic on a ModelSpec.
"""

from __future__ import annotations

import math

from core.checks import check_choice, check_int
from core.specs import KV_BITS, WEIGHT_BITS, ModelSpec

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
QUANT_SCALE_BYTES = 2  # fp16 scale per quantisation group (kernels/w4a16.py QuantizedWeight.scales)
QUANT_ZERO_BYTES = 2  # fp16 zero point per quantisation group (QuantizedWeight.zeros; the engine always stores it)
GROUP_BYTES = QUANT_SCALE_BYTES + QUANT_ZERO_BYTES  # metadata bytes per quantised group
KV_INT8_SCALE_BYTES = 4  # float32 scale per (token, KV head), for K and for V (engine.attention.INT8_SCALE_DTYPE)
KV_DTYPE_BITS = {"auto": 16, "int8": 8}  # the engine's ``kv_dtype`` names -> kv_bits


def check_quant(weight_bits: int, kv_bits: int, group_size: int) -> None:
    check_choice(weight_bits, "quant.weight_bits", WEIGHT_BITS)
    check_choice(kv_bits, "quant.kv_bits", KV_BITS)
    check_int(group_size, "quant.group_size", 1)


def kv_bits_of(kv_dtype: str) -> int:
    """kv_bits for the engine's ``kv_dtype`` ("auto": the model dtype, "int8")."""
    return KV_DTYPE_BITS[check_choice(kv_dtype, "kv_dtype", KV_DTYPE_BITS)]


def act_bytes(m: ModelSpec) -> int:
    """Bytes per activation / unquantised weight element (the model dtype)."""
    return DTYPE_BYTES[m.dtype]


# ---- parameter counts ----------------------------------------------------------------------------------------------

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


# ---- weight bytes --------------------------------------------------------------------------------------------------

def linear_weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """Bytes of the decoder's linear weights as stored: the model dtype when unquantised, else b/8 per weight plus
    a 16-bit scale and a 16-bit zero point per group of ``group_size`` (n·b/8 + n·4/G)."""
    check_quant(weight_bits, 16, group_size)
    n = quantised_params(m)
    if weight_bits == 16:
        return float(n * act_bytes(m))
    return n * weight_bits / 8 + n * GROUP_BYTES / group_size


def weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """All weights as stored. For a 16-bit model: W·[(1 − f) + f·b/16 + 2f/G] with f = quantised fraction."""
    rest = total_params(m) - quantised_params(m)
    return rest * act_bytes(m) + linear_weight_bytes(m, weight_bits, group_size)


# ---- KV bytes and capacity -----------------------------------------------------------------------------------------

def kv_bytes_per_token(m: ModelSpec, kv_bits: int = 16) -> float:
    """K and V of every layer, int8 scales included: 2·L·Hkv·Dh·(model dtype bytes) for 16-bit KV,
    2·L·Hkv·(Dh + 4) for int8 KV (one float32 scale per token and KV head, for K and for V)."""
    check_quant(16, kv_bits, 1)
    if kv_bits == 16:
        per_head = m.head_dim * act_bytes(m)
    else:
        per_head = m.head_dim * kv_bits // 8 + KV_INT8_SCALE_BYTES
    return float(2 * m.num_layers * m.num_kv_heads * per_head)


def kv_bytes_per_block(m: ModelSpec, block_size: int, kv_bits: int = 16) -> float:
    """One paged block of ``block_size`` tokens over all layers (K, V and int8 scales)."""
    check_int(block_size, "kv.block_size", 1)
    return kv_bytes_per_token(m, kv_bits) * block_size


def num_blocks_for_memory(m: ModelSpec, block_size: int, bytes_budget: float, kv_bits: int = 16) -> int:
    """Whole blocks that fit in ``bytes_budget`` bytes (0 when none does; callers decide whether that is an error)."""
    return max(0, int(bytes_budget // kv_bytes_per_block(m, block_size, kv_bits)))


def kv_capacity_gain(m: ModelSpec, kv_bits: int) -> float:
    """Tokens a KV budget holds at ``kv_bits`` over those it holds with model-dtype KV (1.94x for int8 vs 16-bit
    at head_dim 128: the float32 scales take 4 of every 132 bytes)."""
    return kv_bytes_per_token(m, 16) / kv_bytes_per_token(m, kv_bits)


def kv_heads_per_device(m: ModelSpec, tp: int) -> int:
    """KV heads each tensor-parallel device stores; replicated when tp > Hkv (as vLLM does)."""
    check_int(tp, "cost_model.tp", 1)
    if m.num_heads % tp:
        raise ValueError(f"cost_model.tp={tp} must divide model.num_heads={m.num_heads}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ValueError(f"cost_model.tp={tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other")
    return max(1, m.num_kv_heads // tp)


def kv_bytes_per_token_per_device(m: ModelSpec, kv_bits: int = 16, tp: int = 1) -> float:
    """``kv_bytes_per_token`` for the KV heads one tensor-parallel device stores."""
    return kv_bytes_per_token(m, kv_bits) * kv_heads_per_device(m, tp) / m.num_kv_heads


def max_concurrent_seqs(m: ModelSpec, kv_budget_bytes: float, context: int, kv_bits: int = 16, tp: int = 1) -> int:
    """Sequences of ``context`` tokens whose KV (int8 scales included) fits in ``kv_budget_bytes`` per device
    (0 if the budget is < 0).

    Ignores activation workspace and paged-block rounding: an upper bound on what an engine admits.
    """
    if context < 1:
        raise ValueError(f"context={context}; allowed: an integer >= 1")
    return max(0, math.floor(kv_budget_bytes / (context * kv_bytes_per_token_per_device(m, kv_bits, tp))))


# ---- FLOPs ---------------------------------------------------------------------------------------------------------

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
