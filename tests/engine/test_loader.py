"""Checkpoint loading: sharded files, dtype, clear errors for bad checkpoints; seeded random init."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.specs import ModelSpec
from engine.loader import build_model, load_model, random_model
from tests.engine.checkpoints import TINY, hf_logits, prefill_logits, tiny_checkpoint

SPEC = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=160, max_model_len=256, dtype="float32")


def _rewrite(path, edit) -> None:
    """Apply ``edit`` to the checkpoint's tensor dict and save it back."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_sharded_checkpoint_with_index(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.arange(30) % TINY["vocab_size"]
    torch.testing.assert_close(prefill_logits(load_model(path), ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_model(path)


def test_dtype_override_and_spec_dtype(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    model = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = hf.model.layers[1].mlp.up_proj.weight
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight[128:], ref.to(torch.bfloat16))
    assert load_model(path).dtype == torch.float32  # config.json says float32


def test_missing_tensor_is_named(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\[100, 64\].*\[128, 64\]"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected tensors.*o_proj\.bias"):
        load_model(path)


def test_tied_checkpoint_may_store_lm_head(tmp_path):
    hf, path = tiny_checkpoint(tmp_path, "llama_tied")
    _rewrite(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    ids = torch.arange(10)
    torch.testing.assert_close(prefill_logits(load_model(path), ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_unknown_architecture(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(path)


def test_unsupported_activation(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_model(path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not opened")  # never read, let alone unpickled
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        load_model(path)
    (path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")


def test_random_init_is_seeded():
    a, b, c = random_model(SPEC, seed=7), random_model(SPEC, seed=7), random_model(SPEC, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1)
        else:
            assert not torch.equal(pa, pc), name
            assert 0.015 < pa.float().std().item() < 0.025, name
    assert random_model(SPEC, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_build_model_loads_spec_path_else_random(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    spec = ModelSpec.from_pretrained(path)
    loaded = build_model(spec)
    assert torch.equal(loaded.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert not torch.equal(build_model(SPEC).model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_bad_quant_mode():
    with pytest.raises(ValueError, match="quant='int3'"):
        random_model(SPEC, quant="int3")


def test_non_finite_weights_are_named(tmp_path):
    _, path = tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t["model.layers.0.mlp.down_proj.weight"].view(-1)[:3].fill_(float("nan")))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has "
                                         r"3 non-finite"):
        load_model(path)


def test_a_weight_of_another_dtype_is_refused_unless_cast(tmp_path):
    hf, path = tiny_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is torch\.int32, config\.json declares torch.float32"):
        load_model(path)
    assert torch.equal(load_model(path, cast=True).model.norm.weight, hf.model.norm.weight.to(torch.int32).float())
    _rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.float16)}))
    with pytest.raises(ValueError, match="float16"):
        load_model(path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_truncated_or_corrupt_file_is_named_in_one_line(tmp_path, damage):
    _, path = tiny_checkpoint(tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match="not a readable safetensors file") as e:
        load_model(path)
    assert str(file) in str(e.value) and "\n" not in str(e.value)
