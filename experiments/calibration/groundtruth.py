"""A real vLLM run recorded by LLMServingSim's bench (``shared/data/gpu-groundtruth/llmservingsim/<GPU>/<model>/``) as
the measured side of ``experiments.compare``: ``python -m experiments.compare compare.measured=<that folder>``
simulates the run's own requests under the run's own engine settings and prints the error table beside the peer's
(LLMServingSim's own prediction of the same run, ``validation_summary.txt``).

The folder (see ``shared/data/SOURCES.md``): ``vllm_requests.jsonl`` (per request ``input_toks``, ``output_toks``,
``arrival_time``: wall clock when the client sent it; ``queued_ts``, ``scheduled_ts``, ``first_token_ts``,
``last_token_ts``: the engine core's monotonic clock), ``vllm_meta.json`` (``engine_kwargs``, the dataset's path and
sha256, and in newer recordings ``kv_cache`` / ``hardware``), ``vllm_timeseries.csv`` (running / waiting requests
each second), ``config.json`` (LLMServingSim's cluster config: hardware name, TP), ``validation_summary.txt``. A
folder of LLMServingSim's own checkout (``bench/examples/<GPU>/<model>``: ``vllm/meta.json``, ``vllm/requests.jsonl``,
``vllm/timeseries.csv``, ``config.json``, ``validation/summary.txt``; the dataset under ``workloads/`` at the top)
reads the same.

Definitions, as LLMServingSim's bench validates them (``bench/core/validate.py``) and vLLM's ``bench serve`` reports:
TTFT = first_token_ts - queued_ts, TPOT = (last_token_ts - first_token_ts) / (output_toks - 1), E2E = last_token_ts -
queued_ts, all on the engine core's clock. ``queued_ts`` is the engine's receipt, which its loop stamps between steps:
a request that reaches the engine while a step runs is stamped when that step ends (0-107 ms after ``arrival_time``,
median 15 ms, in the RTX PRO 6000 run; up to 370 ms in the Qwen3-32B run, whose steps are long), so the recorded
TTFT leaves out the wait for the step in flight. The simulation is therefore fed the client's arrivals,
``arrival_time`` (a wall-clock epoch) moved onto the engine's clock by the run's smallest ``queued_ts -
arrival_time`` (the request that found the loop waiting: the clock offset plus the API server's own minimum), and
measures from its own receipt (``metrics.latency_from=receipt``: the first scheduling pass at or after arrival), so
TTFT means the same on both sides. Without ``arrival_time`` the arrivals are the ``queued_ts`` themselves. Only first
and last token times are recorded: the measured run's intermediate token times are spread evenly between them, so
ITL is not compared.

Engine settings of the simulation (``settings``): model and hardware from the run's model id and ``config.json``
(``conf/model`` / ``conf/hardware`` options matched by name; a model without an option: its config.json published
beside the recordings, ``model_option``), ``tp`` from engine_kwargs (the cost model's too),
``max_num_seqs`` / ``max_num_batched_tokens`` / ``max_model_len`` from engine_kwargs, block size 16 and prefix
caching on (vLLM v1's defaults; ``kv_cache`` when recorded), the KV pool as recorded (``kv_cache.num_gpu_blocks``) or
derived as vLLM sizes it (``derived_kv_blocks``), the scheduler and cost model of ``compare.groundtruth``
(``vllm_v1`` and ``profiled`` by default; with vllm_v1 also ``kv.prefix_cache_mode=vllm``, the recorded
``long_prefill_token_threshold`` / ``enable_chunked_prefill`` and ``async_scheduling`` (``scheduler_config``; vLLM's
default by version otherwise)), with ``profiled`` the CUDA-graph ceiling (``enforce_eager``: none; the recorded
``max_cudagraph_capture_size``; else vLLM's default from the scheduler limits), percentiles interpolated linearly
(numpy's, the bench's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core import arithmetic as ar
from core.request import Request, RequestState, Status
from core.specs import ModelSpec
from experiments.config import CONF_DIR, RunConfig, conf_option

log = logging.getLogger(__name__)

REQUESTS, META, TIMESERIES, CLUSTER, PEER = ("vllm_requests.jsonl", "vllm_meta.json", "vllm_timeseries.csv",
                                             "config.json", "validation_summary.txt")
# The same files as LLMServingSim's own tree keeps them (bench/examples/<GPU>/<model>/), its datasets in workloads/
# at the top of that checkout
BENCH_LAYOUT = {REQUESTS: "vllm/requests.jsonl", META: "vllm/meta.json", TIMESERIES: "vllm/timeseries.csv",
                CLUSTER: "config.json", PEER: "validation/summary.txt"}
# vLLM 0.19's memory outside weights and KV (activation peak of its profiling run, CUDA graphs, non-torch) in the one
# recording that states its block count, LLMServingSim's RTX 4090 Llama-3.1-8B run (bench/examples/RTX4090/
# Llama-3.1-8B/vllm/meta.json @ 5daddb2: 2588 blocks of 16 tokens, 0.9 of 25,250,627,584 bytes): 0.9 x 25.25 GB -
# 16.06 GB of weights - 2588 x 2 MiB of KV = 1.24 GB. It depends on the model and max_num_batched_tokens (2048 there).
VLLM_RESERVED_BYTES = 1.24e9
VLLM_BLOCK_SIZE = 16  # vLLM v1's default KV block
METRICS = ("ttft_s", "tpot_s", "e2e_s")
STATS = ("mean", "p50", "p90", "p99")
VLLM_V1_KEYS = ("long_prefill_token_threshold", "max_num_partial_prefills", "enable_chunked_prefill",
                "async_scheduling")
PEER_NAMES = {"TTFT": "ttft_s", "TPOT": "tpot_s", "Latency": "e2e_s"}
PEER_STATS = {"Mean": "mean", "Median": "p50", "P90": "p90", "P95": "p95", "P99": "p99"}


@dataclass(frozen=True)
class MeasuredRequest:
    """One request of the run, times in seconds on the engine's clock from the first (client) arrival."""

    id: str
    arrival_s: float  # the client's arrival_time on the engine's clock (read_groundtruth), else queued_ts
    received_s: float  # queued_ts: the engine loop took it in
    scheduled_s: float
    first_token_s: float
    last_token_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class GroundTruth:
    directory: Path
    requests: list[MeasuredRequest]
    meta: dict[str, Any]
    cluster: dict[str, Any]
    workload: Path  # the request list with prompt token ids the run replayed

    def file(self, name: str) -> Path:
        """One of the recording's files (``REQUESTS``, ``META``, ...) in whichever layout the folder has."""
        return file_of(self.directory, name)

    @property
    def engine(self) -> dict[str, Any]:
        return self.meta.get("engine_kwargs") or {}

    @property
    def instance(self) -> dict[str, Any]:
        """The one serving instance of config.json (LLMServingSim's cluster config; {} without one)."""
        nodes = self.cluster.get("nodes") or [{}]
        return (nodes[0].get("instances") or [{}])[0]


def file_of(directory: Path, name: str) -> Path:
    """``directory / name`` (the flat layout of shared/data), else its place in LLMServingSim's bench layout."""
    flat = directory / name
    return flat if flat.is_file() or not (directory / BENCH_LAYOUT[META]).is_file() else directory / BENCH_LAYOUT[name]


def is_groundtruth(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and file_of(p, REQUESTS).is_file() and file_of(p, META).is_file()


def _find_workload(directory: Path, meta: Mapping[str, Any]) -> Path:
    """The dataset the run replayed (``vllm_meta.json`` dataset_path), by file name in the folder or the ones above
    it, or at its recorded relative path from one of those (LLMServingSim's checkout: ``workloads/...``), checked
    against the recorded sha256."""
    recorded = Path(str(meta.get("dataset_path") or ""))
    where = file_of(directory, META)
    if not recorded.name:
        raise ValueError(f"{where}: no dataset_path")
    for parent in (directory, *directory.parents[:4]):
        for path in (parent / recorded.name, parent / recorded):
            if path.is_file():
                want = meta.get("dataset_hash")
                if want and hashlib.sha256(path.read_bytes()).hexdigest() != want:
                    raise ValueError(f"{path}: sha256 differs from {where} dataset_hash {want}")
                return path
    raise ValueError(f"{where}: dataset {recorded} not found in {directory} or the 4 folders above it")


def read_groundtruth(directory: str | Path) -> GroundTruth:
    """The run's requests (in file order, ``bench-<i>`` = line i of the workload), joined with the prompt token ids
    of the workload it replayed; lengths must agree."""
    d = Path(directory)
    meta = json.loads(file_of(d, META).read_text())
    cluster = json.loads(file_of(d, CLUSTER).read_text()) if file_of(d, CLUSTER).is_file() else {}
    workload = _find_workload(d, meta)
    prompts = [json.loads(line) for line in workload.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in file_of(d, REQUESTS).read_text().splitlines() if line.strip()]
    if len(rows) != len(prompts):
        raise ValueError(f"{file_of(d, REQUESTS)}: {len(rows)} requests, {workload} has {len(prompts)}")
    # arrival_time is another clock: moved onto the engine's by the smallest receipt delay (see the module docstring)
    clocked = all(r.get("arrival_time") is not None for r in rows)
    offset = min(float(r["queued_ts"]) - float(r["arrival_time"]) for r in rows) if clocked else 0.0
    t0 = min(float(r["arrival_time"]) + offset if clocked else float(r["queued_ts"]) for r in rows)
    out = []
    for i, (r, w) in enumerate(zip(rows, prompts, strict=True)):
        ids = tuple(int(x) for x in w["input_tok_ids"])
        if len(ids) != int(r["input_toks"]) or int(w["output_toks"]) != int(r["output_toks"]):
            raise ValueError(f"{file_of(d, REQUESTS)} line {i + 1}: {r['input_toks']} + {r['output_toks']} tokens, "
                             f"{workload} line {i + 1} has {len(ids)} + {w['output_toks']}")
        queued = float(r["queued_ts"]) - t0
        arrival = float(r["arrival_time"]) + offset - t0 if clocked else queued
        out.append(MeasuredRequest(str(r["request_id"]), arrival, queued, float(r["scheduled_ts"]) - t0,
                                   float(r["first_token_ts"]) - t0, float(r["last_token_ts"]) - t0, ids,
                                   int(r["output_toks"])))
    return GroundTruth(d, out, meta, cluster, workload)


def write_request_list(gt: GroundTruth, path: Path) -> Path:
    """The run's requests as a ``core.workload.RequestList`` JSONL: id, arrival_s, prompt_token_ids (for prefix
    caching), output_tokens."""
    with path.open("w") as f:
        for r in sorted(gt.requests, key=lambda r: r.arrival_s):
            f.write(json.dumps({"id": r.id, "arrival_s": r.arrival_s, "prompt_token_ids": list(r.prompt_token_ids),
                                "output_tokens": r.output_tokens}) + "\n")
    return path


def measured_states(gt: GroundTruth) -> list[RequestState]:
    """The run as finished RequestStates: arrival, first scheduling, first and last token as recorded, the tokens
    between spread evenly (only first and last are known)."""
    states = []
    for r in gt.requests:
        s = RequestState(Request(id=r.id, arrival_s=r.arrival_s, prompt_len=len(r.prompt_token_ids),
                                 max_new_tokens=r.output_tokens))
        s.replica, s.received_s, s.first_scheduled_s = 0, r.received_s, r.scheduled_s
        s.first_token_s, s.finish_s = r.first_token_s, r.last_token_s
        s.token_times = array("d", np.linspace(r.first_token_s, r.last_token_s, r.output_tokens).tolist())
        s.output_token_ids = [-1] * r.output_tokens
        s.status = Status.FINISHED
        states.append(s)
    return states


# ---- engine settings ----------------------------------------------------------------------------------------------
def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def option_named(group: str, name: str) -> str:
    """The ``conf/<group>`` option whose ``name`` matches ``name`` without case or punctuation, else the one that
    matches it without its trailing ``-`` parts (a release's tags: ``Qwen3-30B-A3B-Instruct-2507`` is
    ``Qwen3-30B-A3B``'s shapes), the longest such prefix first."""
    options = sorted((CONF_DIR / group).glob("*.yaml"))
    names = {_norm(str(OmegaConf.load(p).get("name", p.stem))): p.stem for p in options}
    parts = name.split("-")
    for n in range(len(parts), 0, -1):
        if _norm("-".join(parts[:n])) in names:
            return names[_norm("-".join(parts[:n]))]
    raise ValueError(f"no conf/{group} option named like {name!r} (the ground truth's); have "
                     f"{[p.stem for p in options]}: add one (its name matched without case or punctuation)")


def model_option(gt: GroundTruth, model_id: str) -> tuple[str, Path | None]:
    """The ``model`` option for the run's model id: the ``conf/model`` option named like it, else ``checkpoint``
    with the model's config.json as published beside the recordings (``None`` for a conf option): LLMServingSim's
    checkout keeps them at ``configs/model/<org>/<name>.json``, shared/data at ``model-configs/<name>.json``, in a
    folder above the run's."""
    try:
        return option_named("model", model_id.split("/")[-1]), None
    except ValueError as missing:
        name = model_id.split("/")[-1]
        for parent in gt.directory.parents[:4]:
            for path in (parent / "configs" / "model" / f"{model_id}.json", parent / "model-configs" / f"{name}.json"):
                if path.is_file():
                    return "checkpoint", path
        raise ValueError(f"{missing}; nor is there a configs/model/{model_id}.json or model-configs/{name}.json in "
                         f"the 4 folders above {gt.directory}") from None


def derived_kv_blocks(model: ModelSpec, tp: int, device_bytes: float, utilization: float = 0.9,
                      reserved_bytes: float = VLLM_RESERVED_BYTES, block_size: int = VLLM_BLOCK_SIZE,
                      moe_ranks: int = 1) -> int:
    """KV blocks per device as vLLM sizes its pool: ``utilization`` of the device's memory, minus this device's
    weights (routed experts over ``moe_ranks`` devices with expert parallelism) and what vLLM keeps outside weights
    and KV (``reserved_bytes``), in blocks of this device's KV heads."""
    weights = ar.weight_bytes_per_device(model, tp=tp, moe_ranks=moe_ranks)
    budget = utilization * device_bytes - weights - reserved_bytes
    per_block = ar.kv_bytes_per_token_per_device(model, 16, tp) * block_size
    return max(0, int(budget // per_block))


def kv_pool(gt: GroundTruth, model: ModelSpec, tp: int, hardware_bytes: float,
            reserved_bytes: float = VLLM_RESERVED_BYTES, moe_ranks: int = 1) -> tuple[int, int, str]:
    """(blocks, block size, how they were obtained): recorded in vllm_meta.json ``kv_cache``, or derived from the
    recorded device memory (``hardware.device_total_memory_bytes``), else the hardware preset's ``mem_bytes``."""
    kv = gt.meta.get("kv_cache") or {}
    block = int(kv.get("block_size") or VLLM_BLOCK_SIZE)
    if kv.get("num_gpu_blocks"):
        return int(kv["num_gpu_blocks"]), block, "recorded (vllm_meta.json kv_cache.num_gpu_blocks)"
    util = float(kv.get("gpu_memory_utilization") or gt.engine.get("gpu_memory_utilization") or 0.9)
    device = (gt.meta.get("hardware") or {}).get("device_total_memory_bytes")
    where = "recorded device memory" if device else "hardware.mem_bytes"
    blocks = derived_kv_blocks(model, tp, float(device or hardware_bytes), util, reserved_bytes, block, moe_ranks)
    weights = ar.weight_bytes_per_device(model, tp=tp, moe_ranks=moe_ranks)
    how = (f"derived: {util:g} x {float(device or hardware_bytes) / 1e9:.2f} GB ({where}) - weights "
           f"{weights / 1e9:.2f} GB - vLLM's reserve {reserved_bytes / 1e9:.2f} GB")
    return blocks, block, how


def scheduler_config(gt: GroundTruth) -> dict[str, Any]:
    """vLLM's SchedulerConfig as the run resolved it (``resolved_config.scheduler_config`` of newer recordings), with
    what engine_kwargs states on top; {} for neither."""
    resolved = (gt.meta.get("resolved_config") or {}).get("scheduler_config")
    out = dict(resolved) if isinstance(resolved, Mapping) else {}
    out.update({k: v for k, v in gt.engine.items() if k in VLLM_V1_KEYS and v is not None})
    return out


def vllm_v1_settings(gt: GroundTruth) -> list[str]:
    """``scheduler=vllm_v1``'s keys from the run's scheduler config where recorded (else vLLM 0.19's defaults,
    which are the option's: one partial prefill, no long-prefill cap, chunked prefill on; async scheduling on for
    vLLM >= 0.12), and vLLM's prefix-cache semantics (``kv.prefix_cache_mode=vllm``: blocks hashed and shared as
    vLLM's block pool does). Async scheduling shows in the recordings: an unqueued request's ``scheduled_ts`` equals
    its ``queued_ts`` (the engine core stamps both between steps), and its first step is the one after the step then
    running (diagnostics.json ``unqueued``)."""
    sc = scheduler_config(gt)
    partial = int(sc.get("max_num_partial_prefills") or 1)
    if partial != 1:
        raise ValueError(f"{gt.directory}: max_num_partial_prefills={partial} is not mirrored by scheduler=vllm_v1")
    out = ["kv.prefix_cache_mode=vllm"]
    if sc.get("long_prefill_token_threshold") is not None:
        out.append(f"scheduler.long_prefill_token_threshold={int(sc['long_prefill_token_threshold'])}")
    if sc.get("enable_chunked_prefill") is not None:
        out.append(f"scheduler.enable_chunked_prefill={str(bool(sc['enable_chunked_prefill'])).lower()}")
    async_on = sc.get("async_scheduling")
    if async_on is None:  # vLLM's default: on since 0.12 (vllm-project/vllm#27614) for the engine core it runs in
        async_on = _version(str(gt.meta.get("vllm_version") or "0")) >= (0, 12)
    out.append(f"scheduler.async_scheduling={str(bool(async_on)).lower()}")
    return out


def cuda_graph_settings(gt: GroundTruth) -> list[str]:
    """``cost_model=profiled``'s CUDA-graph ceiling as the run set it: 0 with ``enforce_eager``, the resolved
    ``compilation_config.max_cudagraph_capture_size`` when recorded, else none (the option derives vLLM's default
    from the scheduler limits)."""
    if gt.engine.get("enforce_eager"):
        return ["cost_model.cuda_graph_max_tokens=0"]
    compiled = (gt.meta.get("resolved_config") or {}).get("compilation_config") or {}
    size = compiled.get("max_cudagraph_capture_size") if isinstance(compiled, Mapping) else None
    return [] if size is None else [f"cost_model.cuda_graph_max_tokens={int(size)}"]


def _version(text: str) -> tuple[int, ...]:
    """'0.19.0' -> (0, 19, 0); digits only, whatever follows them ('0.11.1rc2' -> (0, 11, 1))."""
    parts = []
    for p in text.split(".")[:3]:
        m = re.match(r"\d+", p)
        if not m:
            break
        parts.append(int(m[0]))
    return tuple(parts)


def data_parallel(gt: GroundTruth, model: ModelSpec, tp: int) -> tuple[int, int]:
    """(dp, ep) of the run: ``data_parallel_size`` attention ranks, and with ``enable_expert_parallel`` vLLM's expert
    parallel degree tp x dp (the experts split over every device). DP ranks without experts to meet at are
    independent engines (separate replicas), not modelled here."""
    e = gt.engine
    dp = int(e.get("data_parallel_size") or 1)
    expert_parallel = bool(e.get("enable_expert_parallel"))
    if expert_parallel and model.moe is None:
        raise ValueError(f"{gt.directory}: enable_expert_parallel on {model.name}, which has no experts")
    if dp > 1 and not expert_parallel:
        raise ValueError(f"{gt.directory}: data_parallel_size={dp} without expert parallelism (independent "
                         "engines) is not modelled; simulate one replica per engine")
    return dp, (tp * dp if expert_parallel else 1)


def settings(gt: GroundTruth, cfg: DictConfig) -> tuple[list[str], dict[str, Any]]:
    """Overrides that make ``cfg`` simulate the run (see the module docstring), and what they were derived from."""
    g = cfg.compare.get("groundtruth") or {}
    e = gt.engine
    model_id = str(e.get("model") or gt.meta.get("model"))
    hardware = str(gt.instance.get("hardware") or "")
    if not hardware:
        raise ValueError(f"{gt.directory}: no {CLUSTER} naming the run's hardware")
    tp = int(e.get("tensor_parallel_size") or gt.instance.get("tp_size") or 1)
    model_opt, model_over = model_option(gt, model_id)
    hw_opt = option_named("hardware", hardware)
    model = ModelSpec.from_config(conf_option("model", model_opt)) if model_over is None else \
        ModelSpec.from_pretrained(model_over)
    dp, ep = data_parallel(gt, model, tp)
    hw_bytes = float(conf_option("hardware", hw_opt)["mem_bytes"])
    blocks, block, how = kv_pool(gt, model, tp, hw_bytes, float(g.get("kv_reserved_bytes", VLLM_RESERVED_BYTES)),
                                 moe_ranks=tp * dp if ep > 1 else 1)
    kv = gt.meta.get("kv_cache") or {}
    prefix = kv.get("enable_prefix_caching", e.get("enable_prefix_caching", True))
    scheduler = str(g.get("scheduler", "vllm_v1"))
    out = [f"model={model_opt}", *([f"model.path={model_over}"] if model_over else []), f"hardware={hw_opt}",
           f"scheduler={scheduler}",
           f"cost_model={g.get('cost_model', 'profiled')}", f"parallel.tp={tp}", f"parallel.dp={dp}",
           f"parallel.ep={ep}",
           f"scheduler.max_num_seqs={int(e['max_num_seqs'])}",
           f"scheduler.max_num_batched_tokens={int(e['max_num_batched_tokens'])}",
           f"kv.num_blocks={blocks}", f"kv.block_size={block}", f"kv.prefix_caching={str(bool(prefix)).lower()}",
           "kv.memory_bytes=null", "frontend_delay_s=0.0", "request_timeout_s=null",
           "metrics.percentile_method=linear", "metrics.latency_from=receipt", "backend=sim"]
    if dp > 1:  # vLLM's front end sends each request to the DP engine with the fewest running and waiting
        out.append("router=least_outstanding")
    if e.get("max_model_len"):
        out.append(f"model.max_model_len={int(e['max_model_len'])}")
    if scheduler == "vllm_v1":
        out += vllm_v1_settings(gt)
    if g.get("cost_model", "profiled") == "profiled":
        out += cuda_graph_settings(gt)
    out += [str(o) for o in g.get("overrides") or ()]
    return out, {"model": model.name if model_over else model_opt, "hardware": hw_opt, "tp": tp, "dp": dp,
                 "ep": ep, "kv_blocks": blocks, "kv_blocks_how": how, "kv_tokens": blocks * block,
                 "workload": str(gt.workload), "overrides": out}


# ---- the comparison -----------------------------------------------------------------------------------------------
def read_peer(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """``validation_summary.txt``: {metric: {stat: {"vllm", "sim", "rel_error"}}} in seconds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(TTFT|TPOT|Latency)\s+(Mean|Median|P\d+)\s+([\d.]+)\s+([\d.]+)\s+([-+\d.]+)%", line)
        if m:
            metric, stat = PEER_NAMES[m[1]], PEER_STATS.get(m[2], m[2].lower())
            out.setdefault(metric, {})[stat] = {"vllm": float(m[3]) / 1e3, "sim": float(m[4]) / 1e3,
                                                "rel_error": float(m[5]) / 100}
    return out


def error_rows(measured: Mapping[str, Any], sim: Mapping[str, Any],
               peer: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[dict[str, Any]]:
    """One row per (metric, statistic): measured, simulated, (sim - measured) / measured, and the peer's."""
    rows = []
    for m in METRICS:
        for s in STATS:
            ref, pred = (measured.get(m) or {}).get(s), (sim.get(m) or {}).get(s)
            p = (peer.get(m) or {}).get(s) or {}
            rows.append({"metric": m, "percentile": s, "engine": ref, "sim": pred,
                         "rel_error": None if ref in (None, 0) or pred is None else (pred - ref) / ref,
                         "peer_sim": p.get("sim"), "peer_rel_error": p.get("rel_error")})
    return rows


def rows_markdown(rows: Sequence[Mapping[str, Any]], title: str) -> str:
    """The error table, the peer beside; with a prediction band (step-noise draws) the band and whether vLLM's
    value is inside it."""
    from experiments.calibration.draws import band_cells, band_summary

    def num(v: float | None, pct: bool = False) -> str:
        return "n/a" if v is None else f"{v:+.1%}" if pct else f"{v:.4g}"

    banded = any(r.get("band_low") is not None for r in rows)
    lines = [f"### {title}", "", "| metric | stat | vLLM (measured) | twinserve | error | LLMServingSim | its error |"
             + (" twinserve band | inside |" if banded else ""), "|---|---|---|---|---|---|---|"
             + ("---|---|" if banded else "")]
    lines += [f"| {r['metric']} | {r['percentile']} | {num(r['engine'])} | {num(r['sim'])} | "
              f"{num(r['rel_error'], True)} | {num(r['peer_sim'])} | {num(r['peer_rel_error'], True)} |"
              + (band_cells(r) if banded else "") for r in rows]
    return "\n".join(lines) + "\n" + ("\n" + band_summary(rows) + "\n" if banded else "")


def diagnostics(gt: GroundTruth, sim_dir: Path) -> dict[str, Any]:
    """Where simulated and measured runs part: per-request queueing (first scheduled - receipt) and TTFT, the TTFT
    of requests neither side queued, the running / waiting counts each second against ``vllm_timeseries.csv``, and
    (``saturated_fit``) the saturated seconds' split into decode steps and prompt tokens on both sides. Both sides
    count from the engine's receipt (the simulation's: first token - its TTFT)."""
    from core.output import read_requests

    sim = read_requests(sim_dir)
    by_id = {str(i): k for k, i in enumerate(sim["id"].tolist())}
    idx = [by_id[r.id] for r in gt.requests]
    sched, first, fin, ttft = (np.asarray(sim[c], dtype=float)[idx] for c in ("first_scheduled_s", "first_token_s",
                                                                              "finish_s", "ttft_s"))
    arr = first - ttft
    m_arr = np.array([r.received_s for r in gt.requests])
    m_sched = np.array([r.scheduled_s for r in gt.requests])
    m_first = np.array([r.first_token_s for r in gt.requests])
    m_fin = np.array([r.last_token_s for r in gt.requests])

    def pct(x: np.ndarray) -> dict[str, float]:
        return {"p50": float(np.percentile(x, 50)), "p90": float(np.percentile(x, 90)), "mean": float(np.mean(x))}

    out: dict[str, Any] = {
        "queue_s": {"measured": pct(m_sched - m_arr), "sim": pct(sched - arr)},
        "prefill_s": {"measured": pct(m_first - m_sched), "sim": pct(first - sched)},
        "ttft_diff_s": pct((first - arr) - (m_first - m_arr)),
        "end_s": {"measured": float(m_fin.max()), "sim": float(fin.max())},
        "cached_tokens": int(np.sum(np.asarray(sim["cached_tokens"]))) if "cached_tokens" in sim else None,
    }
    # requests neither side queued (scheduled within 1 ms of arrival in vLLM, within one step in the simulation):
    # their TTFT difference is the step time plus what vLLM does around it (async scheduling's in-flight step)
    free = (m_sched - m_arr < 1e-3) & (sched - arr < np.median(first - sched))
    if np.any(free):
        out["unqueued"] = {"requests": int(np.sum(free)),
                           "ttft_measured_p50_s": float(np.median((m_first - m_arr)[free])),
                           "ttft_sim_p50_s": float(np.median((first - arr)[free])),
                           "ttft_diff_p50_s": float(np.median(((first - arr) - (m_first - m_arr))[free]))}
    ts = gt.file(TIMESERIES)
    if ts.is_file():
        import csv

        rows = list(csv.DictReader(ts.open()))
        t = np.array([float(r["t"]) for r in rows])
        # the timeseries' clock: second k samples the engine at ~k s after the first request (t starts at 1.0)
        run_s = np.array([float(r["running"]) for r in rows])
        wait_s = np.array([float(r["waiting"]) for r in rows])
        sim_run = np.array([np.sum((sched <= x) & (fin > x)) for x in t])
        sim_wait = np.array([np.sum((arr <= x) & (sched > x)) for x in t])
        mea_run = np.array([np.sum((m_sched <= x) & (m_fin > x)) for x in t])
        out["timeseries"] = {"seconds": len(t), "running_recorded_vs_requests_mae": float(np.mean(np.abs(run_s
                                                                                                     - mea_run))),
                             "running_sim_mae": float(np.mean(np.abs(sim_run - run_s))),
                             "waiting_sim_mae": float(np.mean(np.abs(sim_wait - wait_s))),
                             "waiting_peak": {"measured": float(wait_s.max()), "sim": float(sim_wait.max())},
                             "saturated_s": {"measured": int(np.sum(run_s >= np.max(run_s))),
                                             "sim": int(np.sum(sim_run >= np.max(run_s)))}}
        full = run_s >= np.max(run_s) - 2
        if "gen_throughput" in rows[0] and "prompt_throughput" in rows[0] and np.sum(full) >= MIN_SATURATED_S:
            from core.output import read_steps

            steps = read_steps(sim_dir)
            ended = np.asarray(steps["start_s"], float) + np.asarray(steps["duration_s"], float)
            sec = np.floor(ended).astype(np.int64)
            gen = np.array([float(r["gen_throughput"]) for r in rows])
            prompt = np.array([float(r["prompt_throughput"]) for r in rows])
            # second k of the timeseries (t = k) sums the steps that ended in [k - 1, k)
            at = t.astype(np.int64) - 1
            n = max(int(sec.max()), int(at.max())) + 1
            sim_gen, sim_prompt = (np.bincount(sec, weights=np.asarray(steps[c], float), minlength=n)[at]
                                   for c in ("num_decode_seqs", "num_prefill_tokens"))
            cap = float(np.max(run_s))
            out["saturated_fit"] = {"seconds": int(np.sum(full)), "running": cap,
                                    "measured": saturated_fit(gen[full], prompt[full], cap),
                                    "sim": saturated_fit(sim_gen[full], sim_prompt[full], cap)}
    return out


MIN_SATURATED_S = 5  # seconds at full occupancy below which saturated_fit is not attempted


def saturated_fit(gen_tokens: np.ndarray, prompt_tokens: np.ndarray, running: float) -> dict[str, float]:
    """Where the time of a saturated phase goes: each second (every seat taken, so a step yields ``running``
    tokens) as 1 s = a x gen_tokens / running + b x prompt_tokens, least squares over the seconds. a is the step
    time of the full decode batch, b what a prompt token joining it adds (its chunk's share of a mixed step). Read
    from vLLM's per-second log it is coarse (whole steps a second), but the simulation's seconds binned the same way
    compare like with like."""
    design = np.column_stack([np.asarray(gen_tokens, float) / running, np.asarray(prompt_tokens, float)])
    (a, b), *_ = np.linalg.lstsq(design, np.ones(len(design)), rcond=None)
    return {"decode_step_s": float(a), "per_prompt_token_s": float(b)}


def evaluate(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """``experiments.compare``'s comparison for a ground-truth folder: the measured run into ``out/engine``, the
    simulation of its requests under its settings into ``out/sim``, errors.md / errors.json with the peer's column,
    diagnostics.json."""
    from core.metrics import summarize
    from experiments.build import run_summary_options
    from experiments.calibration.draws import band_summary, simulate_draws, with_band
    from experiments.overrides import apply_overrides
    from experiments.serving.bench_result import write_measured_run

    gt = read_groundtruth(cfg.compare.measured)
    overrides, how = settings(gt, cfg)
    out.mkdir(parents=True, exist_ok=True)
    sim_cfg = apply_overrides(cfg, overrides)
    sim_cfg.workload = OmegaConf.create({"_target_": "core.workload.RequestList", "seed": 0,
                                         "path": str(write_request_list(gt, out / "request_list.jsonl"))})
    states = measured_states(gt)
    measured = summarize(states, **run_summary_options(RunConfig.from_config(sim_cfg)))
    measured.update(backend="vllm (ground truth)", source=str(gt.directory))
    write_measured_run(out / "engine", states, measured)
    sim, draws = simulate_draws(sim_cfg, out / "sim")
    peer = read_peer(gt.file(PEER)) if gt.file(PEER).is_file() else {}
    rows = with_band(error_rows(measured, sim, peer), (draws or {}).get("band"))
    cost, sched = (OmegaConf.select(sim_cfg, f"{k}._target_").rsplit(".", 1)[-1] for k in ("cost_model", "scheduler"))
    deployment = f"tp {how['tp']}" + (f", dp {how['dp']} x ep {how['ep']}" if how["dp"] > 1 else "")
    title = f"sim vs vLLM: {gt.directory.name} on {how['hardware']} ({deployment}), {cost}, {sched}"
    md = rows_markdown(rows, title)
    (out / "errors.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "errors.md").write_text(md)
    diag = diagnostics(gt, out / "sim")
    (out / "diagnostics.json").write_text(json.dumps(diag, indent=2) + "\n")
    log.info(f"ground truth {gt.directory}: {len(gt.requests)} requests; KV {how['kv_blocks']} blocks "
             f"({how['kv_blocks_how']}); cost model coverage {sim.get('cost_model')}")
    fit = diag.get("saturated_fit")
    if fit:
        m, s = fit["measured"], fit["sim"]
        log.info(f"saturated phase ({fit['seconds']} s at {fit['running']:.0f} running; diagnostics.json "
                 f"saturated_fit), vLLM / sim: full decode step {1e3 * m['decode_step_s']:.1f} / "
                 f"{1e3 * s['decode_step_s']:.1f} ms, a prompt token joining it {1e6 * m['per_prompt_token_s']:.0f}"
                 f" / {1e6 * s['per_prompt_token_s']:.0f} us")
    return {"measured": {"source": str(gt.directory), "backend": "vllm (ground truth)", "settings": how},
            "calibration": {"path": None, "fitted_here": False}, "errors": rows, "errors_md": md,
            "in_band": band_summary(rows),
            "sim_metrics": sim, "sim_draws": draws, "diagnostics": diag, "plots": {},
            "metrics": {"measured": {k: measured[k] for k in METRICS}, "sim": {k: sim[k] for k in METRICS}}}
