"""Model arithmetic against published parameter counts, hand formulas and transformers' own models."""

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.specs import ModelSpec
from sim.cost import arithmetic as ar

LLAMA2_7B = ModelSpec("llama2_7b", 32, 4096, 32, 32, 128, 11008, 32000, dtype="float16")
LLAMA3_8B = ModelSpec("llama3_8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA2_70B = ModelSpec("llama2_70b", 80, 8192, 64, 8, 128, 28672, 32000, dtype="float16")
QWEN2_05B = ModelSpec("qwen2_0_5b", 24, 896, 14, 2, 64, 4864, 151936, architecture="qwen2",
                      tie_word_embeddings=True, attention_bias=True)
TINY = ModelSpec("tiny", 4, 256, 8, 4, 32, 768, 4096, dtype="float32")


@pytest.mark.parametrize(("spec", "published"), [
    (LLAMA2_7B, 6_738_415_616), (LLAMA3_8B, 8_030_261_248), (LLAMA2_70B, 68_976_648_192), (QWEN2_05B, 494_032_768),
])
def test_total_params_match_published_counts(spec, published):
    assert ar.total_params(spec) == published


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


def test_kv_bytes_per_token():
    assert ar.kv_bytes_per_token(LLAMA3_8B) == 2 * 32 * 8 * 128 * 2 == 131072
    assert ar.kv_bytes_per_token(LLAMA2_7B) == 524288
    assert ar.kv_bytes_per_token(LLAMA2_70B) == 2 * 80 * 8 * 128 * 2
    assert ar.kv_bytes_per_token(LLAMA3_8B, kv_bits=8) == 65536
    assert ar.kv_bytes_per_token(TINY) == 2 * 4 * 4 * 32 * 4  # float32 model: unquantised KV is 4 bytes


@pytest.mark.parametrize(("bits", "group"), [(4, 128), (8, 128), (4, 32), (8, 64)])
@pytest.mark.parametrize("spec", [LLAMA2_7B, LLAMA3_8B, QWEN2_05B])
def test_quantised_weight_bytes_follow_the_design_formula(spec, bits, group):
    w16 = ar.weight_bytes(spec)
    assert w16 == 2 * ar.total_params(spec)
    f = spec.num_layers * ar.linear_params_per_layer(spec) / ar.total_params(spec)  # quantised fraction
    assert ar.weight_bytes(spec, bits, group) == pytest.approx(w16 * ((1 - f) + f * bits / 16 + f / group), rel=1e-12)


def test_llama3_8b_w4_is_about_a_third():
    # Embeddings + untied head (1.05e9 params) stay 16-bit, so W4 is ~0.36 of 16-bit, not 0.25.
    ratio = ar.weight_bytes(LLAMA3_8B, 4, 128) / ar.weight_bytes(LLAMA3_8B)
    assert 0.33 < ratio < 0.38


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
    assert ar.max_concurrent_seqs(LLAMA3_8B, budget, 2048, kv_bits=8) == math.floor(budget / (2048 * 65536))
    assert ar.max_concurrent_seqs(LLAMA3_8B, -1e9, 2048) == 0
    # tp=2: each device holds half the KV heads, so the same per-device budget holds twice the sequences
    assert ar.max_concurrent_seqs(LLAMA3_8B, budget, 2048, tp=2) == math.floor(budget / (2048 * 65536))
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
    assert w16 - w4 == pytest.approx(ar.quantised_params(m) * (2 - 0.5 - 2 / 128))
