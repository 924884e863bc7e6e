"""Wiring: turn a composed Hydra config into replicas, executors, a router and a workload: a ``ServingLoop``.

Plugins are instantiated once per run (one scheduler and eviction policy per replica), never per step. This is
the one place that knows both backends: sim/ and engine/ never import each other.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from core import arithmetic
from core.checks import check_bool, check_choice, check_float, check_fraction, check_int
from core.interfaces import Executor, Workload
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.metrics import ITLPool
from core.replica import Replica, SchedulerLimits
from core.specs import HardwareSpec, ModelSpec
from experiments.targets import check_targets

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
BACKENDS = ("sim", "engine")
ENGINE_CLOCKS = ("auto", "wall", "thread")
LIMIT_KEYS = ("max_num_batched_tokens", "max_num_seqs")
PROGRESS_SETTINGS = ("auto", True, False)


def model_spec(cfg: DictConfig) -> ModelSpec:
    """The model group, or the config.json of ``model.path`` when a checkpoint directory is given."""
    return ModelSpec.from_config(OmegaConf.to_container(cfg.model, resolve=True))


def hardware_spec(cfg: DictConfig) -> HardwareSpec:
    return HardwareSpec.from_mapping(OmegaConf.to_container(cfg.hardware, resolve=True))


def kv_bits(cfg: DictConfig) -> int:
    """KV element width both backends assume: 8 with an int8 KV cache (plus its float32 scales, which
    ``core.arithmetic`` counts), else 16 (the model dtype's width)."""
    if cfg.backend.name == "engine":
        kv_dtype = check_choice(cfg.backend.get("kv_dtype") or "auto", "backend.kv_dtype", arithmetic.KV_DTYPE_BITS)
        return arithmetic.kv_bits_of(kv_dtype)
    return int(cfg.cost_model.get("kv_bits", 16))


def weight_format(cfg: DictConfig) -> tuple[int, int]:
    """(weight bits, group size) both backends assume: W4A16 on the engine, the cost model's setting in the sim."""
    if cfg.backend.name == "engine":
        quantized = cfg.backend.get("quant") == "w4a16"
        return (4 if quantized else 16), int(cfg.backend.get("quant_group_size", 128))
    return int(cfg.cost_model.get("weight_bits", 16)), int(cfg.cost_model.get("group_size", 128))


def num_kv_blocks(cfg: DictConfig, spec: ModelSpec, hw: HardwareSpec) -> int:
    """``kv.num_blocks``, else ``kv.memory_bytes`` worth of blocks, else what the hardware's memory holds
    after the weights. Both backends size the pool with this one function, so they see the same pool.

    Bytes are what the engine stores (``core.arithmetic``): int8 KV with its float32 scales, W4 weights with a
    scale and zero point per group, and on the engine backend in ``backend.dtype`` when it overrides the model's."""
    kv = cfg.kv
    block_size = check_int(kv.block_size, "kv.block_size", 1, whole_float=True)
    if kv.num_blocks is not None:
        return check_int(kv.num_blocks, "kv.num_blocks", whole_float=True)
    spec = stored_spec(cfg, spec)
    per_block = arithmetic.kv_bytes_per_block(spec, block_size, kv_bits(cfg))
    if kv.memory_bytes is not None:
        budget = check_float(kv.memory_bytes, "kv.memory_bytes", strict=True)
        key = f"kv.memory_bytes={kv.memory_bytes!r}"
    else:
        fraction = check_fraction(kv.memory_fraction, "kv.memory_fraction")
        weights = arithmetic.weight_bytes(spec, *weight_format(cfg))
        budget = hw.mem_bytes * fraction - weights
        key = f"kv.memory_fraction={kv.memory_fraction!r}"
        if budget <= 0:
            raise ValueError(f"{key}: model {spec.name} ({weights / 1e9:.3g} GB of weights) does not fit "
                             f"hardware.mem_bytes x kv.memory_fraction ({hw.mem_bytes * fraction / 1e9:.3g} GB); "
                             f"raise it, or set kv.num_blocks or kv.memory_bytes")
    blocks = arithmetic.num_blocks_for_memory(spec, block_size, budget, kv_bits(cfg))
    if blocks < 1:
        raise ValueError(f"{key} leaves {budget:.3g} bytes of KV, which holds no block of {per_block:.3g} bytes")
    return blocks


def stored_spec(cfg: DictConfig, spec: ModelSpec) -> ModelSpec:
    """``spec`` in the dtype its KV and weights are stored in: ``backend.dtype`` on the engine when it overrides the
    model's."""
    dtype = cfg.backend.get("dtype") if cfg.backend.name == "engine" else None
    if dtype and dtype != spec.dtype:  # the engine allocates KV (and keeps weights) in backend.dtype
        check_choice(dtype, "backend.dtype", arithmetic.DTYPE_BYTES)
        spec = ModelSpec.from_mapping({**spec.to_dict(), "dtype": dtype})
    return spec


def check_memory(cfg: DictConfig, spec: ModelSpec, num_blocks: int, num_replicas: int,
                 available: int | None = None) -> None:
    """Refuse, before anything is built, a config whose memory cannot fit this machine, naming the key: every
    replica's KV bookkeeping once all its blocks have been used (``core.resources``) plus, for the engine, the
    weights and each replica's KV tensors (against the GPU's free memory when ``backend.device`` is cuda).
    ``available``: free host bytes (default: read from the OS; no check when it cannot be read)."""
    from core.resources import REPLICA_BYTES, available_memory_bytes, block_bookkeeping_bytes, gb

    kv = cfg.kv
    if kv.get("num_blocks") is not None:
        key, shown = "kv.num_blocks", kv.num_blocks
    elif kv.get("memory_bytes") is not None:
        key, shown = "kv.memory_bytes", kv.memory_bytes
    else:
        key, shown = "kv.memory_fraction", f"{kv.memory_fraction} ({num_blocks} blocks)"
    # (where, bytes per block, bytes per replica besides its blocks, bytes once, bytes free)
    host_blocks = num_host_blocks(cfg, spec)  # the host tier: its Block objects, and on the engine its tensors
    host_tensor = arithmetic.kv_bytes_per_block(stored_spec(cfg, spec), int(kv.block_size), kv_bits(cfg)) \
        if cfg.backend.name == "engine" else 0.0
    checks = [("host memory", float(block_bookkeeping_bytes()),
               float(REPLICA_BYTES) + host_blocks * (block_bookkeeping_bytes() + host_tensor), 0.0,
               available_memory_bytes() if available is None else available)]
    if cfg.backend.name == "engine":
        stored = stored_spec(cfg, spec)
        tensor = arithmetic.kv_bytes_per_block(stored, int(kv.block_size), kv_bits(cfg))
        weights = arithmetic.weight_bytes(stored, *weight_format(cfg))
        device = str(cfg.backend.get("device", "cpu"))
        if device.startswith("cuda"):
            checks.append(("GPU memory", tensor, 0.0, weights, _gpu_free(device)))
        else:
            where, per_block, per_replica, _, free = checks[0]
            checks[0] = (where, per_block + tensor, per_replica, weights, free)
    for where, per_block, per_replica, once, free in checks:
        need = num_replicas * (num_blocks * per_block + per_replica) + once
        if free is None or need <= free:
            continue
        fit = max(0, int(((free - once) / num_replicas - per_replica) // per_block))
        raise ValueError(f"{key}={shown} with replicas={num_replicas} needs ~{gb(need)} of {where} "
                         f"({per_block:.0f} bytes per KV block per replica once the pool is used) but {gb(free)} "
                         f"is available: lower {key} (~{fit} blocks per replica fit) or replicas")


def _gpu_free(device: str) -> int | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except Exception:  # noqa: BLE001 - no estimate rather than a failed start
        return None


def _without(node: DictConfig, keys) -> DictConfig:
    d = OmegaConf.to_container(node, resolve=True)
    for k in keys:
        d.pop(k, None)
    return OmegaConf.create(d)


def instantiate_group(node: DictConfig, group: str, **kwargs) -> Any:
    """Hydra's instantiate for one config group, failing with the key to fix."""
    if "_target_" not in node:
        raise ValueError(f"{group} config has no _target_; choose one of conf/{group}/*.yaml or set {group}._target_")
    check_targets(OmegaConf.to_container(node, resolve=False), group)  # before Hydra calls anything
    try:
        return instantiate(node, **kwargs)
    except Exception as e:  # Hydra wraps what the target raised; restate it with the key to fix
        cause = e.__cause__ if isinstance(e, InstantiationException) and e.__cause__ is not None else e
        where = f"{group}._target_={node._target_!r}"
        if isinstance(cause, TypeError):
            raise ValueError(_argument_error(group, node, str(cause))) from e
        if isinstance(cause, ValueError):  # the target's own check, which names its key
            raise ValueError(f"{where}: {cause}") from e
        raise ValueError(f"cannot instantiate {where}: {cause}") from e


def _argument_error(group: str, node: DictConfig, message: str) -> str:
    """Python's TypeError for a call with a bad argument (it names the argument), as a config error: an unknown
    key or missing required keys of ``group``, with the keys the target takes."""
    target = node._target_
    try:
        params = inspect.signature(get_object(target)).parameters.values()
        keys = sorted(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    except Exception:  # no signature to show
        keys = None
    allowed = f"; allowed: {keys}" if keys is not None else ""
    if m := re.search(r"unexpected keyword argument '(\w+)'", message):
        return f"{group}.{m[1]}: unknown key for {target}{allowed}"
    if m := re.search(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.*)", message):
        missing = re.findall(r"'(\w+)'", m[1])
        return f"{group}: missing required keys {missing} for {target}"
    if "takes no arguments" in message:
        given = sorted(str(k) for k in node if not str(k).startswith("_"))
        return f"{group}: unknown keys {given} for {target}, which takes none"
    return f"{group} ({target}): {message}{allowed}"


def build_workload(node: DictConfig | Mapping[str, Any]) -> Workload:
    """The workload a config describes (``conf/workload``), through Hydra's instantiate like every group: lists and
    dicts reach the class as plain Python containers. A workload config nested in another (the parts of
    ``core.workload.combinators.Mix``, the inner workload of ``Window``) is instantiated as a partial
    (``_partial_: true`` unless it says otherwise): its parent calls it, supplying defaults such as a part's seed."""
    if not OmegaConf.is_config(node):
        if not isinstance(node, Mapping):
            raise ValueError(f"workload config must be a mapping with _target_, got {type(node).__name__}")
        node = OmegaConf.create(dict(node))
    try:
        tree = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = e.full_key if e.full_key.startswith("workload") else f"workload.{e.full_key}"
        raise ValueError(f"{key} is required (???): set it") from e
    except Exception as e:  # a broken interpolation
        raise ValueError(f"workload config: {e}") from e
    wl = instantiate_group(OmegaConf.create(_nested_partial(tree, nested=False)), "workload", _convert_="all")
    if not isinstance(wl, Workload):
        raise ValueError(f"workload._target_={tree['_target_']} does not implement Workload "
                         "(initial() and on_finish(state, now))")
    return wl


def _nested_partial(tree: Any, nested: bool) -> Any:
    """Mark every ``_target_`` mapping below the top one ``_partial_: true`` (where it does not set it)."""
    if isinstance(tree, dict):
        out = {k: _nested_partial(v, True) for k, v in tree.items()}
        if nested and "_target_" in out:
            out.setdefault("_partial_", True)
        return out
    if isinstance(tree, list):
        return [_nested_partial(v, True) for v in tree]
    return tree


def build_replicas(cfg: DictConfig, spec: ModelSpec, num_blocks: int) -> list[Replica]:
    sched = cfg.scheduler
    missing = [k for k in LIMIT_KEYS if k not in sched]
    if missing:
        raise ValueError(f"scheduler config lacks {missing}")
    # Sim-vs-engine comparisons generate exactly each request's output length; an engine run may stop at EOS.
    stop_at_eos = cfg.backend.name == "engine" and not cfg.backend.get("ignore_eos", True)
    budget, seqs = (check_int(sched[k], f"scheduler.{k}", whole_float=True) for k in LIMIT_KEYS)
    limits = SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=spec.max_model_len,
                             request_timeout_s=cfg.request_timeout_s, vocab_size=spec.vocab_size,
                             eos_token_ids=frozenset(spec.eos_token_ids), ignore_eos=not stop_at_eos)
    n = num_replicas(cfg)
    check_memory(cfg, spec, num_blocks, n)
    check_bool(cfg.kv.prefix_caching, "kv.prefix_caching")
    sched_node, block_size = _without(sched, LIMIT_KEYS), check_int(cfg.kv.block_size, "kv.block_size", 1,
                                                                    whole_float=True)
    method = spec_method(cfg)
    host_blocks = num_host_blocks(cfg, spec)
    mode = cfg.kv.get("prefix_cache_mode", "prompt")
    return [Replica(i, instantiate_group(sched_node, "scheduler"),
                    KVCacheManager(num_blocks, block_size, instantiate_group(cfg.eviction, "eviction"),
                                   cfg.kv.prefix_caching, host_tier(cfg, host_blocks, block_size), mode), limits,
                    speculation=instantiate_group(cfg.spec.policy, "speculation") if method else None,
                    preemption=preemption_policy(cfg, spec, host_blocks))
            for i in range(n)]


def num_host_blocks(cfg: DictConfig, spec: ModelSpec) -> int:
    """Host KV tier size per replica: ``kv.host_memory_bytes`` worth of blocks (as the engine stores them), else
    ``kv.host_blocks``; 0 (the default) is off."""
    kv = cfg.kv
    if kv.get("host_memory_bytes") is not None:
        budget = check_float(kv.host_memory_bytes, "kv.host_memory_bytes")
        return arithmetic.num_blocks_for_memory(stored_spec(cfg, spec), int(kv.block_size), budget, kv_bits(cfg))
    return check_int(kv.get("host_blocks", 0) or 0, "kv.host_blocks", 0, whole_float=True)


def host_tier(cfg: DictConfig, num_blocks: int, block_size: int) -> Any:
    """One replica's host KV tier (None when off), with its own eviction policy (``kv.host_eviction``, a
    conf/eviction option, default lru) for spilled prefix blocks."""
    if not num_blocks:
        return None
    from core.host_tier import HostTier

    name = str(cfg.kv.get("host_eviction") or "lru")
    option = CONF_DIR / "eviction" / f"{name}.yaml"
    if not option.is_file():
        allowed = sorted(p.stem for p in option.parent.glob("*.yaml"))
        raise ValueError(f"kv.host_eviction={name!r}; allowed: {allowed}")
    spill = check_bool(cfg.kv.get("host_spill", True), "kv.host_spill")
    return HostTier(num_blocks, block_size, instantiate_group(OmegaConf.load(option), "eviction"), spill)


def preemption_policy(cfg: DictConfig, spec: ModelSpec, host_blocks: int) -> Any:
    """The ``preemption`` group's policy (None when the config has no such group: recompute). Null arguments the
    target takes are filled in from the model and hardware: ``kv_bytes_per_token``, ``host_link_bw``,
    ``host_link_latency_s``, ``prefill_tokens_per_s`` (a roofline estimate at 50% MFU)."""
    node = cfg.get("preemption")
    if node is None:
        return None
    if not host_blocks and node.get("_target_") != "policies.preemption.recompute.RecomputePreemption":
        raise ValueError(f"preemption._target_={node.get('_target_')!r} swaps to a host KV tier, which is off: "
                         "set kv.host_blocks (or kv.host_memory_bytes) > 0, or preemption=recompute")
    hw = hardware_spec(cfg)
    known = {"kv_bytes_per_token": lambda: arithmetic.kv_bytes_per_token(stored_spec(cfg, spec), kv_bits(cfg)),
             "host_link_bw": lambda: _host_link_bw(hw),
             "host_link_latency_s": lambda: hw.host_link_latency_s,
             "prefill_tokens_per_s": lambda: 0.5 * hw.peak_flops / arithmetic.linear_flops_per_token(spec)}
    filled = {k: make() for k, make in known.items() if k in node and node[k] is None}
    return instantiate_group(node, "preemption", **filled)


def _host_link_bw(hw: HardwareSpec) -> float:
    if hw.host_link_bw <= 0:
        raise ValueError(f"hardware.host_link_bw is not set for {hw.name}: the host KV tier needs the device-host "
                         "link bandwidth (bytes/s per direction)")
    return hw.host_link_bw


def host_link(cfg: DictConfig, spec: ModelSpec, replica: Replica) -> Any:
    """The simulator's price of host-tier copies (None without a host tier)."""
    kv = replica.kv
    if kv.host is None:
        return None
    from core.host_tier import HostLink

    hw = hardware_spec(cfg)
    per_block = arithmetic.kv_bytes_per_block(stored_spec(cfg, spec), kv.block_size, kv_bits(cfg))
    return HostLink(_host_link_bw(hw), hw.host_link_latency_s, per_block)


SPEC_METHODS = (None, "ngram", "draft")


def spec_method(cfg: DictConfig) -> str | None:
    """``spec.method``: None (no speculative decoding), ngram or draft (conf/spec)."""
    node = cfg.get("spec")
    method = check_choice(node.get("method") if node is not None else None, "spec.method", SPEC_METHODS)
    if method and "policy" not in node:
        raise ValueError(f"spec.method={method} needs spec.policy (a policies.speculation class by _target_)")
    return method


def draft_model_spec(cfg: DictConfig) -> ModelSpec:
    """``spec.draft_model``: a conf/model option name or a checkpoint directory; same vocabulary as the target."""
    name = str(cfg.spec.draft_model)
    option = CONF_DIR / "model" / f"{name}.yaml"
    if (Path(name) / "config.json").is_file():
        draft = ModelSpec.from_pretrained(Path(name).resolve())
    elif option.is_file():
        draft = ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(option), resolve=True))
    else:
        raise ValueError(f"spec.draft_model={name!r}: neither a conf/model option nor a checkpoint directory")
    target = model_spec(cfg)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"spec.draft_model={name!r}: vocabulary {draft.vocab_size} != the target's "
                         f"{target.vocab_size}; a draft must share the target's tokenizer")
    return draft


def sim_speculation(cfg: DictConfig, replica: int) -> Any:
    """The simulator's acceptance model and draft cost for one replica (None without speculative decoding)."""
    method = spec_method(cfg)
    if not method:
        return None
    from sim.cost.roofline import RooflineCostModel
    from sim.speculative import SpeculativeModel

    draft = None
    if method == "draft":
        how = check_choice(cfg.spec.get("draft_cost", "roofline"), "spec.draft_cost", ("roofline", "included"))
        draft = RooflineCostModel(draft_model_spec(cfg), hardware_spec(cfg)) if how == "roofline" else None
    return SpeculativeModel(cfg.spec.acceptance_rate, seed=(int(cfg.seed), replica), draft_cost=draft)


def engine_clock(cfg: DictConfig) -> str:
    """The stopwatch of engine steps (``engine.executor.STOPWATCHES``): ``engine_clock`` wall | thread, or auto
    (thread for the CPU engine on one torch thread, else wall). thread needs that CPU setting."""
    clock = check_choice(cfg.get("engine_clock", "auto") or "auto", "engine_clock", ENGINE_CLOCKS)
    b = cfg.backend
    one_cpu_thread = b.get("device", "cpu") == "cpu" and b.get("num_threads") == 1
    if clock == "auto":
        return "thread" if one_cpu_thread else "wall"
    if clock == "thread" and b.name == "engine" and not one_cpu_thread:
        raise ValueError(f"engine_clock=thread needs backend.device=cpu and backend.num_threads=1, got "
                         f"device={b.get('device')!r} num_threads={b.get('num_threads')!r}; or set engine_clock=wall")
    return clock


def build_executors(cfg: DictConfig, spec: ModelSpec, replicas: list[Replica]) -> list[Executor]:
    """One executor per replica: a cost model's (sim) or a model's, timed on ``engine_clock`` (engine)."""
    name = cfg.backend.name
    if name == "sim":
        from sim.executor import CostModelExecutor
        from sim.noise import StepNoise

        cost = instantiate_group(cfg.cost_model, "cost_model")
        noise = step_noise(cfg)  # seeded per replica: replicas are machines of their own
        noise_seed = check_int(cfg.backend.get("noise_seed", cfg.seed), "backend.noise_seed", 0)
        return [CostModelExecutor(cost, speculation=sim_speculation(cfg, r.index), host_link=host_link(cfg, spec, r),
                                  noise=None if noise is None else StepNoise.from_mapping(noise, [noise_seed, r.index]))
                for r in replicas]
    if name == "engine":
        from engine.executor import EngineOptions, build_engine_executors

        options = EngineOptions.from_mapping(OmegaConf.to_container(cfg.backend, resolve=True))
        executors = build_engine_executors(spec, options, [r.kv for r in replicas], seed=int(cfg.seed),
                                           clock=engine_clock(cfg))
        method = spec_method(cfg)
        if method == "ngram":
            from engine.speculative import NgramProposer

            ngram = cfg.spec.get("ngram") or {}
            for ex in executors:
                ex.proposer = NgramProposer(check_int(ngram.get("min_n", 1), "spec.ngram.min_n", 1),
                                            check_int(ngram.get("max_n", 3), "spec.ngram.max_n", 1))
        elif method == "draft":
            from engine.executor import build_draft_proposer

            draft, model = draft_model_spec(cfg), None
            for ex in executors:  # one draft model, a KV pool per replica (as large as the target's)
                ex.proposer = build_draft_proposer(draft, ex.runner, ex.kv_manager.num_blocks,
                                                   dtype=options.torch_dtype, seed=int(cfg.seed), model=model)
                model = ex.proposer.runner.model
        return executors
    raise ValueError(f"backend.name={name!r}; allowed: {list(BACKENDS)}")


def replicas_for(cfg: DictConfig) -> list[Replica]:
    """The run's replicas, with the KV pool sized by ``num_kv_blocks``."""
    spec = model_spec(cfg)
    return build_replicas(cfg, spec, num_kv_blocks(cfg, spec, hardware_spec(cfg)))


MakeExecutors = Callable[[list[Replica]], list[Executor]]


def build_loop(cfg: DictConfig, make_executors: MakeExecutors | None = None,
               replicas: list[Replica] | None = None) -> ServingLoop:
    """The serving loop for ``cfg``: its replicas, router and workload, with executors from the backend (or from
    ``make_executors(replicas)``, e.g. a replay of recorded step times); a ``PDServingLoop`` for ``cluster=pd``."""
    if replicas is None:
        replicas = replicas_for(cfg)
    executors = make_executors(replicas) if make_executors else build_executors(cfg, model_spec(cfg), replicas)
    args = (replicas, executors, instantiate_group(cfg.router, "router"), build_workload(cfg.workload))
    options = dict(frontend_delay_s=frontend_delay(cfg),
                   fast_forward=check_bool(cfg.backend.get("fast_forward", True), "backend.fast_forward"),
                   itl_pool=itl_pool(cfg))
    if cluster_kind(cfg) == "pd":
        from core.disagg import PDServingLoop

        if make_executors is not None:
            raise ValueError("cluster=pd runs on its backend's own executors (a replay of recorded steps does not "
                             "replay transfers); use cluster=colocated")
        return PDServingLoop(*args, num_prefill=prefill_decode(cfg)[0],
                             placement=instantiate_group(cfg.placement, "placement"),
                             transport=kv_transport(cfg, executors), **options)
    return ServingLoop(*args, **options)


def itl_pool(cfg: DictConfig) -> ITLPool | None:
    """Without per-token output (``output.tokens=none``) requests fold their token times into an ITL pool as they
    end (``core.metrics.ITLPool``): the run's memory does not grow per token. None otherwise."""
    out = cfg.get("output") or {}
    if out.get("tokens", "all") != "none":
        return None
    return ITLPool(metrics_options(cfg, model_spec(cfg))["prompt_len_edges"])


# ---- cluster: colocated replicas, or PD disaggregation (core.disagg) -------------------------------------------
CLUSTERS = ("colocated", "pd")


def cluster_kind(cfg: DictConfig) -> str:
    """``cluster.name``: colocated (a config without the group too) or pd."""
    node = cfg.get("cluster")
    return check_choice(node.get("name") if node is not None else "colocated", "cluster.name", CLUSTERS)


def prefill_decode(cfg: DictConfig) -> tuple[int, int]:
    """(``cluster.prefill_replicas``, ``cluster.decode_replicas``) of a PD cluster, each at least 1."""
    return tuple(check_int(cfg.cluster.get(k), f"cluster.{k}", 1, whole_float=True)  # type: ignore[return-value]
                 for k in ("prefill_replicas", "decode_replicas"))


def num_replicas(cfg: DictConfig) -> int:
    """``replicas``; with ``cluster=pd``, prefill + decode replicas (``replicas`` must then stay 1 or equal that)."""
    n = check_int(cfg.replicas, "replicas", 1, whole_float=True)
    if cluster_kind(cfg) != "pd":
        return n
    total = sum(prefill_decode(cfg))
    if n not in (1, total):
        raise ValueError(f"replicas={n} with cluster=pd: the cluster has cluster.prefill_replicas + "
                         f"cluster.decode_replicas = {total} replicas; leave replicas at 1")
    return total


def link(cfg: DictConfig):
    """The simulator's KV link (``core.disagg.Link``): ``cluster.link``, a preset of ``hardware.links``, with
    ``cluster.link_bandwidth_bytes_s`` / ``cluster.link_latency_s`` overriding its values (or alone, link null)."""
    from core.disagg import Link

    c = cfg.cluster
    name, bw, latency = c.get("link"), c.get("link_bandwidth_bytes_s"), c.get("link_latency_s")
    if name is not None:
        presets = OmegaConf.to_container(cfg.hardware.get("links") or OmegaConf.create({}), resolve=True)
        if name not in presets:
            raise ValueError(f"cluster.link={name!r}: not a link preset of hardware={cfg.hardware.name}; allowed: "
                             f"{sorted(presets)}, or null with cluster.link_bandwidth_bytes_s")
        preset = presets[name]
        bw = preset.get("bandwidth_bytes_s") if bw is None else bw
        latency = preset.get("latency_s", 0.0) if latency is None else latency
    if bw is None:
        raise ValueError("cluster.link_bandwidth_bytes_s is required when cluster.link is null")
    return Link(check_float(bw, "cluster.link_bandwidth_bytes_s", strict=True),
                check_float(latency or 0.0, "cluster.link_latency_s"))


def kv_transport(cfg: DictConfig, executors: list[Executor]):
    """How a PD cluster moves KV: priced over ``link(cfg)`` (sim), or copied between the engine's KV tensors and
    timed on the ``engine_clock`` stopwatch (engine)."""
    if cfg.backend.name == "engine":
        from engine.executor import STOPWATCHES
        from engine.transfer import TorchKVTransport

        return TorchKVTransport([ex.runner for ex in executors], STOPWATCHES[engine_clock(cfg)])
    from sim.transfer import LinkTransport

    per_token = arithmetic.kv_bytes_per_token(stored_spec(cfg, model_spec(cfg)), kv_bits(cfg))
    return LinkTransport(link(cfg), per_token)


def frontend_delay(cfg: DictConfig) -> float:
    """``frontend_delay_s``; null: a calibrated simulator's recorded value (a server's per-request time outside its
    steps), else 0 (our in-process engine has no front end)."""
    delay = cfg.get("frontend_delay_s")
    if delay is None:
        if cfg.backend.name != "sim" or cfg.cost_model.get("_target_") != "sim.calibration.load_calibration":
            return 0.0
        from sim.calibration import calibrated_frontend_delay

        return calibrated_frontend_delay(cfg.cost_model.path)
    return check_float(delay, "frontend_delay_s")


def step_noise(cfg: DictConfig) -> dict[str, Any] | None:
    """``backend.step_noise``: the step-time noise section a calibration file records (``sim.noise``); None without
    one, or when it is off."""
    if not check_bool(cfg.backend.get("step_noise", False), "backend.step_noise") \
            or cfg.cost_model.get("_target_") != "sim.calibration.load_calibration":
        return None
    from sim.calibration import calibrated_step_noise
    from sim.noise import StepNoise

    record = calibrated_step_noise(cfg.cost_model.path)
    if record is not None:
        try:
            StepNoise.from_mapping(record)
        except ValueError as e:
            raise ValueError(f"cost_model.path={cfg.cost_model.path!r}: {e} (or set backend.step_noise=false)") from e
    return record


def progress_bar(setting: Any) -> bool:
    """``output.progress``: auto (when stderr is a terminal) | true | false."""
    if setting == "auto":
        import sys

        return sys.stderr.isatty()
    return check_choice(setting, "output.progress", PROGRESS_SETTINGS)


def metrics_options(cfg: DictConfig, spec: ModelSpec) -> dict[str, Any]:
    """summarize() keyword arguments from the ``metrics`` and ``slo`` sections. The prefix work formula's
    coefficients default to the model's FLOPs (per token, per attention pair)."""
    from core.metrics import PERCENTILE_METHODS, prefix_cost_coeffs

    m = cfg.metrics
    method = check_choice(m.percentile_method, "metrics.percentile_method", PERCENTILE_METHODS)
    return dict(slo=OmegaConf.to_container(cfg.slo, resolve=True), percentile_method=method,
                prefix_cost=_prefix_cost(m.prefix_cost) if m.prefix_cost is not None else prefix_cost_coeffs(spec),
                prompt_len_edges=_prompt_len_edges(m.prompt_len_edges))


def _prefix_cost(value: Any) -> tuple[float, float]:
    """``metrics.prefix_cost``: [a, b], two finite numbers >= 0."""
    if not (OmegaConf.is_list(value) or isinstance(value, list | tuple)) or len(value) != 2:
        raise ValueError(f"metrics.prefix_cost={_shown(value)!r}; allowed: [a, b], two numbers >= 0, or null "
                         "(the model's FLOPs)")
    return tuple(check_float(v, f"metrics.prefix_cost[{i}]") for i, v in enumerate(value))  # type: ignore[return-value]


def _prompt_len_edges(value: Any) -> list[int]:
    """``metrics.prompt_len_edges``: increasing positive integers (may be empty)."""
    shown = _shown(value)
    ok = OmegaConf.is_list(value) or isinstance(value, list | tuple)
    edges = [check_int(v, f"metrics.prompt_len_edges[{i}]", 1, whole_float=True) for i, v in enumerate(value)] \
        if ok else []
    if not ok or any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"metrics.prompt_len_edges={shown!r}; allowed: a list of increasing positive integers")
    return edges


def _shown(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
