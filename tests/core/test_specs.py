"""ModelSpec from Hugging Face config.json files (public configs of released models in hf_configs/) and from the
flat conf/model yamls with nested moe / mla sections; bad input names its key."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.specs import MLASpec, ModelSpec, MoESpec

HF_CONFIGS = Path(__file__).with_name("hf_configs")
CONF_MODELS = Path(__file__).resolve().parents[2] / "conf" / "model"


def hf_config(name: str) -> dict:
    return json.loads((HF_CONFIGS / f"{name}.json").read_text())


def from_hf(name: str, **edits) -> ModelSpec:
    return ModelSpec.from_hf_config({**hf_config(name), **edits})


def test_qwen3_dense_shapes():
    m = from_hf("Qwen3-32B")
    assert (m.architecture, m.qk_norm, m.attention_bias, m.moe, m.mla) == ("qwen3", True, False, None, None)
    assert m.head_dim == 128 != m.hidden_size // m.num_heads  # 5120 / 64 = 80: head_dim is its own key


def test_moe_shapes_of_each_family():
    mixtral = from_hf("Mixtral-8x7B-v0.1").moe
    assert mixtral == MoESpec(num_experts=8, top_k=2, intermediate_size=14336, norm_topk_prob=True)
    qwen = from_hf("Qwen3-30B-A3B-Instruct-2507")
    assert qwen.qk_norm and qwen.moe == MoESpec(128, 8, 768, norm_topk_prob=True)
    lite = from_hf("DeepSeek-V2-Lite")
    assert lite.moe == MoESpec(64, 6, 1408, num_shared_experts=2, norm_topk_prob=False, dense_layers=(0,))
    assert lite.mla == MLASpec(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert (lite.head_dim, lite.num_kv_heads) == (192, 16)
    v3 = from_hf("DeepSeek-V3")
    assert v3.mla.q_lora_rank == 1536 and v3.moe.dense_layers == (0, 1, 2) and v3.moe.num_shared_experts == 1


def test_which_layers_stay_dense():
    # Qwen3-MoE: layer i is MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert from_hf("Qwen3-30B-A3B-Instruct-2507", num_hidden_layers=6, decoder_sparse_step=2).moe.dense_layers \
        == (0, 2, 4)
    assert from_hf("Qwen3-30B-A3B-Instruct-2507", num_hidden_layers=6, decoder_sparse_step=2,
                   mlp_only_layers=[1, 3]).moe.dense_layers == (0, 1, 2, 3, 4)
    # DeepSeek: MoE from first_k_dense_replace on, where i % moe_layer_freq == 0
    assert from_hf("DeepSeek-V2-Lite", num_hidden_layers=7, first_k_dense_replace=2,
                   moe_layer_freq=2).moe.dense_layers == (0, 1, 3, 5)
    # transformers' DeepSeek config.json writes head_dim = qk_rope_head_dim: a head's size is still nope + rope
    assert from_hf("DeepSeek-V2-Lite", head_dim=64).head_dim == 192


@pytest.mark.parametrize(("yaml_name", "config"), [
    ("mixtral_8x7b", "Mixtral-8x7B-v0.1"), ("qwen3_30b_a3b", "Qwen3-30B-A3B-Instruct-2507"),
    ("qwen3_32b", "Qwen3-32B"), ("deepseek_v2_lite", "DeepSeek-V2-Lite"),
])
def test_model_yaml_has_the_config_json_shapes(yaml_name, config):
    """The nested moe / mla sections of a yaml load into the same spec config.json gives."""
    spec = ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF_MODELS / f"{yaml_name}.yaml")))
    assert spec == replace(from_hf(config), name=yaml_name, eos_token_ids=())


def test_a_config_file_alone_is_a_model(tmp_path):
    """``model.path`` may name a config.json-style file (the simulator needs only the shapes): the same spec as the
    checkpoint directory holding it, named by the file's stem; a missing file is named."""
    (tmp_path / "Qwen3-32B").mkdir()
    (tmp_path / "Qwen3-32B" / "config.json").write_text((HF_CONFIGS / "Qwen3-32B.json").read_text())
    from_dir = ModelSpec.from_pretrained(tmp_path / "Qwen3-32B")
    from_file = ModelSpec.from_pretrained(HF_CONFIGS / "Qwen3-32B.json")
    assert from_file.name == from_dir.name == "Qwen3-32B"
    assert replace(from_file, path=None) == replace(from_dir, path=None)
    with pytest.raises(FileNotFoundError, match="no model config file"):
        ModelSpec.from_pretrained(tmp_path / "absent.json")
    with pytest.raises(FileNotFoundError, match="no config.json in checkpoint directory"):
        ModelSpec.from_pretrained(tmp_path)


def test_nested_sections_round_trip_through_to_dict():
    spec = from_hf("DeepSeek-V2-Lite")
    assert isinstance(spec.to_dict()["moe"], dict) and ModelSpec.from_mapping(spec.to_dict()) == spec
    flat = {**spec.to_dict(), "moe": {**spec.to_dict()["moe"], "dense_layers": [0]}}  # a YAML list
    assert ModelSpec.from_mapping(flat) == spec


@pytest.mark.parametrize(("edit", "message"), [
    ({"moe": {"num_experts": 4, "top_k": 2, "intermediate_size": 8, "topk": 1}},
     r"model\.moe: unknown keys \['topk'\]"),
    ({"moe": {"num_experts": 4, "top_k": 5, "intermediate_size": 8}}, r"model\.moe\.top_k=5"),
    ({"moe": {"num_experts": 4, "top_k": 2, "intermediate_size": 8, "dense_layers": [2]}},
     r"model\.moe\.dense_layers=\[2\]"),
    ({"moe": {"num_experts": 4, "top_k": 2}}, "intermediate_size"),
    ({"moe": [4, 2]}, r"model\.moe=\[4, 2\]"),
    ({"mla": {"kv_lora_rank": 0, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}},
     r"model\.mla\.kv_lora_rank=0"),
    ({"mla": {"kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}},
     r"model\.head_dim must be qk_nope_head_dim \+ qk_rope_head_dim \(16\)"),
])
def test_bad_sections_name_the_key(edit, message):
    base = dict(name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=24,
                intermediate_size=128, vocab_size=100)
    with pytest.raises((ValueError, TypeError), match=message):
        ModelSpec.from_mapping({**base, **edit})


@pytest.mark.parametrize(("config", "key"), [
    ("Mixtral-8x7B-v0.1", "num_local_experts"), ("Qwen3-30B-A3B-Instruct-2507", "num_experts"),
    ("Qwen3-30B-A3B-Instruct-2507", "moe_intermediate_size"),
    ("DeepSeek-V2-Lite", "kv_lora_rank"), ("Qwen3-32B", "vocab_size"),
])
def test_missing_config_key_is_named(config, key):
    hf = hf_config(config)
    del hf[key]
    with pytest.raises(ValueError, match=f"config.json: missing key '{key}' "):
        ModelSpec.from_hf_config(hf)


@pytest.mark.parametrize(("edit", "message"), [
    ({"num_attention_heads": "64"}, r"config\.json: num_attention_heads='64'; allowed: an integer >= 1"),
    ({"hidden_size": 5120.5}, r"config\.json: hidden_size=5120\.5"),
    ({"num_key_value_heads": "8"}, r"model\.num_kv_heads='8'"),
    ({"head_dim": "128"}, r"model\.head_dim='128'"),
    ({"architectures": "Qwen3ForCausalLM"}, r"config\.json: architectures='Qwen3ForCausalLM'; allowed: a list"),
])
def test_wrongly_typed_config_values_are_named(edit, message):
    """A quoted or fractional size is refused by its config.json key, not crashed on (a TypeError) or truncated."""
    with pytest.raises(ValueError, match=message):
        from_hf("Qwen3-32B", **edit)


@pytest.mark.parametrize("name", ["Mixtral-8x7B-v0.1", "Qwen3-32B", "Qwen3-30B-A3B-Instruct-2507"])
def test_without_architectures_the_model_type_names_the_family(name):
    """As transformers' AutoConfig: a config.json with no architectures is read by its model_type, not as Llama
    (which would drop Qwen3's q/k norms or Mistral's window without a word)."""
    hf = hf_config(name)
    arch = ModelSpec.from_hf_config(hf).architecture
    del hf["architectures"]
    assert ModelSpec.from_hf_config(hf).architecture == arch != "llama"
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        ModelSpec.from_hf_config({**hf, "model_type": "gpt2"})


def test_config_json_that_does_not_parse_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}: not valid JSON"):
        ModelSpec.from_pretrained(tmp_path)


def test_expert_count_under_transformers_5_name():
    """transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)."""
    hf = hf_config("Qwen3-30B-A3B-Instruct-2507")
    hf["num_local_experts"] = hf.pop("num_experts")
    assert ModelSpec.from_hf_config(hf).moe.num_experts == 128


def test_hardware_numbers_are_checked_by_name():
    """A quoted number (YAML reads ``16e9`` as a string) or a negative one fails at the spec, naming the key."""
    from core.specs import HardwareSpec

    base = {"name": "x", "peak_flops": 1e15, "mem_bw": 2e12, "mem_bytes": 80e9}
    hw = HardwareSpec.from_mapping({**base, "interconnect_bw": 16_000_000_000})
    assert isinstance(hw.interconnect_bw, float) and hw.interconnect_bw == 16e9
    for key, value in (("interconnect_bw", "16e9"), ("mem_bw", 0), ("kernel_launch_s", -1e-6),
                       ("peak_flops", True)):
        with pytest.raises(ValueError, match=f"hardware.{key}="):
            HardwareSpec.from_mapping({**base, key: value})
