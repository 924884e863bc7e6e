"""Model and hardware shapes: the one description both the cost models and the engine read.

Field names match ``conf/model/*.yaml`` and ``conf/hardware/*.yaml``; a Hugging Face ``config.json``
maps onto ``ModelSpec`` through ``from_hf_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from core.checks import check_choice, check_int, check_keys

WEIGHT_BITS = (16, 8, 4)  # stored weight widths (16: the model dtype)
KV_BITS = (16, 8)  # stored KV widths (16: the model dtype; 8: int8 with float32 scales)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def _from_mapping(cls, cfg: Mapping[str, Any]):
    check_keys(cls.__name__, cfg, [f.name for f in fields(cls)])
    return cls(**dict(cfg))


def _as_ids(value: Any) -> tuple[int, ...]:
    """An HF token-id field: absent, one id, or a list of ids."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


@dataclass(frozen=True)
class ModelSpec:
    """A dense Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    architecture: str = "llama"  # llama | qwen2 | mistral
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_model_len: int = 4096
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    path: str | None = None  # Hugging Face checkpoint directory (config.json + *.safetensors)
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()  # from the checkpoint; used only when the engine stops at EOS

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", _as_ids(self.eos_token_ids))  # lists from YAML -> tuple
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "max_model_len"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of "
                             f"model.num_kv_heads ({self.num_kv_heads})")
        check_choice(self.architecture, "model.architecture", sorted(ARCHITECTURES.values()))
        check_choice(self.dtype, "model.dtype", ("bfloat16", "float16", "float32"))

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        """From a config group entry (plain dict or OmniConf DictConfig converted to a dict)."""
        return _from_mapping(cls, cfg)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], name: str = "", path: str | None = None) -> ModelSpec:
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[archs[0]]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        heads = hf["num_attention_heads"]
        # transformers >= 5 keeps theta and scaling under rope_parameters; older files use top-level keys
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling = dict(rope)
        max_len = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", arch == "mistral"):
            max_len = min(max_len, int(window))  # no sliding-window attention here: stay inside the window
        return cls(
            name=name or hf.get("_name_or_path", "") or arch,
            architecture=arch,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_model_len=max_len,
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            path=path,
            dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            eos_token_ids=_as_ids(hf.get("eos_token_id")),
        )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        """A ``model`` config group: the checkpoint's config.json when ``path`` is set, in the group's ``dtype`` when
        it sets one (``conf/model/checkpoint.yaml``, what ``model=DIR`` selects, leaves it null: the checkpoint's own
        dtype), else the group's own fields. The entry points parse it once (``experiments.config.RunConfig``)."""
        if cfg.get("path"):
            spec = cls.from_pretrained(cfg["path"])
            return cls.from_mapping({**spec.to_dict(), "dtype": cfg.get("dtype") or spec.dtype})
        return cls.from_mapping(cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelSpec:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        return cls.from_hf_config(json.loads(cfg_file.read_text()), name=Path(path).name, path=str(path))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (datasheet numbers; efficiencies live in the cost model)."""

    name: str
    peak_flops: float  # dense 16-bit FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float  # device memory, bytes
    interconnect_bw: float = 0.0  # bytes/s per direction between tensor-parallel peers (0: single device)
    peak_flops_int8: float = 0.0  # 0: same as peak_flops
    links: dict | None = None  # KV transfer link presets for PD disaggregation: name -> {bandwidth_bytes_s, latency_s}
    host_link_bw: float = 0.0  # bytes/s per direction between device and host memory (host KV tier; 0: unknown)
    host_link_latency_s: float = 0.0  # fixed cost of one batch of copies in one direction

    def __post_init__(self) -> None:
        for key in ("peak_flops", "mem_bw", "mem_bytes"):
            if float(getattr(self, key)) <= 0:
                raise ValueError(f"hardware.{key} must be > 0, got {getattr(self, key)}")
        for key in ("host_link_bw", "host_link_latency_s"):
            if float(getattr(self, key)) < 0:
                raise ValueError(f"hardware.{key} must be >= 0, got {getattr(self, key)}")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> HardwareSpec:
        return _from_mapping(cls, cfg)


@dataclass(frozen=True)
class QuantSpec:
    """How weights and KV are stored (the ``quant`` section), read by both backends: the engine stores them so, the
    cost models price them, the pool is sized with them. weight_bits 16: the model dtype; 4: group-wise W4A16 (a
    16-bit scale and zero point per ``group_size`` weights); 8: a what-if the simulator prices and the engine
    refuses. kv_bits 16: the model dtype; 8: int8 KV with a float32 scale per token and KV head."""

    weight_bits: int = 16
    group_size: int = 128
    kv_bits: int = 16

    def __post_init__(self) -> None:
        check_choice(self.weight_bits, "quant.weight_bits", WEIGHT_BITS)
        check_choice(self.kv_bits, "quant.kv_bits", KV_BITS)
        check_int(self.group_size, "quant.group_size", 1)
