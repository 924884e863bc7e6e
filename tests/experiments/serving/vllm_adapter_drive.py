"""Drives a vLLM scheduler in-process without a model (run under .venv-vllm with the repository on PYTHONPATH): vLLM's
own ``Scheduler`` / ``AsyncScheduler`` or the twinserve adapter, on request streams given as JSON, as ``EngineCore``
drives it -- ``schedule()``, then ``update_from_output()`` with a ``ModelRunnerOutput`` that samples a fixed token for
every request whose chunk completes its sequence. ``--overlap`` runs it as vLLM's batch queue does with async
scheduling: step k+1 is scheduled before step k's output is applied.

    .venv-vllm/bin/python tests/experiments/serving/vllm_adapter_drive.py RESULT.json < job.json

A job: ``{"runs": [{"cls": "own" | "own_async" | "adapter", "overrides": [...], "config": {...vLLM keys as in
experiments/calibration/vllm_sched_trace.make_stream...}, "requests": [{"id", "arrival" (step), "prompt": [ids],
"max_tokens", "priority"?}], "overlap": false}, ...]}`` or ``{"replay": [seeds]}`` (the recorded streams of
tests/data/vllm_v1_decisions.json through the adapter with scheduler=vllm_v1). The result (a JSON file): per run the
step records (``step_record``), each request's first-token and finish step, its outputs, the prefix-cache hits and the
seconds spent in ``schedule()``;
or ``{"error": message}`` when the scheduler refused to start. A run may ``inject`` refused features into vLLM's
config (``{"speculative_config": true, "lora_config": true}``); a request with ``"json": true`` asks for structured
output.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.calibration.vllm_sched_trace import prompt_tokens, sampled_token, step_record, write_model_config

ADAPTER = "experiments.serving.vllm_adapter.scheduler.TwinserveScheduler"
SCHED_KEYS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
              "long_prefill_token_threshold_adaptive", "enable_chunked_prefill", "scheduler_reserve_full_isl")
RECORDING = Path(__file__).resolve().parents[2] / "data" / "vllm_v1_decisions.json"


def build(config: dict[str, Any], model_dir: str, cls: str, overrides: list[str],
          inject: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(scheduler, block hasher) for ``config``, built as EngineCore builds them (one full-attention group)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                        max_model_len=config["max_model_len"], seed=0)
    keys = [k for k in SCHED_KEYS if k in config]
    sched = SchedulerConfig(**{k: config[k] for k in keys}, max_model_len=config["max_model_len"],
                            is_encoder_decoder=False, async_scheduling=False)
    cache = CacheConfig(block_size=config["block_size"], enable_prefix_caching=config["enable_prefix_caching"])
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                    additional_config={"twinserve_scheduler": overrides} if cls == "adapter" else {})
    vc.cache_config.num_gpu_blocks = config["num_gpu_blocks"]
    for key in inject or {}:  # refused features: the adapter's check runs before vLLM reads them
        from types import SimpleNamespace

        object.__setattr__(vc, key, SimpleNamespace(name=key))
    spec = FullAttentionSpec(block_size=config["block_size"], num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=config["num_gpu_blocks"], kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, vc)
    if cls == "adapter":
        from experiments.serving.vllm_adapter.scheduler import TwinserveScheduler as klass
    else:
        klass = AsyncScheduler if cls == "own_async" else Scheduler
    scheduler = klass(vc, kv, StructuredOutputManager(vc), block_size=block_size, hash_block_size=hash_block_size,
                      log_stats=True)
    hasher = None
    if config["enable_prefix_caching"]:
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block_size, hash_fn)
    return scheduler, hasher


def drive(run: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """One run to completion: step records, first-token and finish steps, outputs per request."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    try:
        sched, hasher = build(run["config"], model_dir, run["cls"], run.get("overrides", []), run.get("inject"))
    except ValueError as e:
        return {"error": str(e)}
    pending = sorted(run["requests"], key=lambda r: r["arrival"])
    token = run.get("token", lambda rid, pos: 1 + (int(rid) * 37 + pos * 11) % 997 if rid.isdigit() else 7)
    steps: list[dict[str, Any]] = []
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    hits = [0, 0]  # vLLM's prefix-cache stats, summed over the steps' SchedulerStats: (hit tokens, queried tokens)
    in_flight: list[tuple[Any, list[str], int]] = []  # (scheduler output, ids that sample, step)

    def apply(out: Any, sampling: list[str], k: int) -> list[str]:
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests.get(rid)
            sampled.append([token(rid, req.num_output_tokens)] if rid in sampling and req is not None else [])
        result = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        finished = []
        for outs in result.values():
            stats = outs.scheduler_stats.prefix_cache_stats if outs.scheduler_stats is not None else None
            if stats is not None:
                hits[0] += stats.hits
                hits[1] += stats.queries
            for o in outs.outputs:
                if o.new_token_ids:
                    first.setdefault(o.request_id, k)
                    outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    done[o.request_id] = k
                    finished.append(o.request_id)
        return finished

    k, schedule_s = 0, 0.0
    while pending or sched.get_num_unfinished_requests() or in_flight:
        while pending and pending[0]["arrival"] <= k:
            r = pending.pop(0)
            so = StructuredOutputsParams(json={"type": "object"}) if r.get("json") else None
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, structured_outputs=so)
            sched.add_request(Request(r["id"], r["prompt"], params, None, arrival_time=float(r["arrival"]),
                                      priority=r.get("priority", 0), block_hasher=hasher))
        t0 = time.perf_counter()
        out = sched.schedule()
        schedule_s += time.perf_counter() - t0
        sampling = [rid for rid in out.num_scheduled_tokens if not sched.requests[rid].is_prefill_chunk]
        rec = step_record(dict(out.num_scheduled_tokens), out.preempted_req_ids, [])
        in_flight.append((out, sampling, k))
        finished = []
        while in_flight and (not run.get("overlap") or len(in_flight) == 2 or not out.total_num_scheduled_tokens):
            finished += apply(*in_flight.pop(0))  # an empty step: nothing to overlap with, drain the queue
        if finished:
            rec["f"] = sorted(finished)
        steps.append(rec)
        k += 1
        if k > 5000:
            raise RuntimeError("not drained after 5000 steps")
    return {"steps": steps, "first_token_step": first, "finish_step": done, "outputs": outputs,
            "prefix_hits": hits[0], "prefix_queries": hits[1], "schedule_s": schedule_s}


def replay(seeds: list[int], model_dir: str) -> dict[str, Any]:
    """The recorded streams through the adapter with scheduler=vllm_v1: the first step that differs, per seed."""
    recording = json.loads(RECORDING.read_text())
    result = {}
    for stream in recording["streams"]:
        if stream["seed"] not in seeds:
            continue
        cfg = stream["config"]
        overrides = ["scheduler=vllm_v1"] + [f"scheduler.{k}={cfg[k]}" for k in SCHED_KEYS]
        index = {r["id"]: i for i, r in enumerate(stream["requests"])}
        requests = [{**r, "prompt": prompt_tokens(stream, r)} for r in stream["requests"]]
        got = drive({"cls": "adapter", "overrides": overrides, "config": cfg, "requests": requests,
                     "token": lambda rid, pos, s=stream, ix=index: sampled_token(s, ix[rid], pos)}, model_dir)
        want = stream["steps"]
        diff = next((i for i, (a, b) in enumerate(zip(got["steps"], want, strict=False)) if a != b), None)
        if diff is None and len(got["steps"]) != len(want):
            diff = min(len(got["steps"]), len(want))
        result[str(stream["seed"])] = None if diff is None else {
            "step": diff, "got": got["steps"][diff:diff + 2], "want": want[diff:diff + 2]}
    return result


def main() -> None:
    job, out = json.load(sys.stdin), Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as model_dir:
        write_model_config(model_dir)
        if "replay" in job:
            result: Any = replay(job["replay"], model_dir)
        else:
            result = [drive(run, model_dir) for run in job["runs"]]
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
