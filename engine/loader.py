"""Weights: load a Hugging Face checkpoint directory through safetensors only, or initialise from a seed.

Hugging Face names map onto ours one to one, except q/k/v_proj (stacked into ``qkv_proj``) and gate/up_proj
(stacked into ``gate_up_proj``). Pickle checkpoints (*.bin, *.pt) are refused: nothing is ever unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from core.checks import check_choice
from core.specs import ModelSpec
from engine.model import LlamaForCausalLM

QUANT_MODES = ("none", "w4a16")
INDEX_FILE = "model.safetensors.index.json"
RANDOM_INIT_STD = 0.02  # HF's default initializer_range
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved
_MAX_NAMES = 8  # names listed in an error message


def _safetensors_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shard files that are missing: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth") for p in path.glob(ext))
    if pickles:
        raise ValueError(f"{path} has only pickle checkpoints {pickles[:_MAX_NAMES]}; twinserve loads safetensors "
                         "only (it never unpickles). Convert them to *.safetensors first.")
    raise FileNotFoundError(f"no *.safetensors weights in {path}")


def _targets(model: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
    """HF tensor name -> (our parameter, first row it fills, expected HF shape)."""
    out = {}
    for name, param in model.named_parameters():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            out[name] = (param, 0, tuple(param.shape))
            continue
        parts = _FUSED[fused]
        spec = model.spec
        if fused == "qkv_proj":
            rows = [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
        else:
            rows = [spec.intermediate_size] * 2
        offset = 0
        for part, n in zip(parts, rows, strict=True):
            out[name.replace(fused, part)] = (param, offset, (n, *param.shape[1:]))
            offset += n
    return out


def _names(names) -> str:
    names = sorted(names)
    more = f" (+{len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return f"{names[:_MAX_NAMES]}{more}"


def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Fill ``model`` from the safetensors files in ``path``; every parameter exactly once, shapes checked."""
    path = Path(path)
    targets = _targets(model)
    seen, unexpected = set(), []
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key not in targets:
                    tied_head = key == "lm_head.weight" and model.spec.tie_word_embeddings
                    if not tied_head and not key.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(key)
                    continue
                param, row, shape = targets[key]
                tensor = f.get_slice(key)
                got = tuple(tensor.get_shape())
                if got != shape:
                    raise ValueError(f"{file.name}: tensor {key!r} has shape {list(got)}, model expects {list(shape)}")
                param.data[row:row + shape[0]].copy_(tensor[:])
                seen.add(key)
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors not used by the {model.spec.architecture} model: "
                         f"{_names(unexpected)}")
    missing = set(targets) - seen
    if missing:
        raise ValueError(f"{path}: missing tensors {_names(missing)}")


def init_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Seeded random weights (normal, std 0.02; norms 1) generated on the model's device: for timing only."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, RANDOM_INIT_STD, generator=gen)


def _finish(model: LlamaForCausalLM, quant: str | None, group_size: int) -> LlamaForCausalLM:
    if quant == "w4a16":
        model.quantize(group_size)
    return model.eval()


def load_model(path: str | Path, spec: ModelSpec | None = None, *, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", quant: str | None = None,
               group_size: int = 128) -> LlamaForCausalLM:
    """Model from a HF checkpoint directory (config.json + *.safetensors); dtype defaults to the spec's."""
    check_choice(quant or "none", "quant", QUANT_MODES)
    spec = spec or ModelSpec.from_pretrained(path)
    model = LlamaForCausalLM(spec, dtype, device)
    load_weights(model, path)
    return _finish(model, quant, group_size)


def random_model(spec: ModelSpec, *, seed: int = 0, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", quant: str | None = None,
                 group_size: int = 128) -> LlamaForCausalLM:
    """Model of ``spec``'s shape with seeded random weights (e.g. to time an 8B model without its weights)."""
    check_choice(quant or "none", "quant", QUANT_MODES)
    model = LlamaForCausalLM(spec, dtype, device)
    init_random(model, seed)
    return _finish(model, quant, group_size)


def build_model(spec: ModelSpec, *, seed: int = 0, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu", quant: str | None = None,
                group_size: int = 128) -> LlamaForCausalLM:
    """``spec.path`` set: load that checkpoint; otherwise random weights from ``seed``."""
    if spec.path:
        return load_model(spec.path, spec, dtype=dtype, device=device, quant=quant, group_size=group_size)
    return random_model(spec, seed=seed, dtype=dtype, device=device, quant=quant, group_size=group_size)
