"""Wiring: turn a composed Hydra config into replicas, executors, a router and a workload: a ``ServingLoop``.

Plugins are instantiated once per run (one scheduler and eviction policy per replica), never per step. This is
the one place that knows both backends: sim/ and engine/ never import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from core import arithmetic
from core.interfaces import Executor
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.specs import HardwareSpec, ModelSpec

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
BACKENDS = ("sim", "engine")
ENGINE_CLOCKS = ("auto", "wall", "thread")
LIMIT_KEYS = ("max_num_batched_tokens", "max_num_seqs")


def model_spec(cfg: DictConfig) -> ModelSpec:
    """The model group, or the config.json of ``model.path`` when a checkpoint directory is given."""
    m = OmegaConf.to_container(cfg.model, resolve=True)
    if m.get("path"):
        spec = ModelSpec.from_pretrained(m["path"])
        return ModelSpec.from_mapping({**spec.to_dict(), "dtype": m.get("dtype") or spec.dtype})
    return ModelSpec.from_mapping(m)


def hardware_spec(cfg: DictConfig) -> HardwareSpec:
    return HardwareSpec.from_mapping(OmegaConf.to_container(cfg.hardware, resolve=True))


def kv_bits(cfg: DictConfig) -> int:
    """KV element width both backends assume: 8 with an int8 KV cache (plus its float32 scales, which
    ``core.arithmetic`` counts), else 16 (the model dtype's width)."""
    if cfg.backend.name == "engine":
        kv_dtype = cfg.backend.get("kv_dtype") or "auto"
        if kv_dtype not in arithmetic.KV_DTYPE_BITS:
            raise ValueError(f"backend.kv_dtype={kv_dtype!r}; allowed: {list(arithmetic.KV_DTYPE_BITS)}")
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
    if _int(kv, "block_size", "kv") < 1:
        raise ValueError(f"kv.block_size must be >= 1, got {kv.block_size}")
    if kv.num_blocks is not None:
        return _int(kv, "num_blocks", "kv")
    dtype = cfg.backend.get("dtype") if cfg.backend.name == "engine" else None
    if dtype and dtype != spec.dtype:  # the engine allocates KV (and keeps weights) in backend.dtype
        if dtype not in arithmetic.DTYPE_BYTES:
            raise ValueError(f"backend.dtype={dtype!r}; allowed: {list(arithmetic.DTYPE_BYTES)}")
        spec = ModelSpec.from_mapping({**spec.to_dict(), "dtype": dtype})
    per_block = arithmetic.kv_bytes_per_block(spec, kv.block_size, kv_bits(cfg))
    budget = kv.memory_bytes
    if budget is None:
        weights = arithmetic.weight_bytes(spec, *weight_format(cfg))
        budget = hw.mem_bytes * kv.memory_fraction - weights
        if budget <= 0:
            raise ValueError(f"model {spec.name} ({weights / 1e9:.1f} GB of weights) does not "
                             f"fit hardware.mem_bytes x kv.memory_fraction; set kv.num_blocks or kv.memory_bytes")
    blocks = arithmetic.num_blocks_for_memory(spec, kv.block_size, budget, kv_bits(cfg))
    if blocks < 1:
        raise ValueError(f"kv.memory_bytes={budget:.3g} holds no block of {per_block:.3g} bytes")
    return blocks


def _without(node: DictConfig, keys) -> DictConfig:
    d = OmegaConf.to_container(node, resolve=True)
    for k in keys:
        d.pop(k, None)
    return OmegaConf.create(d)


def instantiate_group(node: DictConfig, group: str, **kwargs) -> Any:
    """Hydra's instantiate for one config group, failing with the key to fix."""
    if "_target_" not in node:
        raise ValueError(f"{group} config has no _target_; choose one of conf/{group}/*.yaml or set {group}._target_")
    try:
        return instantiate(node, **kwargs)
    except Exception as e:  # Hydra wraps import errors; restate with the key to fix
        raise ValueError(f"cannot instantiate {group}._target_={node._target_!r}: {e}") from e


def build_replicas(cfg: DictConfig, spec: ModelSpec, num_blocks: int) -> list[Replica]:
    sched = cfg.scheduler
    missing = [k for k in LIMIT_KEYS if k not in sched]
    if missing:
        raise ValueError(f"scheduler config lacks {missing}")
    # Sim-vs-engine comparisons generate exactly each request's output length; an engine run may stop at EOS.
    stop_at_eos = cfg.backend.name == "engine" and not cfg.backend.get("ignore_eos", True)
    timeout = cfg.request_timeout_s
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise ValueError(f"request_timeout_s must be a number of seconds or null, got {timeout!r}")
    limits = SchedulerLimits(max_num_batched_tokens=_int(sched, "max_num_batched_tokens", "scheduler"),
                             max_num_seqs=_int(sched, "max_num_seqs", "scheduler"), max_model_len=spec.max_model_len,
                             request_timeout_s=timeout, vocab_size=spec.vocab_size,
                             eos_token_ids=frozenset(spec.eos_token_ids), ignore_eos=not stop_at_eos)
    n = _int(cfg, "replicas")
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    if not isinstance(cfg.kv.prefix_caching, bool):
        raise ValueError(f"kv.prefix_caching must be true or false, got {cfg.kv.prefix_caching!r}")
    sched_node, block_size = _without(sched, LIMIT_KEYS), _int(cfg.kv, "block_size", "kv")
    return [Replica(i, instantiate_group(sched_node, "scheduler"),
                    KVCacheManager(num_blocks, block_size, instantiate_group(cfg.eviction, "eviction"),
                                   cfg.kv.prefix_caching), limits)
            for i in range(n)]


def _int(node: DictConfig, key: str, section: str = "") -> int:
    """An integer config value; 1.5 or "abc" fail naming the key instead of being truncated or crashing later."""
    v = node[key]
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        raise ValueError(f"{section + '.' if section else ''}{key} must be an integer, got {v!r}")
    return int(v)


def engine_clock(cfg: DictConfig) -> str:
    """The stopwatch of engine steps (``engine.executor.STOPWATCHES``): ``engine_clock`` wall | thread, or auto
    (thread for the CPU engine on one torch thread, else wall). thread needs that CPU setting."""
    clock = cfg.get("engine_clock", "auto") or "auto"
    if clock not in ENGINE_CLOCKS:
        raise ValueError(f"engine_clock={clock!r}; allowed: {list(ENGINE_CLOCKS)}")
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

        cost = instantiate_group(cfg.cost_model, "cost_model")
        return [CostModelExecutor(cost) for _ in replicas]
    if name == "engine":
        from engine.executor import build_engine_executors

        backend = OmegaConf.to_container(cfg.backend, resolve=True)
        return build_engine_executors(spec, backend, [r.kv for r in replicas], seed=int(cfg.seed),
                                      clock=engine_clock(cfg))
    raise ValueError(f"backend.name={name!r}; allowed: {list(BACKENDS)}")


def replicas_for(cfg: DictConfig) -> list[Replica]:
    """The run's replicas, with the KV pool sized by ``num_kv_blocks``."""
    spec = model_spec(cfg)
    return build_replicas(cfg, spec, num_kv_blocks(cfg, spec, hardware_spec(cfg)))


MakeExecutors = Callable[[list[Replica]], list[Executor]]


def build_loop(cfg: DictConfig, make_executors: MakeExecutors | None = None,
               replicas: list[Replica] | None = None) -> ServingLoop:
    """The serving loop for ``cfg``: its replicas, router and workload, with executors from the backend (or from
    ``make_executors(replicas)``, e.g. a replay of recorded step times)."""
    from core.workload import build_workload

    if replicas is None:
        replicas = replicas_for(cfg)
    executors = make_executors(replicas) if make_executors else build_executors(cfg, model_spec(cfg), replicas)
    return ServingLoop(replicas, executors, instantiate_group(cfg.router, "router"), build_workload(cfg.workload))


def progress_bar(setting: Any) -> bool:
    """``output.progress``: auto (when stderr is a terminal) | true | false."""
    if setting == "auto":
        import sys

        return sys.stderr.isatty()
    return bool(setting)


def metrics_options(cfg: DictConfig, spec: ModelSpec) -> dict[str, Any]:
    """summarize() keyword arguments from the ``metrics`` and ``slo`` sections. The prefix work formula's
    coefficients default to the model's FLOPs (per token, per attention pair)."""
    from core.metrics import prefix_cost_coeffs

    m = cfg.metrics
    cost = tuple(m.prefix_cost) if m.prefix_cost is not None else prefix_cost_coeffs(spec)
    return dict(slo=OmegaConf.to_container(cfg.slo, resolve=True), percentile_method=m.percentile_method,
                prefix_cost=cost, prompt_len_edges=list(m.prompt_len_edges))
