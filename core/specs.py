"""Model and hardware shapes: the one description both the cost models and the engine read.

Field names match ``conf/model/*.yaml`` and ``conf/hardware/*.yaml``; a Hugging Face ``config.json``
maps onto ``ModelSpec`` through ``from_hf_config``. Mixture-of-experts and multi-head latent attention shapes are
optional sub-records (``MoESpec``, ``MLASpec``): a yaml gives them as nested ``moe:`` / ``mla:`` mappings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from core.checks import check_choice, check_float, check_int, check_keys

WEIGHT_BITS = (16, 8, 4)  # stored weight widths (16: the model dtype)
KV_BITS = (16, 8)  # stored KV widths (16: the model dtype; 8: int8 with float32 scales)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                 "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe")  # an RMSNorm over each q and k head before RoPE
MLA_ARCHITECTURES = ("deepseek_v2", "deepseek_v3")


def _from_mapping(cls, cfg: Mapping[str, Any], section: str | None = None):
    check_keys(section or cls.__name__, cfg, [f.name for f in fields(cls)])
    return cls(**dict(cfg))


def _as_ids(value: Any) -> tuple[int, ...]:
    """An HF token-id field: absent, one id, or a list of ids."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def _required(hf: Mapping[str, Any], key: str, arch: str, alias: str | None = None) -> Any:
    """A config.json size or count (an integer >= 1) the architecture cannot do without (or its ``alias``:
    transformers 5 writes some keys under another name, e.g. Qwen3-MoE's num_experts as num_local_experts)."""
    value = hf.get(key, hf.get(alias)) if alias else hf.get(key)
    if value is None:
        also = f" or {alias!r}" if alias else ""
        raise ValueError(f"config.json: missing key {key!r}{also} (required by architecture {arch!r})")
    return check_int(value, f"config.json: {key}", 1)  # every required key is a size or a count


@dataclass(frozen=True)
class MoESpec:
    """Routed experts in place of the dense MLP (Mixtral, Qwen3-MoE, DeepSeek-V2/V3).

    An MoE layer has a router (a [num_experts, hidden] linear layer) and ``num_experts`` SwiGLU experts of width
    ``intermediate_size``; each token runs through the ``top_k`` experts the router picks, weighted by their router
    probabilities (renormalised to sum 1 with ``norm_topk_prob``), plus ``num_shared_experts`` experts every token
    runs through (DeepSeek). ``dense_layers`` keep the model's dense MLP. How a router scores and groups experts
    (DeepSeek-V3's sigmoid scores and n_group / topk_group) changes which experts a token uses, not how many, so it
    is not recorded here.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # lists from YAML -> tuple
        check_int(self.num_experts, "model.moe.num_experts", 1)
        check_int(self.top_k, "model.moe.top_k", 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k}; allowed: at most model.moe.num_experts "
                             f"({self.num_experts})")
        check_int(self.intermediate_size, "model.moe.intermediate_size", 1)
        check_int(self.num_shared_experts, "model.moe.num_shared_experts", 0)
        for layer in self.dense_layers:
            check_int(layer, "model.moe.dense_layers", 0)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are up-projected from one cached latent of
    ``kv_lora_rank`` per token, next to one shared RoPE key of ``qk_rope_head_dim``; each query head has a
    ``qk_nope_head_dim`` + ``qk_rope_head_dim`` part, each value head ``v_head_dim``. Queries go through a
    ``q_lora_rank`` bottleneck, or straight from the hidden state when it is None (DeepSeek-V2-Lite)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int(getattr(self, key), f"model.mla.{key}", 1)
        if self.q_lora_rank is not None:
            check_int(self.q_lora_rank, "model.mla.q_lora_rank", 1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _section(cls, value: Any, key: str):
    """A sub-record given as itself, a mapping (YAML, ``to_dict``) or None."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}; allowed: a mapping of {[f.name for f in fields(cls)]} or null")
    return _from_mapping(cls, value, key)


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder (RMSNorm, RoPE, SwiGLU): GQA or MLA attention, dense or mixture-of-experts FFNs.

    With ``mla`` the attention shapes are MLA's: ``head_dim`` is a query/key head's (qk_nope + qk_rope) and
    ``num_kv_heads`` equals ``num_heads``; ``intermediate_size`` is the dense MLP's (the layers ``moe`` leaves dense).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    architecture: str = "llama"  # ARCHITECTURES' values
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    max_model_len: int = 4096
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before RoPE
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    path: str | None = None  # Hugging Face checkpoint directory (config.json + *.safetensors)
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()  # from the checkpoint; used only when the engine stops at EOS

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", _as_ids(self.eos_token_ids))  # lists from YAML -> tuple
        object.__setattr__(self, "moe", _section(MoESpec, self.moe, "model.moe"))
        object.__setattr__(self, "mla", _section(MLASpec, self.mla, "model.mla"))
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                    "vocab_size", "max_model_len"):
            check_int(getattr(self, key), f"model.{key}", 1)  # a quoted "4" in config.json fails here, named
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of "
                             f"model.num_kv_heads ({self.num_kv_heads})")
        check_choice(self.architecture, "model.architecture", sorted(ARCHITECTURES.values()))
        check_choice(self.dtype, "model.dtype", ("bfloat16", "float16", "float32"))
        if self.moe is not None and any(i >= self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"model.moe.dense_layers={list(self.moe.dense_layers)}; allowed: layer indices below "
                             f"model.num_layers ({self.num_layers})")
        if self.mla is not None:
            self._check_mla()

    def _check_mla(self) -> None:
        if (self.head_dim, self.num_kv_heads) != (self.mla.qk_head_dim, self.num_heads):
            raise ValueError(f"with model.mla, model.head_dim must be qk_nope_head_dim + qk_rope_head_dim "
                             f"({self.mla.qk_head_dim}) and model.num_kv_heads model.num_heads ({self.num_heads}); "
                             f"got {self.head_dim} and {self.num_kv_heads}")
        if self.attention_bias or self.qk_norm:
            raise ValueError("model.mla: attention_bias and qk_norm are not supported with MLA")

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> ModelSpec:
        """From a config group entry (plain dict or OmniConf DictConfig converted to a dict)."""
        return _from_mapping(cls, cfg)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], name: str = "", path: str | None = None) -> ModelSpec:
        # no architectures: the model_type names the family, as transformers' AutoConfig reads it (else Llama)
        model_type = hf.get("model_type") or "llama"
        by_type = {family: cls_name for cls_name, family in ARCHITECTURES.items()}
        archs = hf.get("architectures") or [by_type.get(model_type, model_type)]
        if not isinstance(archs, list) or not isinstance(archs[0], str):
            raise ValueError(f"config.json: architectures={archs!r}; allowed: a list of class names such as "
                             "[\"LlamaForCausalLM\"]")
        if archs[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[archs[0]]
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        layers, hidden = _required(hf, "num_hidden_layers", arch), _required(hf, "hidden_size", arch)
        heads = _required(hf, "num_attention_heads", arch)
        # transformers >= 5 keeps theta and scaling under rope_parameters; older files use top-level keys
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling = dict(rope)
        max_len = int(hf.get("max_position_embeddings", 4096))
        window = hf.get("sliding_window")
        if window and hf.get("use_sliding_window", arch in ("mistral", "mixtral")):
            max_len = min(max_len, int(window))  # no sliding-window attention here: stay inside the window
        mla = _mla_from_hf(hf, arch) if arch in MLA_ARCHITECTURES else None
        return cls(
            name=name or hf.get("_name_or_path", "") or arch,
            architecture=arch,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            # MLA: every query head has its own key, up-projected from the shared latent (transformers' config.json
            # writes head_dim = qk_rope_head_dim for DeepSeek, which is not a head's size)
            num_kv_heads=heads if mla else hf.get("num_key_value_heads") or heads,
            head_dim=mla.qk_head_dim if mla else hf.get("head_dim") or hidden // heads,
            intermediate_size=_required(hf, "intermediate_size", arch),
            vocab_size=_required(hf, "vocab_size", arch),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_model_len=max_len,
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            moe=_moe_from_hf(hf, arch, layers),
            mla=mla,
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
        """A checkpoint directory's config.json, or a config.json-style file on its own (``<name>.json``: the shapes
        the simulator needs, named by its stem; the engine needs the directory's weights too)."""
        p = Path(path)
        cfg_file = p if p.suffix == ".json" else p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}" if cfg_file != p
                                    else f"no model config file {path}")
        try:
            hf = json.loads(cfg_file.read_text())
        except ValueError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        return cls.from_hf_config(hf, name=p.stem if cfg_file == p else p.name,
                                  path=str(path))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _moe_from_hf(hf: Mapping[str, Any], arch: str, num_layers: int) -> MoESpec | None:
    """The experts of a config.json, with each family's rule for which layers stay dense."""
    if arch == "mixtral":  # every layer; experts as wide as intermediate_size; top-k weights always renormalised
        return MoESpec(num_experts=_required(hf, "num_local_experts", arch, "num_experts"),
                       top_k=_required(hf, "num_experts_per_tok", arch),
                       intermediate_size=_required(hf, "intermediate_size", arch))
    if arch == "qwen3_moe":  # layer i is MoE unless listed in mlp_only_layers or (i + 1) % decoder_sparse_step
        step, only = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
        return MoESpec(num_experts=_required(hf, "num_experts", arch, "num_local_experts"),
                       top_k=_required(hf, "num_experts_per_tok", arch),
                       intermediate_size=_required(hf, "moe_intermediate_size", arch),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       dense_layers=tuple(i for i in range(num_layers) if i in only or (i + 1) % step))
    if arch in MLA_ARCHITECTURES and hf.get("n_routed_experts"):
        # layer i is MoE from first_k_dense_replace on, where i % moe_layer_freq == 0 (DeepSeek's own modelling code)
        first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
        return MoESpec(num_experts=hf["n_routed_experts"], top_k=_required(hf, "num_experts_per_tok", arch),
                       intermediate_size=_required(hf, "moe_intermediate_size", arch),
                       num_shared_experts=int(hf.get("n_shared_experts") or 0),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", arch == "deepseek_v3")),
                       dense_layers=tuple(i for i in range(num_layers) if i < first or i % freq))
    return None


def _mla_from_hf(hf: Mapping[str, Any], arch: str) -> MLASpec:
    return MLASpec(kv_lora_rank=_required(hf, "kv_lora_rank", arch),
                   qk_nope_head_dim=_required(hf, "qk_nope_head_dim", arch),
                   qk_rope_head_dim=_required(hf, "qk_rope_head_dim", arch),
                   v_head_dim=_required(hf, "v_head_dim", arch), q_lora_rank=hf.get("q_lora_rank"))


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
    interconnect_latency_s: float = 0.0  # per hop of a collective between peers (ring step, send/recv)
    network_profile: str | None = None  # measured NCCL tables for these peers (gpu-measurements/vidur/network/<name>)
    price_per_hour: float = 0.0  # list price of one device-hour in USD (0: unknown); goodput per dollar
    kernel_launch_s: float = 0.0  # seconds one kernel launch costs an eager-mode engine (0: not priced)

    def __post_init__(self) -> None:
        # numbers, checked and stored as floats (a quoted "16e9" from a config is refused here, by name)
        for key in ("peak_flops", "mem_bw", "mem_bytes"):
            object.__setattr__(self, key, check_float(getattr(self, key), f"hardware.{key}", 0.0, strict=True))
        for key in ("interconnect_bw", "peak_flops_int8", "host_link_bw", "host_link_latency_s",
                    "interconnect_latency_s", "price_per_hour", "kernel_launch_s"):
            object.__setattr__(self, key, check_float(getattr(self, key), f"hardware.{key}"))

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
