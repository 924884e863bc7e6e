"""Weights: load a Hugging Face checkpoint directory through safetensors only, or initialise from a seed.

Hugging Face names map onto ours one to one, except q/k/v_proj (stacked into ``qkv_proj``) and gate/up_proj
(stacked into ``gate_up_proj``). MoE experts (engine.moe) load from transformers' fused tensors
(``mlp.experts.gate_up_proj`` [E, 2F, d], ``mlp.experts.down_proj`` [E, d, F], as ``save_pretrained(...,
save_original_format=False)`` writes them) or from one tensor per expert as hub checkpoints and transformers' default
``save_pretrained`` keep them: Qwen3-MoE's ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral's
``block_sparse_moe.experts.{e}.w{1,3,2}.weight`` (and ``block_sparse_moe.gate.weight``, its router). Pickle
checkpoints (*.bin, *.pt) are refused: nothing is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
# per-expert checkpoint tensors of each stacked expert weight: Qwen3-MoE's names, Mixtral's
_EXPERT_PARTS = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
_MIXTRAL_BLOCK = (".mlp.", ".block_sparse_moe.")  # Mixtral checkpoints name the MoE block block_sparse_moe
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


# One way a checkpoint can give a parameter: HF tensor name -> (index into the parameter, the tensor's shape).
Layout = dict[str, tuple[tuple, tuple[int, ...]]]


def _row_blocks(names: Sequence[str], sizes: Sequence[int], rest: tuple[int, ...], lead: tuple = ()) -> Layout:
    """Tensors ``names`` filling consecutive blocks of ``sizes`` rows of param[lead] (rows of shape ``rest``)."""
    layout, row = {}, 0
    for name, n in zip(names, sizes, strict=True):
        layout[name] = ((*lead, slice(row, row + n)), (n, *rest))
        row += n
    return layout


def _layouts(name: str, param: torch.Tensor, spec: ModelSpec) -> list[Layout]:
    """The checkpoint layouts that fill our parameter ``name``; a checkpoint must give exactly one of them, whole."""
    shape = tuple(param.shape)
    whole = {name: ((), shape)}
    base, kind = name.rsplit(".", 1)
    if base.endswith(".experts"):  # stacked [E, out, in]: fused, or per expert under either family's names
        layouts = [whole]
        for prefix, parts in zip((base, base.replace(*_MIXTRAL_BLOCK)), _EXPERT_PARTS[kind], strict=True):
            rows = [shape[1] // len(parts)] * len(parts)
            layouts.append({k: v for e in range(shape[0]) for k, v in _row_blocks(
                [f"{prefix}.{e}.{part}.weight" for part in parts], rows, shape[2:], (e,)).items()})
        return layouts
    if name.endswith(".mlp.gate.weight"):  # an MoE router
        return [whole, {name.replace(*_MIXTRAL_BLOCK): ((), shape)}]
    fused = next((f for f in _FUSED if f".{f}." in name), None)
    if fused is None:
        return [whole]
    if fused == "qkv_proj":
        sizes = [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
    else:
        sizes = [spec.intermediate_size] * 2
    return [_row_blocks([name.replace(fused, part) for part in _FUSED[fused]], sizes, shape[1:])]


def _names(names) -> str:
    names = sorted(names)
    more = f" (+{len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else ""
    return f"{names[:_MAX_NAMES]}{more}"


def _declared_dtype(path: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config.json declares (``torch_dtype`` or ``dtype``), None when it names none."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _checked(file: Path, key: str, tensor: torch.Tensor, declared: torch.dtype | None, cast: bool) -> torch.Tensor:
    """A checkpoint tensor as the model may take it: of the declared floating dtype (else an error, or with
    ``cast`` a cast) and finite."""
    if not cast and (not tensor.is_floating_point() or (declared is not None and tensor.dtype != declared)):
        want = declared if declared is not None else "a floating dtype"
        raise ValueError(f"{file.name}: tensor {key!r} is {tensor.dtype}, config.json declares {want}; re-save the "
                         "checkpoint in that dtype (or load_model(..., cast=True) casts it)")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{file.name}: tensor {key!r} has {bad} non-finite values (NaN or inf) of {tensor.numel()}; "
                         "the checkpoint is corrupt")
    return tensor


def load_weights(model: LlamaForCausalLM, path: str | Path, cast: bool = False) -> None:
    """Fill ``model`` from the safetensors files in ``path``; every parameter exactly once (from one of its
    layouts), shapes checked, values finite and of config.json's dtype (``cast``: any dtype is cast instead).
    A truncated or corrupt file is named in a one-line error."""
    path = Path(path)
    params = dict(model.named_parameters())
    layouts = {name: _layouts(name, p, model.spec) for name, p in params.items()}
    targets = {key: (name, *target) for name, options in layouts.items() for layout in options
               for key, target in layout.items()}
    declared = _declared_dtype(path)
    seen, unexpected = set(), []
    for file in _safetensors_files(path):
        try:
            _load_file(file, model, params, targets, declared, cast, seen, unexpected)
        except ValueError:
            raise
        except Exception as e:  # safetensors' own errors: a short header, offsets past the end of a truncated file
            raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else 'no detail'}); it may be truncated or "
                             "corrupt: download or save it again") from None
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors not used by the {model.spec.architecture} model: "
                         f"{_names(unexpected)}")
    missing = []
    for name, options in layouts.items():
        given = [layout for layout in options if any(key in seen for key in layout)]
        if len(given) > 1:
            raise ValueError(f"{path}: {name} is given twice, as {_names(given[0])} and as {_names(given[1])}")
        missing += [key for key in (given or options)[0] if key not in seen]
    if missing:
        raise ValueError(f"{path}: missing tensors {_names(missing)}")


def _load_file(file: Path, model: LlamaForCausalLM, params: dict, targets: dict, declared: torch.dtype | None,
               cast: bool, seen: set, unexpected: list) -> None:
    with safe_open(file, framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if key not in targets:
                tied_head = key == "lm_head.weight" and model.spec.tie_word_embeddings
                if not tied_head and not key.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(key)
                continue
            name, index, shape = targets[key]
            tensor = f.get_slice(key)
            got = tuple(tensor.get_shape())
            if got != shape:
                raise ValueError(f"{file.name}: tensor {key!r} has shape {list(got)}, model expects {list(shape)}")
            params[name].data[index].copy_(_checked(file, key, tensor[:], declared, cast))
            seen.add(key)


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
               group_size: int = 128, cast: bool = False) -> LlamaForCausalLM:
    """Model from a HF checkpoint directory (config.json + *.safetensors); dtype defaults to the spec's.
    ``cast``: take tensors of any dtype (cast to the model's) instead of refusing those not of config.json's."""
    check_choice(quant or "none", "quant", QUANT_MODES)
    spec = spec or ModelSpec.from_pretrained(path)
    model = LlamaForCausalLM(spec, dtype, device)
    load_weights(model, path, cast)
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
