"""Wiring: a parsed run (``experiments.config.RunConfig``) into replicas, executors, a router and a workload: a
``ServingLoop``.

Plugins are instantiated once per run (one scheduler and eviction policy per replica), never per step. This is
the one place that knows both backends: sim/ and engine/ never import each other.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from core.interfaces import Executor, Workload
from core.kv_cache import KVCacheManager
from core.links import Link
from core.loop import ServingLoop
from core.metrics import ITLPool, prefix_cost_coeffs
from core.replica import Replica
from experiments.config import (
    CONF_DIR,
    LIMIT_KEYS,
    REPO_ROOT,
    MetricsConfig,
    RunConfig,
    conf_option,
    plain,
    shared_data,
)
from experiments.targets import check_targets

__all__ = ["CONF_DIR", "REPO_ROOT", "MakeExecutors", "build_loop", "build_replicas", "build_executors",
           "build_workload", "instantiate_group", "summary_options"]

MakeExecutors = Callable[[list[Replica]], list[Executor]]
CALIBRATED = "sim.cost.calibrated.load_calibration"  # the _target_ of cost_model=calibrated


# ---- plugins ---------------------------------------------------------------------------------------------------------
def instantiate_group(node: DictConfig, group: str, **objects: Any) -> Any:
    """Hydra's instantiate for one config group, failing with the key to fix. ``objects``: parsed values the target
    receives as they are (the run's ModelSpec, say) for keys the node has, instead of the node's config values."""
    if "_target_" not in node:
        raise ValueError(f"{group} config has no _target_; choose one of conf/{group}/*.yaml or set {group}._target_")
    check_targets(OmegaConf.to_container(node, resolve=False), group)  # before Hydra calls anything
    given = {k: v for k, v in objects.items() if k in node}
    try:
        if not given:
            return instantiate(node)
        rest = OmegaConf.create({k: v for k, v in plain(node).items() if k not in given})
        return instantiate(rest, _partial_=True)(**given)
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


# ---- replicas --------------------------------------------------------------------------------------------------------
def build_replicas(run: RunConfig) -> list[Replica]:
    """The run's replicas, each with its own scheduler, eviction policy, KV pool (``run.num_kv_blocks``), host tier,
    speculation and preemption policies; refused first if their memory cannot fit this machine."""
    check_memory(run)
    cfg, spec = run.config, run.speculation
    sched = OmegaConf.create({k: v for k, v in plain(cfg.scheduler).items() if k not in LIMIT_KEYS})
    par = run.parallel
    blocks = run.num_kv_blocks // par.pp  # pipeline virtual engines split the pool (sim.pipeline)
    if blocks < 1:
        raise ValueError(f"parallel.pp={par.pp}: the pool of {run.num_kv_blocks} KV blocks leaves none per virtual "
                         "engine; raise kv.num_blocks")
    return [Replica(i, instantiate_group(sched, "scheduler"),
                    KVCacheManager(blocks, run.kv.block_size, instantiate_group(cfg.eviction, "eviction"),
                                   run.kv.prefix_caching, host_tier(run), run.kv.prefix_cache_mode), run.limits,
                    speculation=instantiate_group(spec.policy, "speculation") if spec.method else None,
                    preemption=preemption_policy(run), stamp_receipt=run.metrics.latency_from == "receipt")
            for i in range(run.cluster.num_replicas * par.dp * par.pp)]


def check_memory(run: RunConfig, available: int | None = None) -> None:
    """Refuse, before anything is built, a config whose memory cannot fit this machine, naming the key: every
    replica's KV bookkeeping once all its blocks have been used (``core.resources``) plus, for the engine, the
    weights and each replica's KV tensors (against the GPU's free memory when ``backend.device`` is cuda).
    ``available``: free host bytes (default: read from the OS; no check when it cannot be read)."""
    from core.resources import REPLICA_BYTES, available_memory_bytes, block_bookkeeping_bytes, gb

    kv, n, blocks = run.kv, run.cluster.num_replicas * run.parallel.dp, run.num_kv_blocks  # a pool per dp rank
    if kv.num_blocks is not None:
        key, shown = "kv.num_blocks", kv.num_blocks
    elif kv.memory_bytes is not None:
        key, shown = "kv.memory_bytes", kv.memory_bytes
    else:
        key, shown = "kv.memory_fraction", f"{kv.memory_fraction} ({blocks} blocks)"
    engine = run.engine
    tensor = run.kv_bytes_per_block if engine is not None else 0.0  # the engine's KV (and host tier) tensors
    bookkeeping = float(block_bookkeeping_bytes())
    # (where, bytes per block, bytes per replica besides its blocks, bytes once, bytes free)
    checks = [["host memory", bookkeeping, REPLICA_BYTES + run.num_host_blocks * (bookkeeping + tensor), 0.0,
               available_memory_bytes() if available is None else available]]
    if engine is not None and engine.device.startswith("cuda"):
        checks.append(["GPU memory", tensor, 0.0, run.weight_bytes, _gpu_free(engine.device)])
    elif engine is not None:
        checks[0][1] += tensor
        checks[0][3] = run.weight_bytes
    for where, per_block, per_replica, once, free in checks:
        need = n * (blocks * per_block + per_replica) + once
        if free is None or need <= free:
            continue
        fit = max(0, int(((free - once) / n - per_replica) // per_block))
        raise ValueError(f"{key}={shown} with replicas={n} needs ~{gb(need)} of {where} "
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


def host_tier(run: RunConfig) -> Any:
    """One replica's host KV tier (None when off), with its own eviction policy (``kv.host_eviction``, a
    conf/eviction option, default lru) for spilled prefix blocks."""
    if not run.num_host_blocks:
        return None
    from core.host_tier import HostTier

    eviction = instantiate_group(OmegaConf.create(conf_option("eviction", run.kv.host_eviction, "kv.host_eviction")),
                                 "eviction")
    return HostTier(run.num_host_blocks, run.kv.block_size, eviction, run.kv.host_spill)


def preemption_policy(run: RunConfig) -> Any:
    """The ``preemption`` group's policy (None when the config has no such group: recompute). Null arguments the
    target takes are filled in from the model and hardware: ``kv_bytes_per_token``, ``host_link_bw``,
    ``host_link_latency_s``, ``prefill_tokens_per_s`` (a roofline estimate at 50% MFU)."""
    from core import arithmetic

    node = run.config.get("preemption")
    if node is None:
        return None
    if not run.num_host_blocks and node.get("_target_") != "policies.preemption.recompute.RecomputePreemption":
        raise ValueError(f"preemption._target_={node.get('_target_')!r} swaps to a host KV tier, which is off: "
                         "set kv.host_blocks (or kv.host_memory_bytes) > 0, or preemption=recompute")
    hw = run.hardware
    known = {"kv_bytes_per_token": lambda: run.kv_bytes_per_token,
             "host_link_bw": lambda: host_link(run).bandwidth_bytes_s,
             "host_link_latency_s": lambda: hw.host_link_latency_s,
             "prefill_tokens_per_s": lambda: 0.5 * hw.peak_flops / arithmetic.linear_flops_per_token(run.model)}
    filled = {k: make() for k, make in known.items() if k in node and node[k] is None}
    return instantiate_group(node, "preemption", **filled)


def host_link(run: RunConfig) -> Link:
    """The device <-> host link the simulator prices host-tier copies on (``hardware.host_link_*``)."""
    hw = run.hardware
    if hw.host_link_bw <= 0:
        raise ValueError(f"hardware.host_link_bw is not set for {hw.name}: the host KV tier needs the device-host "
                         "link bandwidth (bytes/s per direction)")
    return Link(hw.host_link_bw, hw.host_link_latency_s)


# ---- executors -------------------------------------------------------------------------------------------------------
def build_executors(run: RunConfig, replicas: list[Replica]) -> list[Executor]:
    """One executor per replica: a cost model's (sim) or a model's, timed on ``run.engine_clock`` (engine)."""
    return _sim_executors(run, replicas) if run.sim is not None else _engine_executors(run, replicas)


def sim_cost_model(run: RunConfig, **changes: Any) -> Any:
    """The run's cost model, its data folders filled in from shared/data where the config leaves them null (the
    published profiles, the measured NCCL tables); ``changes``: keys of the cost_model group to override."""
    node = run.config.cost_model
    data = {"data_dir": str(shared_data("gpu-measurements", "llmservingsim"))} \
        if "data_dir" in node and node.data_dir is None and not node.get("profile") else {}
    if "network_dir" in node and node.network_dir is None and run.hardware.network_profile:
        data["network_dir"] = str(shared_data("gpu-measurements", "vidur", "network"))
    return instantiate_group(node, "cost_model", model=run.model, hardware=run.hardware, **{**data, **changes})


def _sim_executors(run: RunConfig, replicas: list[Replica]) -> list[Executor]:
    from sim.executor import CostModelExecutor
    from sim.noise import StepNoise

    cost = sim_cost_model(run)
    if run.parallel.pp > 1 or run.parallel.dp > 1:
        return parallel_executors(run, cost, replicas)
    noise = step_noise(run)  # seeded per replica: replicas are machines of their own
    host = host_link(run) if run.num_host_blocks else None
    return [CostModelExecutor(cost, speculation=sim_speculation(run, r.index), host_link=host,
                              host_block_bytes=run.kv_bytes_per_block,
                              noise=None if noise is None else StepNoise.from_mapping(noise, [run.sim.noise_seed,
                                                                                              r.index]))
            for r in replicas]


def parallel_executors(run: RunConfig, cost: Any, replicas: list[Replica]) -> list[Executor]:
    """Pipeline stages (pp > 1: one ``sim.pipeline.Pipeline`` per replica, shared by its pp virtual engines) or
    lockstep dp ranks (dp > 1: ``lockstep_groups``); what they do not model is refused."""
    from sim.cost.base import StagedCostModel
    from sim.executor import CostModelExecutor
    from sim.pipeline import Pipeline, PipelineExecutor

    par = run.parallel
    unsupported = {"parallel.pp > 1 with parallel.dp > 1": par.pp > 1 and par.dp > 1,
                   "cluster=pd": run.cluster.kind == "pd", "kv.host_blocks": bool(run.num_host_blocks),
                   "spec": bool(run.speculation.method),
                   f"cost_model {type(cost).__name__}": not isinstance(cost, StagedCostModel),
                   "backend.step_noise with a calibration": step_noise(run) is not None}
    refused = [k for k, v in unsupported.items() if v]
    if refused:
        raise ValueError(f"parallel={par}: not simulated with {refused[0]} (pipeline and data-parallel replicas "
                         "run on cost_model=roofline or profiled, colocated, without host tier, speculation or step "
                         "noise)")
    if par.dp > 1:
        return [CostModelExecutor(cost) for _ in replicas]
    pipelines = [Pipeline(par.pp) for _ in range(run.cluster.num_replicas)]
    return [PipelineExecutor(cost, pipelines[r.index // par.pp]) for r in replicas]


def lockstep_groups(run: RunConfig, executors: list[Executor]) -> list[tuple[list[int], Any]]:
    """The dp ranks of each replica as a ``core.loop`` replica group, priced together (``sim.pipeline``)."""
    dp = run.parallel.dp
    if dp == 1 or run.sim is None:
        return []
    from sim.pipeline import LockstepExecutor

    return [(list(range(r * dp, (r + 1) * dp)), LockstepExecutor(executors[r * dp].cost_model))
            for r in range(run.cluster.num_replicas)]


def sim_speculation(run: RunConfig, replica: int) -> Any:
    """The simulator's acceptance model and draft cost for one replica (None without speculative decoding)."""
    spec = run.speculation
    if not spec.method:
        return None
    from sim.cost.roofline import RooflineCostModel
    from sim.speculative import SpeculativeModel

    draft = RooflineCostModel(spec.draft_model, run.hardware) \
        if spec.method == "draft" and spec.draft_cost == "roofline" else None
    return SpeculativeModel(spec.acceptance_rate, seed=(run.seed, replica), draft_cost=draft)


def _engine_executors(run: RunConfig, replicas: list[Replica]) -> list[Executor]:
    from engine.executor import build_draft_proposer, build_engine_executors

    options, spec = run.engine, run.speculation
    if run.parallel.tp > 1 and run.cluster.num_prefill:
        raise ValueError(f"parallel.tp={run.parallel.tp} with cluster=pd: the engine moves KV between replicas on "
                         "one device (rank 0 holds only its shard of the KV heads)")
    executors = build_engine_executors(run.model, options, run.quant, [r.kv for r in replicas], seed=run.seed,
                                       clock=run.engine_clock, tp=run.parallel.tp, ep=run.parallel.ep)
    if spec.method == "ngram":
        from engine.speculative import NgramProposer

        for ex in executors:
            ex.proposer = NgramProposer(*spec.ngram)
    elif spec.method == "draft":
        model = None
        for ex in executors:  # one draft model, a KV pool per replica (as large as the target's)
            ex.proposer = build_draft_proposer(spec.draft_model, ex.runner, ex.kv_manager.num_blocks,
                                               dtype=options.torch_dtype, seed=run.seed, model=model)
            model = ex.proposer.runner.model
    return executors


def step_noise(run: RunConfig) -> dict[str, Any] | None:
    """``backend.step_noise``: the step-time noise section a calibration file records (``sim.noise``); None without
    one, or when it is off."""
    node = run.config.cost_model
    if not run.sim.step_noise or node.get("_target_") != CALIBRATED:
        return None
    from sim.cost.calibrated import calibrated_step_noise
    from sim.noise import StepNoise

    record = calibrated_step_noise(node.path)
    if record is not None:
        try:
            StepNoise.from_mapping(record)
        except ValueError as e:
            raise ValueError(f"cost_model.path={node.path!r}: {e} (or set backend.step_noise=false)") from e
    return record


# ---- the loop --------------------------------------------------------------------------------------------------------
def build_loop(run: RunConfig, make_executors: MakeExecutors | None = None, replicas: list[Replica] | None = None,
               workload: Workload | None = None) -> ServingLoop:
    """The serving loop of ``run``: its replicas, router and workload (or ``workload``: the server's requests come
    from HTTP), with executors from the backend (or from ``make_executors(replicas)``, e.g. a replay of recorded step
    times); a ``PDServingLoop`` for ``cluster=pd``."""
    cfg = run.config
    if replicas is None:
        replicas = build_replicas(run)
    executors = make_executors(replicas) if make_executors else build_executors(run, replicas)
    args = (replicas, executors, instantiate_group(cfg.router, "router"),
            build_workload(cfg.workload) if workload is None else workload)
    options = dict(frontend_delay_s=frontend_delay(run), fast_forward=run.sim is None or run.sim.fast_forward,
                   itl_pool=ITLPool(run.metrics.prompt_len_edges) if run.output.tokens == "none" else None)
    groups = lockstep_groups(run, executors) if make_executors is None else []
    if run.cluster.kind == "pd":
        from core.disagg import PDServingLoop

        if make_executors is not None:
            raise ValueError("cluster=pd runs on its backend's own executors (a replay of recorded steps does not "
                             "replay transfers); use cluster=colocated")
        return PDServingLoop(*args, num_prefill=run.cluster.num_prefill,
                             placement=instantiate_group(cfg.placement, "placement"),
                             transport=kv_transport(run, executors), **options)
    loop = ServingLoop(*args, **options, groups=groups)
    for ex in executors:  # pipeline stages keep the loop's time (sim.pipeline)
        if hasattr(ex, "pipeline"):
            ex.pipeline.now = lambda: loop.clock.now
    return loop


def kv_transport(run: RunConfig, executors: list[Executor]) -> Any:
    """How a PD cluster moves KV: priced over ``run.cluster.link`` (sim), or copied between the engine's KV tensors
    and timed on the engine's stopwatch (engine)."""
    if run.engine is not None:
        from engine.executor import STOPWATCHES
        from engine.transfer import TorchKVTransport

        return TorchKVTransport([ex.runner for ex in executors], STOPWATCHES[run.engine_clock])
    from sim.transfer import LinkTransport

    return LinkTransport(run.cluster.link, run.kv_bytes_per_token)


def frontend_delay(run: RunConfig) -> float:
    """``frontend_delay_s``; null: a calibrated simulator's recorded value (a server's per-request time outside its
    steps), else 0 (our in-process engine has no front end)."""
    if run.frontend_delay_s is not None:
        return run.frontend_delay_s
    node = run.config.cost_model
    if run.sim is None or node.get("_target_") != CALIBRATED:
        return 0.0
    from sim.cost.calibrated import calibrated_frontend_delay

    return calibrated_frontend_delay(node.path)


# ---- metrics ---------------------------------------------------------------------------------------------------------
def summary_options(metrics: MetricsConfig, slo: Any, model: Any) -> dict[str, Any]:
    """``core.metrics.summarize`` keyword arguments: the ``metrics`` section, the ``slo`` section; the prefix work
    formula's coefficients default to the model's FLOPs (per token, per attention pair)."""
    return dict(slo=plain(slo), percentile_method=metrics.percentile_method,
                prefix_cost=tuple(metrics.prefix_cost) if metrics.prefix_cost is not None
                else prefix_cost_coeffs(model),
                prompt_len_edges=list(metrics.prompt_len_edges))


def run_summary_options(run: RunConfig) -> dict[str, Any]:
    """``summary_options`` of a run."""
    return summary_options(run.metrics, run.config.slo, run.model)
