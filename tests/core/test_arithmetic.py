"""Model arithmetic against published parameter counts, hand formulas, transformers' own models and the bytes the
engine's tensors really take (KV caches, W4A16 weights); mixture-of-experts and MLA models from the public
config.json files in hf_configs/."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core import arithmetic as ar
from core.specs import ModelSpec
from tests.core.test_specs import HF_CONFIGS, from_hf, hf_config

LLAMA2_7B = ModelSpec("llama2_7b", 32, 4096, 32, 32, 128, 11008, 32000, dtype="float16")
LLAMA3_8B = ModelSpec("llama3_8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA2_70B = ModelSpec("llama2_70b", 80, 8192, 64, 8, 128, 28672, 32000, dtype="float16")
QWEN2_05B = ModelSpec("qwen2_0_5b", 24, 896, 14, 2, 64, 4864, 151936, architecture="qwen2",
                      tie_word_embeddings=True, attention_bias=True)
TINY = ModelSpec("tiny", 4, 256, 8, 4, 32, 768, 4096, dtype="float32")
# small enough to build on CPU in milliseconds; every linear input width (64, 4*16, 128) divides by 16 and 32
ENGINE_TINY = ModelSpec("engine_tiny", 2, 64, 4, 2, 16, 128, 160, dtype="float32")


@pytest.mark.parametrize(("spec", "published"), [
    (LLAMA2_7B, 6_738_415_616), (LLAMA3_8B, 8_030_261_248), (LLAMA2_70B, 68_976_648_192), (QWEN2_05B, 494_032_768),
])
def test_total_params_match_published_counts(spec, published):
    assert ar.total_params(spec) == published


def test_llama2_7b_params_by_hand():
    # per layer: q, k, v, o 4096x4096 + gate/up/down 4096x11008 + two 4096 norms; embeddings and head 32000x4096
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert ar.total_params(LLAMA2_7B) == 32 * layer + 2 * 32000 * 4096 + 4096 == 6_738_415_616  # "6.74e9"
    assert ar.quantised_params(LLAMA2_7B) == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) == 6_476_005_376


def test_per_layer_counts_by_hand():
    # Llama-3-8B: q,o 4096x4096; k,v 4096x1024; gate/up/down 4096x14336.
    assert ar.attention_params_per_layer(LLAMA3_8B) == 2 * 4096 * 4096 + 2 * 4096 * 1024
    assert ar.mlp_params_per_layer(LLAMA3_8B) == 3 * 4096 * 14336
    assert ar.params_per_layer(LLAMA3_8B) == 218_112_000  # + two 4096 norms


def test_tiny_has_a_few_million_params():
    assert 1e6 < ar.total_params(TINY) < 1e7


@pytest.mark.parametrize("spec", [TINY, replace(QWEN2_05B, num_layers=2, vocab_size=1000)])
def test_total_params_match_transformers(spec):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
              num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
              vocab_size=spec.vocab_size, tie_word_embeddings=spec.tie_word_embeddings)
    cfg = (transformers.Qwen2Config if spec.architecture == "qwen2" else transformers.LlamaConfig)(**kw)
    cls = transformers.Qwen2ForCausalLM if spec.architecture == "qwen2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(cfg)
    assert ar.total_params(spec) == sum(p.numel() for p in model.parameters())


# ---- MoE and MLA models ------------------------------------------------------------------------------------------

MIXTRAL, QWEN3_32B = from_hf("Mixtral-8x7B-v0.1"), from_hf("Qwen3-32B")
QWEN3_MOE, V2_LITE, V3 = from_hf("Qwen3-30B-A3B-Instruct-2507"), from_hf("DeepSeek-V2-Lite"), from_hf("DeepSeek-V3")


@pytest.mark.parametrize(("config", "published"), [
    ("Mixtral-8x7B-v0.1", 46.7e9), ("Qwen3-30B-A3B-Instruct-2507", 30.5e9), ("DeepSeek-V2-Lite", 15.7e9),
    ("Llama-3.1-8B", 8.03e9), ("Qwen3-32B", 32.8e9), ("Llama-3.1-70B", 70.6e9), ("DeepSeek-V3", 671e9),
])
def test_total_params_match_published_totals(config, published):
    assert ar.total_params(from_hf(config)) == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize(("spec", "published", "embedding_table"), [
    (MIXTRAL, 12.9e9, True), (QWEN3_MOE, 3.3e9, True), (V2_LITE, 2.4e9, False), (V3, 37e9, False),
])
def test_active_params_match_published_counts(spec, published, embedding_table):
    """Published active counts have two or three significant digits: ours lie within one unit of the last one.
    DeepSeek's leave out the embedding table (a lookup, not a matmul); Mistral's and Qwen's count it."""
    ours = ar.active_params(spec) - (0 if embedding_table else ar.embedding_params(spec))
    unit = 10 ** math.floor(math.log10(published) - 1)  # 12.9e9 -> 0.1e9, 3.3e9 -> 0.1e9, 37e9 -> 1e9
    assert abs(ours - published) < unit


@pytest.mark.parametrize("config", sorted(p.stem for p in HF_CONFIGS.glob("*.json")))
def test_total_params_match_transformers_full_size(config):
    """transformers builds each released model on the meta device (no memory): the same parameter count, exactly."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = hf_config(config)
    cfg = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                                 if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = getattr(transformers, hf["architectures"][0])(cfg)
    assert ar.total_params(from_hf(config)) == sum(p.numel() for p in model.parameters())


def test_mixtral_by_hand():
    d, layers = 4096, 32
    attention = 2 * d * d + 2 * d * 1024
    expert = 3 * d * 14336
    layer = attention + 8 * expert + 8 * d + 2 * d  # + router + two norms
    assert ar.moe_layers(MIXTRAL) == list(range(layers)) and ar.dense_layers(MIXTRAL) == []
    assert ar.expert_params(MIXTRAL) == expert and ar.router_params(MIXTRAL, 0) == 8 * d
    with pytest.raises(ValueError, match="has no experts"):
        ar.expert_params(LLAMA3_8B)
    assert ar.params_per_layer(MIXTRAL) == layer
    assert ar.total_params(MIXTRAL) == layers * layer + 2 * 32000 * d + d == 46_702_792_704
    assert ar.active_params(MIXTRAL) == ar.total_params(MIXTRAL) - layers * 6 * expert == 12_879_925_248
    # FLOPs: the top-2 experts and the router, not all 8 experts
    assert ar.linear_flops_per_token(MIXTRAL) == 2 * layers * (attention + 2 * expert + 8 * d)
    assert ar.quantised_params(MIXTRAL) == layers * (attention + 8 * expert)  # the router stays 16-bit


def test_qwen3_by_hand():
    # Qwen3-32B: head_dim 128 x 64 heads = 8192 wide q from a 5120 hidden size; q and k norms of 128 per layer
    d = 5120
    attention = d * 8192 + 2 * d * 1024 + 8192 * d
    assert ar.attention_params_per_layer(QWEN3_32B) == attention
    assert ar.params_per_layer(QWEN3_32B) == attention + 3 * d * 25600 + 2 * 128 + 2 * d
    # Qwen3-30B-A3B: 128 experts of width 768, 8 active; 48 MoE layers
    assert ar.ffn_width(QWEN3_MOE) == 128 * 768 and ar.ffn_width(QWEN3_MOE, active=True) == 8 * 768
    assert ar.active_params(QWEN3_MOE) == ar.total_params(QWEN3_MOE) - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704


def test_deepseek_v2_lite_by_hand():
    d, h = 2048, 16
    q = d * h * 192  # no q_lora_rank: q straight from the hidden state
    kv = d * (512 + 64) + 512 * h * (128 + 128)
    attention = q + kv + h * 128 * d
    assert ar.attention_params_per_layer(V2_LITE) == attention == 13_762_560
    assert ar.dense_layers(V2_LITE) == [0] and ar.moe_layers(V2_LITE) == list(range(1, 27))
    dense = attention + 3 * d * 10944 + 512 + 2 * d  # + the latent's norm + two norms
    moe = attention + 64 * 3 * d * 1408 + 3 * d * 2 * 1408 + 64 * d + 512 + 2 * d  # routed, 2 shared, router
    assert ar.params_per_layer(V2_LITE, 0) == dense and ar.params_per_layer(V2_LITE, 1) == moe
    assert ar.total_params(V2_LITE) == dense + 26 * moe + 2 * 102400 * d + d == 15_706_484_224
    with pytest.raises(ValueError, match="dense and MoE layers: pass the layer index"):
        ar.params_per_layer(V2_LITE)
    # the cache: one latent of 512 and one RoPE key of 64 per token and layer, 2 bytes each in bf16
    assert ar.kv_bytes_per_token(V2_LITE) == (512 + 64) * 27 * 2 == 31_104
    assert ar.kv_bytes_per_token(V2_LITE, kv_bits=8) == (512 + 64 + 4) * 27  # int8 + one float32 scale
    assert ar.kv_bytes_per_token_per_device(V2_LITE, tp=4) == 31_104  # no head axis: every device holds it all
    assert ar.attention_flops_per_pair(V2_LITE) == 2 * h * (192 + 128) * 27
    # elementwise: the SwiGLU of 6 routed + 2 shared experts in MoE layers, RoPE on 16 query heads + 1 shared key
    per_layer = [10 * d + 3 * (10944 if i == 0 else 8 * 1408) + 2 * 17 * 64 for i in range(27)]
    assert ar.elementwise_bytes_per_token(V2_LITE) == 2 * sum(per_layer)


def test_deepseek_v3_q_lora_bottleneck():
    q = 7168 * 1536 + 1536 * 128 * 192
    assert ar.attention_params_per_layer(V3) == q + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert ar.params_per_layer(V3, 0) - ar.linear_params_per_layer(V3, 0) == 512 + 1536 + 2 * 7168


def test_moe_weight_bytes_keep_the_router_16_bit():
    # Mixtral: what stays in bf16 under W4 is the 32 routers (8 x 4096) and norms, the embeddings and the LM head
    rest = 32 * (8 * 4096 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert ar.total_params(MIXTRAL) - ar.quantised_params(MIXTRAL) == rest
    assert ar.weight_bytes(MIXTRAL, 4, 128) == 2 * rest + ar.quantised_params(MIXTRAL) * (0.5 + 4 / 128)


def test_flops_follow_active_params():
    """~2 FLOPs per active parameter (embedding lookup aside): the rule of thumb holds for MoE with active params."""
    for spec in (MIXTRAL, QWEN3_MOE, V2_LITE):
        rest = ar.active_params(spec) - ar.embedding_params(spec)  # the LM head is in lm_head_flops_per_token
        assert ar.flops_per_token(spec) == pytest.approx(2 * rest, rel=0.01)


# ---- KV bytes ------------------------------------------------------------------------------------------------------

def test_kv_bytes_per_token():
    assert ar.kv_bytes_per_token(LLAMA3_8B) == 2 * 32 * 8 * 128 * 2 == 131072
    assert ar.kv_bytes_per_token(LLAMA2_7B) == 524288
    assert ar.kv_bytes_per_token(LLAMA2_70B) == 2 * 80 * 8 * 128 * 2
    assert ar.kv_bytes_per_token(TINY) == 2 * 4 * 4 * 32 * 4  # float32 model: unquantised KV is 4 bytes


def test_int8_kv_bytes_per_token_count_the_float32_scales():
    # K and V x 32 layers x 8 KV heads x (128 int8 elements + one 4-byte float32 scale)
    assert ar.kv_bytes_per_token(LLAMA3_8B, kv_bits=8) == 2 * 32 * 8 * (128 + 4) == 67584
    assert ar.kv_bytes_per_token(TINY, kv_bits=8) == 2 * 4 * 4 * (32 + 4)
    # capacity gain vs 16-bit at head_dim 128: 2 * 128 / (128 + 4) = 1.939x, not 2x
    assert ar.kv_capacity_gain(LLAMA3_8B, 8) == pytest.approx(256 / 132) == pytest.approx(1.9394, abs=1e-4)
    assert ar.kv_capacity_gain(LLAMA3_8B, 16) == 1.0
    assert ar.kv_capacity_gain(TINY, 8) == pytest.approx(4 * 32 / 36)  # float32 model: 3.56x, not 4x


def test_kv_bytes_per_block_and_blocks_for_a_budget():
    assert ar.kv_bytes_per_block(LLAMA3_8B, 16) == 16 * 131072
    assert ar.kv_bytes_per_block(LLAMA3_8B, 16, 8) == 16 * 67584
    # 1 GB: 1e9 // (16 * 131072) = 476 blocks of 16-bit KV; 1e9 // (16 * 67584) = 924 int8 blocks (not 952)
    assert ar.num_blocks_for_memory(LLAMA3_8B, 16, 1e9) == 476
    assert ar.num_blocks_for_memory(LLAMA3_8B, 16, 1e9, 8) == 924
    assert ar.num_blocks_for_memory(LLAMA3_8B, 16, 16 * 131072) == 1
    assert ar.num_blocks_for_memory(LLAMA3_8B, 16, 16 * 131072 - 1) == 0
    assert ar.num_blocks_for_memory(LLAMA3_8B, 16, -5.0) == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            ar.kv_bytes_per_block(LLAMA3_8B, bad)


def test_kv_bits_of_engine_kv_dtype():
    assert ar.kv_bits_of("auto") == 16 and ar.kv_bits_of("int8") == 8
    with pytest.raises(ValueError, match="kv_dtype='fp8'"):
        ar.kv_bits_of("fp8")


@pytest.mark.parametrize(("dtype_name", "kv_dtype"), [("float32", "auto"), ("float16", "auto"), ("bfloat16", "auto"),
                                                      ("float32", "int8"), ("float16", "int8")])
def test_engine_kv_tensors_take_the_core_bytes(dtype_name, kv_dtype):
    torch = pytest.importorskip("torch")
    from engine.attention import INT8_SCALE_DTYPE, allocate_kv_caches

    assert INT8_SCALE_DTYPE.itemsize == ar.KV_INT8_SCALE_BYTES
    spec = replace(ENGINE_TINY, dtype=dtype_name)
    num_blocks, block_size = 7, 16
    caches = allocate_kv_caches(spec, num_blocks, block_size, getattr(torch, dtype_name), "cpu", kv_dtype)
    real = sum(t.nbytes for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)
    assert real == ar.kv_bytes_per_block(spec, block_size, ar.kv_bits_of(kv_dtype)) * num_blocks
    # by hand: 2 layers x (K, V) x 16 slots x 2 kv heads x (16 dims x element bytes [+ a 4-byte scale])
    per_slot_head = 16 + 4 if kv_dtype == "int8" else 16 * ar.DTYPE_BYTES[dtype_name]
    assert real == 2 * 2 * 16 * 2 * per_slot_head * num_blocks


# ---- weight bytes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("bits", "group"), [(4, 128), (8, 128), (4, 32), (8, 64)])
@pytest.mark.parametrize("spec", [LLAMA2_7B, LLAMA3_8B, QWEN2_05B])
def test_quantised_weight_bytes_follow_the_formula(spec, bits, group):
    """W·[(1 − f) + f·b/16 + 2f/G]: b bits per quantised weight plus a 16-bit scale and a 16-bit zero point per
    group of G."""
    w16 = ar.weight_bytes(spec)
    assert w16 == 2 * ar.total_params(spec)
    f = spec.num_layers * ar.linear_params_per_layer(spec) / ar.total_params(spec)  # quantised fraction
    assert ar.weight_bytes(spec, bits, group) == pytest.approx(w16 * ((1 - f) + f * bits / 16 + 2 * f / group),
                                                               rel=1e-12)


def test_llama2_7b_w4_g128_ratio_by_hand():
    # f = 6_476_005_376 / 6_738_415_616 = 0.96106; W4 g128 stores 4 bits + (2 B scale + 2 B zero) / 128 per weight:
    # (1 - f) + f/4 + 2f/128 = 0.2942 of the 16-bit bytes; one scale only (f/128) would be 0.2867.
    f = 6_476_005_376 / 6_738_415_616
    ratio = ar.weight_bytes(LLAMA2_7B, 4, 128) / ar.weight_bytes(LLAMA2_7B)
    assert ratio == pytest.approx((1 - f) + f / 4 + 2 * f / 128, rel=1e-12)
    assert ratio == pytest.approx(0.2942, abs=5e-5)
    assert (1 - f) + f / 4 + f / 128 == pytest.approx(0.2867, abs=5e-5)  # the old, scale-only model
    # the linear weights alone: 0.5 B + 4 B / 128 per weight
    assert ar.linear_weight_bytes(LLAMA2_7B, 4, 128) == 6_476_005_376 * (0.5 + 4 / 128)


def test_llama3_8b_w4_is_about_a_third():
    # Embeddings + untied head (1.05e9 params) stay 16-bit, so W4 is ~0.37 of 16-bit, not 0.25.
    ratio = ar.weight_bytes(LLAMA3_8B, 4, 128) / ar.weight_bytes(LLAMA3_8B)
    assert 0.33 < ratio < 0.38


@pytest.mark.parametrize("group", [16, 32])
def test_engine_w4a16_tensors_take_the_core_bytes(group):
    torch = pytest.importorskip("torch")
    from engine.loader import random_model
    from engine.model import Linear

    model = random_model(ENGINE_TINY, dtype=torch.float32, quant="w4a16", group_size=group)
    dense = sum(p.nbytes for p in model.parameters())  # embeddings, LM head, norms: the quantised weights are gone
    qws = [m.qweight for m in model.model.layers.modules() if isinstance(m, Linear)]
    assert len(qws) == ENGINE_TINY.num_layers * 4  # qkv, o, gate_up, down (fused); the LM head stays 16-bit
    assert all(q is not None and q.zeros is not None for q in qws)  # the engine always stores a zero point
    quantised = sum(q.qweight.nbytes + q.scales.nbytes + q.zeros.nbytes for q in qws)
    assert sum(q.shape[0] * q.shape[1] for q in qws) == ar.quantised_params(ENGINE_TINY)
    assert quantised == ar.linear_weight_bytes(ENGINE_TINY, 4, group)
    assert dense + quantised == ar.weight_bytes(ENGINE_TINY, 4, group)
    # by hand: n/2 bytes of nibbles + (2 + 2) bytes per group of ``group``
    n = ar.quantised_params(ENGINE_TINY)
    assert quantised == n // 2 + n // group * 4
    unquantised = random_model(ENGINE_TINY, dtype=torch.float32)
    assert sum(p.nbytes for p in unquantised.parameters()) == ar.weight_bytes(ENGINE_TINY)


# ---- FLOPs and capacity --------------------------------------------------------------------------------------------

def test_flops():
    d, layers = 4096, 32
    linear = 2 * layers * (4 * d * d + 3 * d * 11008)
    assert ar.linear_flops_per_token(LLAMA2_7B) == linear
    assert ar.lm_head_flops_per_token(LLAMA2_7B) == 2 * 32000 * d
    assert ar.attention_flops_per_pair(LLAMA2_7B) == 4 * 32 * 128 * layers
    assert ar.flops_per_token(LLAMA2_7B, context=100) == linear + 2 * 32000 * d + 100 * 4 * 32 * 128 * layers
    assert ar.flops_per_token(LLAMA2_7B, sampled=False) == linear
    # the ~2 FLOPs per parameter rule of thumb
    assert ar.flops_per_token(LLAMA2_7B) == pytest.approx(2 * ar.total_params(LLAMA2_7B), rel=0.02)


def test_max_concurrent_seqs():
    budget = 0.9 * 80e9 - 2 * 8_030_261_248
    assert ar.max_concurrent_seqs(LLAMA3_8B, budget, 2048) == math.floor(budget / (2048 * 131072)) == 208
    # int8 KV: 132 bytes per (token, layer, head, K|V) with its scale -> 404 sequences, not 2 x 208 = 416
    assert ar.max_concurrent_seqs(LLAMA3_8B, budget, 2048, kv_bits=8) == math.floor(budget / (2048 * 67584)) == 404
    assert ar.max_concurrent_seqs(LLAMA3_8B, -1e9, 2048) == 0
    # tp=2: each device holds half the KV heads, so the same per-device budget holds twice the sequences
    assert ar.max_concurrent_seqs(LLAMA3_8B, budget, 2048, tp=2) == math.floor(budget / (2048 * 65536))
    assert ar.kv_bytes_per_token_per_device(LLAMA3_8B, 8, tp=2) == 2 * 32 * 4 * 132
    with pytest.raises(ValueError, match="context"):
        ar.max_concurrent_seqs(LLAMA3_8B, budget, 0)


def test_kv_heads_per_device():
    assert ar.kv_heads_per_device(LLAMA3_8B, 1) == 8
    assert ar.kv_heads_per_device(LLAMA3_8B, 2) == 4
    assert ar.kv_heads_per_device(LLAMA2_70B, 16) == 1  # replicated beyond Hkv
    for bad in (0, 3, -1, 1.5):
        with pytest.raises(ValueError, match="tp"):
            ar.kv_heads_per_device(LLAMA3_8B, bad)


def test_bad_bits_name_key_and_allowed_values():
    with pytest.raises(ValueError, match=r"weight_bits=3.*\[16, 8, 4\]"):
        ar.weight_bytes(LLAMA3_8B, 3)
    with pytest.raises(ValueError, match=r"kv_bits=4.*\[16, 8\]"):
        ar.kv_bytes_per_token(LLAMA3_8B, 4)
    with pytest.raises(ValueError, match="group_size"):
        ar.weight_bytes(LLAMA3_8B, 4, 0)


@given(layers=st.integers(1, 8), kv=st.sampled_from([1, 2, 4]), groups=st.integers(1, 4), dh=st.sampled_from([16, 64]),
       ffn=st.integers(1, 4096), vocab=st.integers(1, 50000), tied=st.booleans())
def test_weight_bytes_shrink_with_bits(layers, kv, groups, dh, ffn, vocab, tied):
    m = ModelSpec("h", layers, kv * groups * dh, kv * groups, kv, dh, ffn, vocab, tie_word_embeddings=tied)
    w16, w8, w4 = (ar.weight_bytes(m, b) for b in (16, 8, 4))
    assert w4 < w8 < w16
    assert w16 - w4 == pytest.approx(ar.quantised_params(m) * (2 - 0.5 - 4 / 128))


def test_what_vllm_keeps_whole_on_every_tensor_parallel_device_by_hand():
    """MLA's down-projections have no head axis (DeepSeek-V2-Lite: kv_a 2048 x (512 + 64) = 1,179,648 weights, no q
    bottleneck) and stay whole; the rest, 13,762,560 - 1,179,648, splits. With tp > Hkv (Llama-3-70B, 8 KV heads,
    tp 16) each device replicates one KV head's K / V projections: 2 x 8192 x 128 instead of 1/16 of 8 heads'."""
    lite = from_hf("DeepSeek-V2-Lite")
    assert ar.attention_params_per_layer(lite) == 13_762_560
    assert ar.attention_params_per_device(lite, 2) == 1_179_648 + (13_762_560 - 1_179_648) / 2
    llama = ModelSpec("llama3_70b", 80, 8192, 64, 8, 128, 28672, 128256)
    assert ar.attention_params_per_device(llama, 8) == ar.attention_params_per_layer(llama) / 8 == 18_874_368
    assert ar.attention_params_per_device(llama, 16) == (150_994_944 - 16_777_216) / 16 + 2 * 8192 * 128
    # beyond 1/16 of the whole: each layer's replicated KV head (bf16), and the norms (2 a layer + the final one),
    # which every device keeps whole
    extra = ar.weight_bytes_per_device(llama, tp=16) - ar.weight_bytes(llama) / 16
    assert extra == 80 * 2 * (2 * 8192 * 128 - 2 * 8192 * 1024 / 16) + (80 * 2 + 1) * 8192 * 2 * 15 / 16


def test_a_quantisation_group_divides_what_each_device_multiplies():
    """Qwen2.5-72B's FFN (29568) splits into 3696 a device at tp 8, which 128-weight groups do not divide (vLLM's
    GPTQ kernels refuse it too); at tp 4 it is 7392 = 57.75 groups, at tp 2 14784 = 115.5; 16-bit weights have no
    groups. An MoE model's experts are split over their own devices."""
    m = ModelSpec("qwen2_5_72b", 80, 8192, 64, 8, 128, 29568, 152064)
    ar.check_group_size(m, 4, 128, tp=1)
    ar.check_group_size(m, 16, 128, tp=8)
    ar.check_group_size(m, 4, 16, tp=8)  # 3696 = 231 x 16
    with pytest.raises(ValueError, match=r"group_size=128 .* at tp=8 \(hidden 8192, attention 1024, FFN 3696\)"):
        ar.check_group_size(m, 4, 128, tp=8)
    with pytest.raises(ValueError, match="group_size=96"):
        ar.check_group_size(m, 4, 96, tp=1)
    qwen = from_hf("Qwen3-30B-A3B-Instruct-2507")  # experts 768 wide
    assert ar.quant_input_widths(qwen, 2, expert_shard=1) == {"hidden": 2048, "attention": 2048, "expert FFN": 768}
    with pytest.raises(ValueError, match="expert FFN 96"):
        ar.check_group_size(qwen, 4, 128, tp=8, expert_shard=8)
