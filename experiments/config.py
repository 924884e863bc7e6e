"""The run's configuration, parsed once: typed, checked records built from the composed Hydra config.

An entry point composes a config (``conf/config.yaml`` and the command line), then ``RunConfig.from_config`` turns
it into frozen records -- model and hardware shapes, the KV pool, quantisation, the cluster, output and metrics
options, the backend's options -- each checked in ``__post_init__`` with the config key in the message. Everything
below the entry point reads these records; only the plugin groups (scheduler, eviction, router, ... each chosen by
``_target_``) stay config nodes, handed to Hydra's ``instantiate`` once per run.

The plain sections (``kv``, ``quant``, ``output``, ``metrics``) are also registered as Hydra structured configs
(``register_schemas``), so a wrong type or an unknown key on the command line fails at composition, in Hydra's words.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

from omegaconf import DictConfig, OmegaConf

from core import arithmetic
from core.checks import check_bool, check_choice, check_float, check_fraction, check_int, check_keys
from core.interfaces import SchedulerLimits
from core.kv_cache import PREFIX_CACHE_MODES
from core.links import Link
from core.metrics import LATENCY_ORIGINS, PERCENTILE_METHODS
from core.specs import HardwareSpec, ModelSpec, QuantSpec
from engine.options import EngineOptions

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (conf/, and shared/data beside it)
CONF_DIR = REPO_ROOT / "conf"
BACKENDS = ("sim", "engine")
ENGINE_CLOCKS = ("auto", "wall", "thread")
CLUSTERS = ("colocated", "pd")
SPEC_METHODS = (None, "ngram", "draft")
FILE_FORMATS, TOKEN_FILES, AUTO_OR_BOOL = ("csv", "parquet"), ("all", "none"), ("auto", True, False)
LIMIT_KEYS = ("max_num_batched_tokens", "max_num_seqs")  # the scheduler group's limits (the rest: its plugin)


def plain(node: Any) -> Any:
    """A config node as plain Python containers, interpolations resolved (a mapping passes through)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _record(cls: type, section: str, node: Any) -> Any:
    """``cls`` from a config section, refusing keys it does not know (a typo is never silently ignored)."""
    values = dict(plain(node) or {})
    check_keys(section, values, [f.name for f in fields(cls)])
    return cls(**values)


# ---- the plain sections ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVConfig:
    """``kv``: the KV pool of each replica and its host tier."""

    block_size: int = 16
    num_blocks: Optional[int] = None  # noqa: UP045 (Optional: what Hydra's structured configs read)
    memory_bytes: Optional[float] = None  # noqa: UP045  KV budget per replica
    memory_fraction: float = 0.9  # share of hardware.mem_bytes for weights + KV when sized from the hardware
    prefix_caching: bool = True
    prefix_cache_mode: str = "prompt"  # prompt: full prompt blocks once computed | vllm: vLLM v1's block pool
    host_blocks: int = 0  # host KV tier per replica, in blocks; 0: off
    host_memory_bytes: Optional[float] = None  # noqa: UP045  the host tier in bytes instead of blocks
    host_spill: bool = True  # evicted device prefix blocks move to the host tier
    host_eviction: str = "lru"  # the host tier's eviction policy: a conf/eviction option

    def __post_init__(self) -> None:
        _put(self, "block_size", check_int(self.block_size, "kv.block_size", 1))
        if self.num_blocks is not None:
            _put(self, "num_blocks", check_int(self.num_blocks, "kv.num_blocks", 1, whole_float=True))
        for key in ("memory_bytes", "host_memory_bytes"):
            if getattr(self, key) is not None:
                _put(self, key, check_float(getattr(self, key), f"kv.{key}", strict=key == "memory_bytes"))
        _put(self, "memory_fraction", check_fraction(self.memory_fraction, "kv.memory_fraction"))
        check_bool(self.prefix_caching, "kv.prefix_caching")
        check_bool(self.host_spill, "kv.host_spill")
        check_choice(self.prefix_cache_mode, "kv.prefix_cache_mode", PREFIX_CACHE_MODES)
        _put(self, "host_blocks", check_int(self.host_blocks or 0, "kv.host_blocks", 0, whole_float=True))
        allowed = sorted(p.stem for p in (CONF_DIR / "eviction").glob("*.yaml"))
        check_choice(self.host_eviction, "kv.host_eviction", allowed)


@dataclass(frozen=True)
class ParallelConfig:
    """``parallel``: how one replica spreads over devices, read by both backends. ``tp`` tensor-parallel ranks (heads
    and FFN split, two all-reduces per layer), ``pp`` pipeline stages (layers split), ``dp`` attention data-parallel
    ranks (each schedules its own batch; they meet at the MoE layers), ``ep`` the expert-parallel degree of MoE
    layers (experts split over the tp x dp ranks, as vLLM's --enable-expert-parallel). A replica takes
    tp x pp x dp devices."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "ep"):
            check_int(getattr(self, key), f"parallel.{key}", 1)
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.tp x parallel.dp = {self.tp * self.dp} "
                             "(experts are split over the tensor- and data-parallel ranks)")

    @property
    def devices(self) -> int:
        """Devices one replica takes."""
        return self.tp * self.pp * self.dp

    def check(self, model: ModelSpec) -> None:
        """What the model's shapes allow: heads divisible by tp, KV heads divisible by tp or tp by them (replicated,
        as vLLM does), at least one layer per stage, experts divisible by ep; ep and dp > 1 need an MoE model."""
        if model.num_heads % self.tp:
            raise ValueError(f"parallel.tp={self.tp} must divide model.num_heads={model.num_heads}")
        if model.num_kv_heads % self.tp and self.tp % model.num_kv_heads:
            raise ValueError(f"parallel.tp={self.tp} and model.num_kv_heads={model.num_kv_heads}: one must divide "
                             "the other")
        if self.pp > model.num_layers:
            raise ValueError(f"parallel.pp={self.pp} stages > model.num_layers={model.num_layers}")
        moe = model.moe
        if self.ep > 1 and moe is None:
            raise ValueError(f"parallel.ep={self.ep}: model {model.name} has no experts (a dense model: ep=1)")
        if self.dp > 1 and moe is None:  # the lockstep ranks meet only at MoE layers; vLLM runs dense ones apart
            raise ValueError(f"parallel.dp={self.dp}: model {model.name} has no experts, so its attention "
                             f"data-parallel ranks never meet: use replicas (e.g. replicas={self.dp}) with dp=1")
        if moe is not None and moe.num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide the model's {moe.num_experts} experts")


@dataclass(frozen=True)
class OutputConfig:
    """``output``: which files and figures a run writes."""

    plots: Any = "auto"  # auto (runs of <= PLOTS_AUTO_MAX_REQUESTS requests) | true | false
    progress: Any = "auto"  # a tqdm bar: auto (stderr is a terminal) | true | false
    format: str = "csv"  # csv | parquet
    tokens: str = "all"  # all | none (no tokens file; ITL samples pooled as requests end)

    def __post_init__(self) -> None:
        check_choice(self.plots, "output.plots", AUTO_OR_BOOL)
        check_choice(self.progress, "output.progress", AUTO_OR_BOOL)
        check_choice(self.format, "output.format", FILE_FORMATS)
        check_choice(self.tokens, "output.tokens", TOKEN_FILES)

    @property
    def show_progress(self) -> bool:
        if self.progress == "auto":
            import sys

            return sys.stderr.isatty()
        return bool(self.progress)


@dataclass(frozen=True)
class MetricsConfig:
    """``metrics``: how the summary is computed (metric definitions: docs/outputs.md)."""

    percentile_method: str = "nearest_rank"  # nearest_rank | linear
    prefix_cost: Optional[list[float]] = None  # noqa: UP045  [a, b] of C(n) = a·n + b·n(n+1)/2; None: model FLOPs
    prompt_len_edges: list[int] = dataclasses.field(default_factory=lambda: [256, 1024, 4096])
    latency_from: str = "arrival"  # arrival | receipt: TTFT, E2E, queueing from the engine loop's taking it in

    def __post_init__(self) -> None:
        check_choice(self.percentile_method, "metrics.percentile_method", PERCENTILE_METHODS)
        check_choice(self.latency_from, "metrics.latency_from", LATENCY_ORIGINS)
        if self.prefix_cost is not None:
            cost = self.prefix_cost
            if not isinstance(cost, list | tuple) or len(cost) != 2:
                raise ValueError(f"metrics.prefix_cost={cost!r}; allowed: [a, b], two numbers >= 0, or null "
                                 "(the model's FLOPs)")
            _put(self, "prefix_cost", [check_float(v, f"metrics.prefix_cost[{i}]") for i, v in enumerate(cost)])
        edges = self.prompt_len_edges
        ok = isinstance(edges, list | tuple)
        values = [check_int(v, f"metrics.prompt_len_edges[{i}]", 1, whole_float=True) for i, v in enumerate(edges)] \
            if ok else []
        if not ok or any(b <= a for a, b in zip(values, values[1:], strict=False)):
            raise ValueError(f"metrics.prompt_len_edges={edges!r}; allowed: a list of increasing positive integers")
        _put(self, "prompt_len_edges", values)


@dataclass(frozen=True)
class SimOptions:
    """The simulator's ``backend`` section (``conf/backend/sim.yaml``)."""

    name: str = "sim"
    fast_forward: bool = True  # runs of pure-decode steps skip schedule / execute / apply (byte-identical)
    step_noise: bool = True  # replay a calibration file's recorded step noise (sim/noise.py)
    noise_seed: int = 0

    def __post_init__(self) -> None:
        check_choice(self.name, "backend.name", ("sim",))
        check_bool(self.fast_forward, "backend.fast_forward")
        check_bool(self.step_noise, "backend.step_noise")
        check_int(self.noise_seed, "backend.noise_seed", 0)


@dataclass(frozen=True)
class ClusterConfig:
    """``cluster`` and ``replicas``: colocated replicas, or PD disaggregation (prefill and decode replicas, each
    request's KV moved over ``link``; the link is the simulator's price, the engine measures its copies)."""

    kind: str = "colocated"
    num_replicas: int = 1  # all replicas (pd: prefill + decode)
    num_prefill: int = 0  # pd: the first num_prefill replicas prefill, the rest decode
    link: Link | None = None  # pd on the simulator: the KV link
    link_name: str | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig, hardware: HardwareSpec, priced: bool) -> ClusterConfig:
        """``priced``: the simulator prices transfers on ``link`` (the engine measures its copies: no link)."""
        node = cfg.get("cluster")
        kind = check_choice(node.get("name") if node is not None else "colocated", "cluster.name", CLUSTERS)
        n = check_int(cfg.get("replicas", 1), "replicas", 1, whole_float=True)
        if kind == "colocated":
            return cls(kind, n)
        prefill, decode = (check_int(node.get(k), f"cluster.{k}", 1, whole_float=True)
                           for k in ("prefill_replicas", "decode_replicas"))
        if n not in (1, prefill + decode):
            raise ValueError(f"replicas={n} with cluster=pd: the cluster has cluster.prefill_replicas + "
                             f"cluster.decode_replicas = {prefill + decode} replicas; leave replicas at 1")
        return cls(kind, prefill + decode, prefill, _kv_link(node, hardware) if priced else None, node.get("link"))


def _kv_link(node: DictConfig, hardware: HardwareSpec) -> Link:
    """``cluster.link``, a preset of ``hardware.links``, with ``cluster.link_bandwidth_bytes_s`` /
    ``cluster.link_latency_s`` overriding its values (or alone, link null)."""
    name, bw, latency = node.get("link"), node.get("link_bandwidth_bytes_s"), node.get("link_latency_s")
    if name is not None:
        presets = hardware.links or {}
        if name not in presets:
            raise ValueError(f"cluster.link={name!r}: not a link preset of hardware={hardware.name}; allowed: "
                             f"{sorted(presets)}, or null with cluster.link_bandwidth_bytes_s")
        bw = presets[name].get("bandwidth_bytes_s") if bw is None else bw
        latency = presets[name].get("latency_s", 0.0) if latency is None else latency
    if bw is None:
        raise ValueError("cluster.link_bandwidth_bytes_s is required when cluster.link is null")
    return Link(check_float(bw, "cluster.link_bandwidth_bytes_s", strict=True),
                check_float(latency or 0.0, "cluster.link_latency_s"))


@dataclass(frozen=True)
class SpeculationConfig:
    """``spec``: speculative decoding (off, prompt-lookup n-grams, or a draft model) and its policy node."""

    method: str | None = None  # None | ngram | draft
    policy: Any = None  # the spec/policy node (a policies.speculation class by _target_)
    acceptance_rate: float = 0.0  # simulator: the chance a draft is accepted after accepted ones
    draft_model: ModelSpec | None = None
    draft_cost: str = "roofline"  # simulator: roofline (the draft's roofline added to each verify) | included
    ngram: tuple[int, int] = (1, 3)  # engine: n-gram sizes looked up (min_n, max_n)
    max_drafts: int = 4  # the most drafts a decode verifies (the policy's k, else max_k)

    @classmethod
    def from_config(cls, node: DictConfig | None, target: ModelSpec) -> SpeculationConfig:
        method = check_choice(node.get("method") if node is not None else None, "spec.method", SPEC_METHODS)
        if not method:
            return cls()
        if "policy" not in node:
            raise ValueError(f"spec.method={method} needs spec.policy (a policies.speculation class by _target_)")
        draft = _draft_model(str(node.draft_model), target) if method == "draft" else None
        ngram = node.get("ngram") or {}
        policy = node.policy
        return cls(method, policy, check_float(node.get("acceptance_rate", 0.0), "spec.acceptance_rate"), draft,
                   check_choice(node.get("draft_cost", "roofline"), "spec.draft_cost", ("roofline", "included")),
                   (check_int(ngram.get("min_n", 1), "spec.ngram.min_n", 1),
                    check_int(ngram.get("max_n", 3), "spec.ngram.max_n", 1)),
                   int(policy.get("k", policy.get("max_k", 4))))


def shared_data(*parts: str) -> Path:
    """A folder of the data beside the checkout: ``<repo>/shared/data/...`` or ``<repo>/../shared/data/...``
    (traces, published GPU measurements, GPU ground truth; their sources in its SOURCES.md)."""
    for root in (REPO_ROOT, REPO_ROOT.parent):
        d = root.joinpath("shared", "data", *parts)
        if d.is_dir():
            return d
    raise FileNotFoundError(f"no shared/data/{'/'.join(parts)} under {REPO_ROOT} or {REPO_ROOT.parent}")


def conf_option(group: str, name: str, key: str | None = None) -> dict[str, Any]:
    """One option of a conf/ group as a plain mapping (e.g. a draft model named by its option); ``key``: the config
    key that named it, for the error (default: the group)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        allowed = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"{key or group}={name!r}: no such option; allowed: {allowed}")
    return plain(OmegaConf.load(path))


def _draft_model(name: str, target: ModelSpec) -> ModelSpec:
    """``spec.draft_model``: a conf/model option name or a checkpoint directory; same vocabulary as the target."""
    if (Path(name) / "config.json").is_file():
        draft = ModelSpec.from_pretrained(Path(name).resolve())
    elif (CONF_DIR / "model" / f"{name}.yaml").is_file():
        draft = ModelSpec.from_config(conf_option("model", name))
    else:
        raise ValueError(f"spec.draft_model={name!r}: neither a conf/model option nor a checkpoint directory")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"spec.draft_model={name!r}: vocabulary {draft.vocab_size} != the target's "
                         f"{target.vocab_size}; a draft must share the target's tokenizer")
    return draft


# ---- the run --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """One run, parsed: what every builder below the entry point reads instead of the raw config.

    ``model`` is the model as its weights and KV are stored (on the engine, ``backend.dtype`` when it overrides the
    model's); ``num_kv_blocks`` and ``num_host_blocks`` are each replica's pools, sized once here for both backends.
    ``config`` is the composed config itself: its plugin nodes (scheduler, eviction, router, placement, preemption,
    cost_model, workload, slo) are instantiated from it, and it is what a run directory's config.yaml records."""

    config: DictConfig
    backend: str
    model: ModelSpec
    hardware: HardwareSpec
    kv: KVConfig
    quant: QuantSpec
    parallel: ParallelConfig
    limits: SchedulerLimits
    cluster: ClusterConfig
    speculation: SpeculationConfig
    output: OutputConfig
    metrics: MetricsConfig
    seed: int
    engine_clock: str  # the engine's stopwatch, auto resolved: wall | thread
    frontend_delay_s: float | None  # None: a calibrated simulator's recorded value, else 0
    num_kv_blocks: int
    num_host_blocks: int
    sim: SimOptions | None = None
    engine: EngineOptions | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RunConfig:
        backend = check_choice(cfg.backend.get("name"), "backend.name", BACKENDS)
        seed = check_int(cfg.get("seed", 0), "seed", 0)  # first: backend.noise_seed defaults to it
        options = plain(cfg.backend)
        engine = EngineOptions.from_mapping(options) if backend == "engine" else None
        sim = _record(SimOptions, "backend", {"noise_seed": seed, **options}) \
            if backend == "sim" else None
        quant = _record(QuantSpec, "quant", cfg.get("quant"))
        hardware = HardwareSpec.from_mapping(plain(cfg.hardware))
        model = stored_model(ModelSpec.from_config(plain(cfg.model)), engine)
        if engine is not None:
            engine.check_quant(quant)
        kv = _record(KVConfig, "kv", cfg.kv)
        parallel = _record(ParallelConfig, "parallel", cfg.get("parallel"))
        parallel.check(model)
        arithmetic.check_group_size(model, quant.weight_bits, quant.group_size, parallel.tp,
                                    max(1, parallel.tp * parallel.dp // parallel.ep))
        if engine is not None and (parallel.pp > 1 or parallel.dp > 1):
            key = "pp" if parallel.pp > 1 else "dp"
            raise ValueError(f"parallel.{key}={getattr(parallel, key)}: the engine runs tensor (parallel.tp) and "
                             "expert (parallel.ep) parallelism only; pipeline and data-parallel attention are "
                             "simulated (backend=sim)")
        return cls(
            config=cfg, backend=backend, model=model, hardware=hardware, kv=kv, quant=quant, parallel=parallel,
            limits=scheduler_limits(cfg, model, engine),
            cluster=ClusterConfig.from_config(cfg, hardware, priced=backend == "sim"),
            speculation=SpeculationConfig.from_config(cfg.get("spec"), model),
            output=_record(OutputConfig, "output", cfg.get("output")),
            metrics=_record(MetricsConfig, "metrics", cfg.get("metrics")),
            seed=seed,
            engine_clock=resolve_engine_clock(cfg.get("engine_clock", "auto"), engine, parallel.tp),
            frontend_delay_s=None if cfg.get("frontend_delay_s") is None
            else check_float(cfg.frontend_delay_s, "frontend_delay_s"),
            num_kv_blocks=num_kv_blocks(kv, quant, model, hardware, parallel),
            num_host_blocks=num_host_blocks(kv, quant, model),
            sim=sim, engine=engine)

    @property
    def kv_bytes_per_token(self) -> float:
        return arithmetic.kv_bytes_per_token(self.model, self.quant.kv_bits)

    @property
    def kv_bytes_per_block(self) -> float:
        return arithmetic.kv_bytes_per_block(self.model, self.kv.block_size, self.quant.kv_bits)

    @property
    def weight_bytes(self) -> float:
        return arithmetic.weight_bytes(self.model, self.quant.weight_bits, self.quant.group_size)

    @property
    def measured(self) -> bool:
        """Step times are measured (the engine), not priced (the simulator's cost model)."""
        return self.backend == "engine"


def stored_model(spec: ModelSpec, engine: EngineOptions | None) -> ModelSpec:
    """``spec`` in the dtype its KV and weights are stored in: ``backend.dtype`` on the engine when it overrides it."""
    if engine is None or engine.dtype is None or engine.dtype == spec.dtype:
        return spec
    return dataclasses.replace(spec, dtype=engine.dtype)


def scheduler_limits(cfg: DictConfig, model: ModelSpec, engine: EngineOptions | None) -> SchedulerLimits:
    """The replica's limits: the scheduler group's budgets, the model's length, vocabulary and EOS ids. Sim-vs-engine
    comparisons generate exactly each request's output length; an engine run may stop at EOS (``ignore_eos``)."""
    sched = cfg.scheduler
    missing = [k for k in LIMIT_KEYS if k not in sched]
    if missing:
        raise ValueError(f"scheduler config lacks {missing}")
    budget, seqs = (check_int(sched[k], f"scheduler.{k}", 1, whole_float=True) for k in LIMIT_KEYS)
    timeout = cfg.get("request_timeout_s")
    stop_at_eos = engine is not None and not engine.ignore_eos
    return SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=model.max_model_len,
                           request_timeout_s=timeout, vocab_size=model.vocab_size,
                           eos_token_ids=frozenset(model.eos_token_ids), ignore_eos=not stop_at_eos)


def resolve_engine_clock(clock: Any, engine: EngineOptions | None, tp: int = 1) -> str:
    """``engine_clock``: wall | thread | auto (thread for the CPU engine on one torch thread, else wall). thread
    needs that CPU setting, and one rank (``tp`` > 1: a rank's thread time leaves out its waits for the others)."""
    clock = check_choice(clock or "auto", "engine_clock", ENGINE_CLOCKS)
    one_cpu_thread = engine is not None and engine.device == "cpu" and engine.num_threads == 1 and tp == 1
    if clock == "auto":
        return "thread" if one_cpu_thread else "wall"
    if clock == "thread" and engine is not None and not one_cpu_thread:
        raise ValueError(f"engine_clock=thread needs backend.device=cpu, backend.num_threads=1 and parallel.tp=1, "
                         f"got device={engine.device!r} num_threads={engine.num_threads!r} tp={tp}; or set "
                         "engine_clock=wall")
    return clock


@dataclass(frozen=True)
class StageMemory:
    """What one device of a pipeline stage holds: its decoder ``layers``, its weights (1/tp of the stage's dense
    weights, 1/(tp x dp) of its routed experts, the embedding on the first stage and the LM head on the last) and
    the KV bytes one token and one block take on it (1/tp of the KV heads, MLA's latent whole)."""

    layers: range
    weight_bytes: float
    kv_bytes_per_token: float
    kv_bytes_per_block: float


def stage_memory(quant: QuantSpec, model: ModelSpec, parallel: ParallelConfig, block_size: int) -> list[StageMemory]:
    """Per pipeline stage, what one of its devices holds (``num_kv_blocks`` sizes the pool from these)."""
    par, stages = parallel, arithmetic.stage_layers(model, parallel.pp)
    out = []
    for i, layers in enumerate(stages):
        kv_tok = arithmetic.kv_bytes_per_token_of_stage(model, quant.kv_bits, par.tp, layers)
        w = arithmetic.weight_bytes_per_device(model, quant.weight_bits, quant.group_size, par.tp, layers,
                                               par.tp * par.dp, i == 0, i == len(stages) - 1)
        out.append(StageMemory(layers, w, kv_tok, kv_tok * block_size))
    return out


def num_kv_blocks(kv: KVConfig, quant: QuantSpec, model: ModelSpec, hardware: HardwareSpec,
                  parallel: ParallelConfig | None = None) -> int:
    """``kv.num_blocks``, else ``kv.memory_bytes`` (per device) worth of blocks, else what each device's memory holds
    after its weights. Both backends size the pool with this one function, so they see the same pool. Bytes are what
    the engine stores (``core.arithmetic``): int8 KV with its float32 scales, W4 weights with a scale and zero point
    per group, in the stored dtype. In a parallel deployment (``parallel``) a device holds its stage's layers, 1/tp
    of their dense weights and KV heads (MLA's latent whole), 1/(tp x dp) of their routed experts; the pool is what
    the fullest stage's devices hold (one pool per dp rank)."""
    if kv.num_blocks is not None:
        return kv.num_blocks
    par = parallel or ParallelConfig()
    stages = stage_memory(quant, model, par, kv.block_size)
    per_block = [s.kv_bytes_per_block for s in stages]
    if kv.memory_bytes is not None:
        budgets, key = [kv.memory_bytes] * len(stages), f"kv.memory_bytes={kv.memory_bytes!r}"
    else:
        weights = [s.weight_bytes for s in stages]
        usable = hardware.mem_bytes * kv.memory_fraction
        budgets = [usable - w for w in weights]
        key = f"kv.memory_fraction={kv.memory_fraction!r}"
        if min(budgets) <= 0:
            where = "" if par.devices == 1 else f" per device with {par}"
            # weights beyond the whole device: no memory fraction helps, only a wider split or fewer bits
            fix = "raise it, or set kv.num_blocks or kv.memory_bytes" if max(weights) < hardware.mem_bytes else \
                f"more than the device's {hardware.mem_bytes / 1e9:.3g} GB: raise parallel.tp or parallel.pp (an MoE " \
                "model: parallel.dp splits its experts), or lower quant.weight_bits"
            raise ValueError(f"{key}: model {model.name} ({max(weights) / 1e9:.3g} GB of weights{where} in "
                             f"{model.dtype}) does not fit hardware.mem_bytes x kv.memory_fraction "
                             f"({usable / 1e9:.3g} GB); {fix}")
    blocks = min(max(0, int(b // p)) for b, p in zip(budgets, per_block, strict=True))
    if blocks < 1:
        raise ValueError(f"{key} leaves {min(budgets):.3g} bytes of KV, which holds no block of "
                         f"{max(per_block):.3g} bytes")
    return blocks


def num_host_blocks(kv: KVConfig, quant: QuantSpec, model: ModelSpec) -> int:
    """The host KV tier per replica: ``kv.host_memory_bytes`` worth of blocks (as stored), else ``kv.host_blocks``;
    0 (the default) is off."""
    if kv.host_memory_bytes is not None:
        return arithmetic.num_blocks_for_memory(model, kv.block_size, kv.host_memory_bytes, quant.kv_bits)
    return kv.host_blocks


# ---- Hydra structured configs ----------------------------------------------------------------------------------------
SCHEMAS = {"kv": KVConfig, "quant": QuantSpec, "parallel": ParallelConfig, "output": OutputConfig,
           "metrics": MetricsConfig}


def _put(obj: Any, key: str, value: Any) -> None:
    """Set a normalised value on a frozen record from its ``__post_init__``."""
    object.__setattr__(obj, key, value)


def _hydra_type(t: Any) -> Any:
    """An annotation as OmegaConf's structured configs take it: ``X | None`` -> Optional[X], other unions -> Any."""
    if isinstance(t, types.UnionType) or typing.get_origin(t) is Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        inner = args[0] if len(args) == 1 else Any
        return Optional[_hydra_type(inner)] if type(None) in typing.get_args(t) else inner  # noqa: UP045
    return t


def schema_of(cls: type) -> type:
    """A mutable mirror of the frozen record ``cls`` (same fields, types and defaults) for Hydra's ConfigStore: Hydra
    cannot merge the command line into a frozen (read-only) structured config."""
    hints = typing.get_type_hints(cls)
    spec = [(f.name, _hydra_type(hints[f.name]), dataclasses.field(default=f.default) if f.default is not
             dataclasses.MISSING else dataclasses.field(default_factory=f.default_factory)) for f in fields(cls)]
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", spec)


def register_schemas() -> None:
    """Store each plain section's schema as option ``<section>`` of the config group ``schema``; ``conf/config.yaml``
    puts them in its defaults (``- schema@kv: kv``), so Hydra checks those sections' types and keys. Called when
    this module is imported (Hydra's ConfigStore is its own process-wide registry; storing again replaces)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, cls in SCHEMAS.items():
        store.store(group="schema", name=name, node=schema_of(cls))


def section(cls: type, name: str, node: Mapping[str, Any] | DictConfig | None) -> Any:
    """One plain section parsed on its own (e.g. ``output`` and ``metrics`` of a load test, which has no run)."""
    return _record(cls, name, node)


register_schemas()
