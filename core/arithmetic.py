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

Mixture of experts (``ModelSpec.moe``): an MoE layer stores every routed expert, a token multiplies only its top_k
(plus the shared experts): ``total_params`` counts all of them, ``active_params`` and the FLOPs the top_k. The router
(a [experts, hidden] matrix per MoE layer) is computed by every token but stays in the model dtype when the
experts are quantised, as AWQ/GPTQ checkpoints and vLLM keep it. Layers a model keeps dense
(``MoESpec.dense_layers``) have the dense MLP; ``moe_layers`` / ``dense_layers`` list them for a cost model.

Multi-head latent attention (``ModelSpec.mla``, DeepSeek-V2/V3) caches one latent of kv_lora_rank plus one RoPE key
of qk_rope_head_dim per token and layer, shared by all heads: L·(r_kv + Drope) elements per token (DeepSeek-V2-Lite
in bf16: 27·(512 + 64)·2 = 31,104 B), and every tensor-parallel device stores all of it (it has no head axis).

KV: K and V of every layer and KV head per token. An int8 KV cache also stores one float32 scale per (token,
KV head) for K and one for V (engine/attention.py, kernels/kv_store.py), so per token it takes
2·L·Hkv·(Dh + 4) bytes, not 2·L·Hkv·Dh: at head_dim 128 int8 holds 2·128/(128 + 4) = 1.94x the tokens of 16-bit KV,
not 2x.

numpy-free and torch-free: plain Python arithmetic on a ModelSpec.
"""

from __future__ import annotations

import math
from collections import Counter

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


def quant_input_widths(m: ModelSpec, tp: int = 1, expert_shard: int | None = None) -> dict[str, float]:
    """Input widths of the linear layers one tensor-parallel device multiplies: the column-parallel ones read the
    whole hidden state (or MLA's whole latents), the row-parallel ones 1/tp of theirs (o_proj, down_proj; an
    expert's down_proj 1/``expert_shard``, the devices one expert is split over, default tp)."""
    v_dim = m.mla.v_head_dim if m.mla is not None else m.head_dim
    out: dict[str, float] = {"hidden": m.hidden_size, "attention": m.num_heads * v_dim / tp}
    if m.moe is None or m.moe.dense_layers:
        out["FFN"] = m.intermediate_size / tp
    if m.moe is not None:
        out["expert FFN"] = m.moe.intermediate_size / (expert_shard or tp)
    if m.mla is not None:
        out["kv latent"] = m.mla.kv_lora_rank
        if m.mla.q_lora_rank:
            out["q latent"] = m.mla.q_lora_rank
    return out


def check_group_size(m: ModelSpec, weight_bits: int, group_size: int, tp: int = 1,
                     expert_shard: int | None = None) -> None:
    """Quantised weights (``weight_bits`` < 16) are stored in groups along each linear layer's input: a group must
    divide every input width a device multiplies (``quant_input_widths``), as the engine's and vLLM's kernels
    require."""
    if weight_bits >= 16:
        return
    widths = quant_input_widths(m, tp, expert_shard)
    if any(w % group_size for w in widths.values()):
        where = f" per device at tp={tp}" if tp > 1 else ""
        raise ValueError(f"quant.group_size={group_size} must divide the linear layers' input widths{where} ("
                         + ", ".join(f"{k} {w:g}" for k, w in widths.items()) + ")")


def kv_bits_of(kv_dtype: str) -> int:
    """kv_bits for the engine's ``kv_dtype`` ("auto": the model dtype, "int8")."""
    return KV_DTYPE_BITS[check_choice(kv_dtype, "kv_dtype", KV_DTYPE_BITS)]


def act_bytes(m: ModelSpec) -> int:
    """Bytes per activation / unquantised weight element (the model dtype)."""
    return DTYPE_BYTES[m.dtype]


# ---- layer kinds --------------------------------------------------------------------------------------------------

def is_moe_layer(m: ModelSpec, layer: int) -> bool:
    """Whether decoder layer ``layer`` routes to experts (else it has the dense MLP)."""
    return m.moe is not None and layer not in m.moe.dense_layers


def moe_layers(m: ModelSpec) -> list[int]:
    return [i for i in range(m.num_layers) if is_moe_layer(m, i)]


def dense_layers(m: ModelSpec) -> list[int]:
    return [i for i in range(m.num_layers) if not is_moe_layer(m, i)]


def _layer(m: ModelSpec, layer: int | None) -> int:
    """``layer``, or for None a layer of a model whose layers are all alike (all dense or all MoE)."""
    if layer is not None:
        return layer
    if 0 < len(moe_layers(m)) < m.num_layers:
        raise ValueError(f"model {m.name!r} has dense and MoE layers: pass the layer index")
    return 0


# ---- parameter counts ----------------------------------------------------------------------------------------------

def attention_params_per_layer(m: ModelSpec) -> int:
    """Attention weight matrices. GQA: q, k, v, o: d·(H·Dh) + 2·d·(Hkv·Dh) + (H·Dh)·d. MLA: q (d -> H·Dqk, or
    through the q_lora_rank bottleneck r_q: d·r_q + r_q·H·Dqk), the latent and RoPE key (d -> r_kv + Drope), the
    latent's up-projection to each head's key and value (r_kv -> H·(Dnope + Dv)) and o (H·Dv -> d)."""
    d, h = m.hidden_size, m.num_heads
    if m.mla is None:
        q, kv = h * m.head_dim, m.num_kv_heads * m.head_dim
        return d * q + 2 * d * kv + q * d
    a = m.mla
    q_out = h * a.qk_head_dim
    q = d * q_out if a.q_lora_rank is None else d * a.q_lora_rank + a.q_lora_rank * q_out
    return q + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) \
        + h * a.v_head_dim * d


def attention_params_per_device(m: ModelSpec, tp: int = 1) -> float:
    """Attention weight matrices one of ``tp`` tensor-parallel devices holds: 1/tp of the head-sharded ones, plus
    what vLLM keeps whole on every device: MLA's down-projections (q_a and kv_a with the RoPE key: no head axis to
    split), and with tp > Hkv the K / V projections of the KV heads each device replicates."""
    whole = attention_params_per_layer(m)
    if tp == 1:
        return float(whole)
    d = m.hidden_size
    if m.mla is not None:
        a = m.mla
        down = d * (a.kv_lora_rank + a.qk_rope_head_dim) + (d * a.q_lora_rank if a.q_lora_rank else 0)
        return down + (whole - down) / tp
    kv = 2 * d * m.head_dim * m.num_kv_heads
    return (whole - kv) / tp + 2 * d * m.head_dim * kv_heads_per_device(m, tp)


def ffn_width(m: ModelSpec, layer: int | None = None, active: bool = False) -> int:
    """The summed intermediate width of a layer's SwiGLU FFNs: the dense MLP's, or an MoE layer's routed experts
    (all of them; the top_k one token runs with ``active``) and shared experts."""
    if not is_moe_layer(m, _layer(m, layer)):
        return m.intermediate_size
    routed = m.moe.top_k if active else m.moe.num_experts
    return (routed + m.moe.num_shared_experts) * m.moe.intermediate_size


def _swiglu_params(m: ModelSpec, width: int) -> int:
    """gate, up, down of a SwiGLU FFN of intermediate width ``width``: 3·d·width."""
    return 3 * m.hidden_size * width


def mlp_params_per_layer(m: ModelSpec, layer: int | None = None, active: bool = False) -> int:
    """Gated MLP (gate, up, down): 3·d·F over the layer's FFN width (``ffn_width``)."""
    return _swiglu_params(m, ffn_width(m, layer, active))


def expert_params(m: ModelSpec) -> int:
    """One routed (or shared) expert's weights: 3·d·F_expert."""
    if m.moe is None:
        raise ValueError(f"model {m.name!r} has no experts (model.moe is null)")
    return _swiglu_params(m, m.moe.intermediate_size)


def router_params(m: ModelSpec, layer: int | None = None) -> int:
    """The router of an MoE layer (experts x d; 0 for a dense layer)."""
    return m.moe.num_experts * m.hidden_size if is_moe_layer(m, _layer(m, layer)) else 0


def linear_params_per_layer(m: ModelSpec, layer: int | None = None, active: bool = False) -> int:
    """Weight matrices of one decoder layer: what weight-only quantisation compresses (the router excluded);
    ``active``: those one token multiplies (its top_k routed experts)."""
    return attention_params_per_layer(m) + mlp_params_per_layer(m, layer, active)


def _attention_extra_params(m: ModelSpec) -> int:
    """Attention parameters besides the weight matrices: q/k/v biases (Qwen2), the q and k RMSNorm weights
    (Qwen3: one head_dim vector each), MLA's RMSNorms of its latents (r_kv, and r_q when q has a bottleneck)."""
    if m.mla is not None:
        return m.mla.kv_lora_rank + (m.mla.q_lora_rank or 0)
    bias = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.attention_bias else 0
    return bias + (2 * m.head_dim if m.qk_norm else 0)


def params_per_layer(m: ModelSpec, layer: int | None = None) -> int:
    """Linear weights + router + attention biases and norms + the two RMSNorm weights."""
    return (linear_params_per_layer(m, layer) + router_params(m, layer) + _attention_extra_params(m)
            + 2 * m.hidden_size)


def embedding_params(m: ModelSpec) -> int:
    return m.vocab_size * m.hidden_size


def total_params(m: ModelSpec) -> int:
    """Layers + embeddings + untied LM head + final norm."""
    head = 0 if m.tie_word_embeddings else embedding_params(m)
    return sum(params_per_layer(m, i) for i in range(m.num_layers)) + embedding_params(m) + head + m.hidden_size


def active_params(m: ModelSpec) -> int:
    """Parameters one token uses: all but the routed experts it skips (num_experts - top_k per MoE layer).
    Embeddings and the LM head count, as in Mixtral's and Qwen3-MoE's published active counts (DeepSeek's leave out
    the embedding table)."""
    unused = sum(linear_params_per_layer(m, i) - linear_params_per_layer(m, i, active=True)
                 for i in moe_layers(m))
    return total_params(m) - unused


def quantised_params(m: ModelSpec) -> int:
    return sum(linear_params_per_layer(m, i) for i in range(m.num_layers))


# ---- weight bytes --------------------------------------------------------------------------------------------------

def linear_weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """Bytes of the decoder's linear weights as stored: the model dtype when unquantised, else b/8 per weight plus
    a 16-bit scale and a 16-bit zero point per group of ``group_size`` (n·b/8 + n·4/G)."""
    check_quant(weight_bits, 16, group_size)
    return stored_bytes(m, quantised_params(m), weight_bits, group_size)


def stored_bytes(m: ModelSpec, n: int, weight_bits: int = 16, group_size: int = 128) -> float:
    """``n`` linear weights as stored: n·(dtype bytes), or n·b/8 + n·4/G quantised."""
    if weight_bits == 16:
        return float(n * act_bytes(m))
    return n * weight_bits / 8 + n * GROUP_BYTES / group_size


def weight_bytes(m: ModelSpec, weight_bits: int = 16, group_size: int = 128) -> float:
    """All weights as stored. For a 16-bit model: W·[(1 − f) + f·b/16 + 2f/G] with f = quantised fraction."""
    rest = total_params(m) - quantised_params(m)
    return rest * act_bytes(m) + linear_weight_bytes(m, weight_bits, group_size)


# ---- KV bytes and capacity -----------------------------------------------------------------------------------------

def _kv_vectors(m: ModelSpec) -> tuple[int, int]:
    """(vectors, elements per vector) cached per token and layer: K and V of each KV head (2·Hkv of Dh), or MLA's
    latent with its RoPE key (1 of r_kv + Drope)."""
    if m.mla is not None:
        return 1, m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    return 2 * m.num_kv_heads, m.head_dim


def kv_bytes_per_token(m: ModelSpec, kv_bits: int = 16) -> float:
    """Every layer's cached vectors, int8 scales included: 2·L·Hkv·Dh·(model dtype bytes) for 16-bit KV,
    2·L·Hkv·(Dh + 4) for int8 KV (one float32 scale per token and KV head, for K and for V); MLA:
    L·(r_kv + Drope) elements (+ one scale per token and layer in int8)."""
    check_quant(16, kv_bits, 1)
    vectors, width = _kv_vectors(m)
    if kv_bits == 16:
        per_vector = width * act_bytes(m)
    else:
        per_vector = width * kv_bits // 8 + KV_INT8_SCALE_BYTES
    return float(m.num_layers * vectors * per_vector)


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
    check_int(tp, "parallel.tp", 1)
    if m.num_heads % tp:
        raise ValueError(f"parallel.tp={tp} must divide model.num_heads={m.num_heads}")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ValueError(f"parallel.tp={tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other")
    return max(1, m.num_kv_heads // tp)


def kv_bytes_per_token_per_device(m: ModelSpec, kv_bits: int = 16, tp: int = 1) -> float:
    """``kv_bytes_per_token`` for the KV heads one tensor-parallel device stores (all of MLA's latent: it has no
    head axis to split, so every device keeps it whole, as vLLM does)."""
    if m.mla is not None:
        kv_heads_per_device(m, tp)  # validates tp
        return kv_bytes_per_token(m, kv_bits)
    return kv_bytes_per_token(m, kv_bits) * kv_heads_per_device(m, tp) / m.num_kv_heads


def max_concurrent_seqs(m: ModelSpec, kv_budget_bytes: float, context: int, kv_bits: int = 16, tp: int = 1,
                        layers: range | None = None) -> int:
    """Sequences of ``context`` tokens whose KV (int8 scales included) of ``layers`` (a pipeline stage's; default
    all) fits in ``kv_budget_bytes`` per device (0 if the budget is < 0).

    Ignores activation workspace and paged-block rounding: an upper bound on what an engine admits.
    """
    if context < 1:
        raise ValueError(f"context={context}; allowed: an integer >= 1")
    return max(0, math.floor(kv_budget_bytes / (context * kv_bytes_per_token_of_stage(m, kv_bits, tp, layers))))


# ---- FLOPs ---------------------------------------------------------------------------------------------------------

def linear_flops_per_token(m: ModelSpec) -> float:
    """2 FLOPs (multiply + add) per weight a token multiplies, all layers: attention, dense MLPs, and in MoE layers
    the router, the top_k routed and the shared experts; excludes the LM head."""
    return 2.0 * sum(linear_params_per_layer(m, i, active=True) + router_params(m, i) for i in range(m.num_layers))


def lm_head_flops_per_token(m: ModelSpec) -> float:
    """Per sampled token (one logits row): 2·V·d."""
    return 2.0 * m.vocab_size * m.hidden_size


def _attention_head_dims(m: ModelSpec) -> tuple[int, int]:
    """(query/key, value) head sizes: Dh and Dh, or MLA's qk_nope + qk_rope and v_head_dim."""
    return (m.head_dim, m.head_dim) if m.mla is None else (m.mla.qk_head_dim, m.mla.v_head_dim)


def attention_flops_per_pair(m: ModelSpec) -> float:
    """Per (query, key) pair summed over layers: 2·H·(Dqk + Dv) per layer (QK^T and PV, 2 FLOPs per MAC each;
    4·H·Dh for GQA). MLA counts its heads' own dimensions, as when keys and values are up-projected from the
    latent (an engine that absorbs the up-projections into q and o attends over the latent instead)."""
    qk, v = _attention_head_dims(m)
    return 2.0 * m.num_heads * (qk + v) * m.num_layers


def flops_per_token(m: ModelSpec, context: int = 0, sampled: bool = True) -> float:
    """One token attending to ``context`` keys (itself included), with its logits row if ``sampled``."""
    head = lm_head_flops_per_token(m) if sampled else 0.0
    return linear_flops_per_token(m) + head + attention_flops_per_pair(m) * context


def _rotated_width(m: ModelSpec) -> int:
    """Elements of one token's q and k that RoPE rotates: every q and KV head, or MLA's RoPE parts (H query heads
    and the one shared key)."""
    if m.mla is None:
        return (m.num_heads + m.num_kv_heads) * m.head_dim
    return (m.num_heads + 1) * m.mla.qk_rope_head_dim


def _elementwise_elements(m: ModelSpec, layer: int, tp: int) -> float:
    """elementwise_bytes_per_token's elements of one layer."""
    qk = 2 * _rotated_width(m) * (2 if m.qk_norm else 1)
    return 10 * m.hidden_size + (3 * ffn_width(m, layer, active=True) + qk) / tp


def elementwise_bytes_per_token(m: ModelSpec, tp: int = 1) -> float:
    """Activation traffic of the memory-bound ops per token per device, all layers.

    Per layer: two RMSNorms (read + write d each: 4d), two residual adds (read 2d, write d each: 6d), replicated
    on every tensor-parallel device; the SwiGLU activation of the FFNs a token runs (read 2F, write F; F of its
    top_k and shared experts in MoE layers) and RoPE on q and k (read + write; Qwen3's q/k norms read and write the
    same elements again), split across devices.
    """
    # layers of one kind are summed as count x bytes: a dense model's figure stays bit-identical to L x its layer's
    kinds = Counter(_elementwise_elements(m, i, tp) for i in range(m.num_layers))
    return float(sum(act_bytes(m) * n * elements for elements, n in kinds.items()))


# ---- parallel deployments: what one device holds -------------------------------------------------------------------

def stage_layers(m: ModelSpec, pp: int = 1) -> list[range]:
    """The decoder layers of each of ``pp`` pipeline stages: L // pp each, the remainder one more on the stages
    before the last (vLLM's ``get_pp_indices``: the last stage also runs the LM head)."""
    check_int(pp, "parallel.pp", 1)
    if pp > m.num_layers:
        raise ValueError(f"parallel.pp={pp} stages > model.num_layers={m.num_layers}")
    sizes = [m.num_layers // pp] * pp
    for i in range(2, m.num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def weight_bytes_per_device(m: ModelSpec, weight_bits: int = 16, group_size: int = 128, tp: int = 1,
                            layers: range | None = None, moe_ranks: int = 1, first: bool = True,
                            last: bool = True) -> float:
    """Weights one device of a stage holds: the stage's ``layers`` (default all) split over ``tp`` (routed experts
    over the ``moe_ranks`` = tp x dp devices of the MoE layers, whatever the expert-parallel degree: ep groups of
    experts, each sharded over tp x dp / ep devices), the embedding on the ``first`` stage and the LM head on the
    ``last``, vocabulary-parallel over tp; norms replicated. Tied embeddings share one table only when the first
    stage is also the last: with pp > 1 the last stage keeps its own copy for the LM head, as vLLM's models do."""
    layers = range(m.num_layers) if layers is None else layers
    routed = sum(m.moe.num_experts * expert_params(m) for i in layers if is_moe_layer(m, i))
    # tp x (what one device holds) of the attention, so that / tp below is per device (replicated parts whole)
    attention = len(layers) * (tp * attention_params_per_device(m, tp) - attention_params_per_layer(m))
    dense = sum(linear_params_per_layer(m, i) for i in layers) - routed + attention
    rest = sum(params_per_layer(m, i) - linear_params_per_layer(m, i) for i in layers)  # router, norms, biases
    own_head = last and not (m.tie_word_embeddings and first)  # a tied table is the head only on its own stage
    vocab = embedding_params(m) * ((1 if first else 0) + (1 if own_head else 0))
    return (stored_bytes(m, dense, weight_bits, group_size) / tp
            + stored_bytes(m, routed, weight_bits, group_size) / max(tp, moe_ranks)
            + (rest + vocab / tp + (m.hidden_size if last else 0)) * act_bytes(m))


def kv_bytes_per_token_of_stage(m: ModelSpec, kv_bits: int = 16, tp: int = 1, layers: range | None = None) -> float:
    """``kv_bytes_per_token_per_device`` for the KV of a stage's ``layers`` only (default all)."""
    full = kv_bytes_per_token_per_device(m, kv_bits, tp)
    n = m.num_layers if layers is None else len(layers)
    return full if n == m.num_layers else full * n / m.num_layers
