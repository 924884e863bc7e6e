"""Engine benchmark: throughput of the engine vs transformers ``generate`` on the same model, and the share of
each step spent in Python scheduling (schedule + apply + input preparation) vs the model.

Usage: python -m experiments.bench_engine [--requests 64] [--batch 32] [--prompt 64] [--output 64] [--threads 1]
[--repeats 3]. Engine and transformers runs alternate; every figure is the median over the repeats, and
speedup_vs_hf_runs lists the ratio of each engine / transformers pair.
Goals (issue): >= 1.5x transformers throughput on CPU; scheduling overhead < 10% of step time at batch 32.
``--varied`` serves mixed prompt / output lengths (a static batch then runs until its longest output is done);
the default equal lengths are static batching's best case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from engine.loader import build_model
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import simulate


class _Timed:
    """Accumulates the wall time of calls to one method of an object (bench instrumentation only)."""

    def __init__(self, obj, name: str) -> None:
        self.total, self.calls, self._f = 0.0, 0, getattr(obj, name)
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._f(*a, **k)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1


class _Requests:
    def __init__(self, reqs):
        self.reqs = reqs

    def initial(self):
        return iter(self.reqs)

    def on_finish(self, state, now):
        return None


def hf_checkpoint(path: str, spec_overrides: dict) -> None:
    import transformers

    cfg = transformers.LlamaConfig(**spec_overrides)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def _engine_run(spec: ModelSpec, model, prompts: list[list[int]], outputs: list[int], args) -> dict:
    """Serve the prompts through the shared driver on a fresh replica and KV cache; throughput and step shares."""
    longest = max(len(p) for p in prompts) + max(outputs)
    kv = KVCacheManager(args.batch * (-(-longest // 16)) + 64, 16, LRUEviction(), False)
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(4096, args.batch, spec.max_model_len))
    ex = build_engine_executor(spec, kv_manager=kv, model=model)
    ex.warmup(4)
    t_sched, t_apply = _Timed(replica, "schedule"), _Timed(replica, "apply")
    t_prep, t_model = _Timed(ex.runner, "prepare"), _Timed(ex.runner.model, "forward")
    pairs = enumerate(zip(prompts, outputs, strict=True))
    reqs = [Request(f"r{i}", 0.0, len(p), n, prompt_token_ids=tuple(p)) for i, (p, n) in pairs]
    cpu0 = time.process_time()
    try:
        res = simulate(ServingLoop([replica], [ex], RoundRobinRouter(), _Requests(reqs)))
    finally:
        del ex.runner.model.forward  # the model is shared between runs: drop the instance-level wrapper
    cpu_s = time.process_time() - cpu0
    engine_tok = sum(s.num_output_tokens for s in res.states)
    # the batch-`batch` decode steps, and the prefill steps (no decodes)
    full = [s for s in res.steps if s.features.num_decode_seqs == args.batch]
    prefill = [s for s in res.steps if s.features.num_decode_seqs == 0]
    return {
        "engine_tok_s": engine_tok / res.wall_s,
        "engine_tok_per_cpu_s": engine_tok / cpu_s,
        "python_overhead_share": (t_sched.total + t_apply.total + t_prep.total) / res.wall_s,
        "schedule_ms_per_step": 1e3 * t_sched.total / t_sched.calls,
        "apply_ms_per_step": 1e3 * t_apply.total / t_apply.calls,
        "prepare_ms_per_step": 1e3 * t_prep.total / max(t_prep.calls, 1),
        "model_ms_per_step": 1e3 * t_model.total / max(t_model.calls, 1),
        f"decode_step_ms_at_batch_{args.batch}": 1e3 * sum(s.duration_s for s in full) / max(len(full), 1),
        "prefill_ms": 1e3 * sum(s.duration_s for s in prefill),
        "engine_steps": len(res.steps),
    }


def _hf_run(hf, prompts: list[list[int]], outputs: list[int], args) -> dict:
    """transformers generate, batched (left-padded prompts): a batch runs until its longest output is done, so
    only each request's own output tokens count as throughput; also times the prefills alone."""
    batches = []
    for i in range(0, len(prompts), args.batch):
        ps, outs = prompts[i:i + args.batch], outputs[i:i + args.batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        batches.append((ids, mask, max(outs), sum(outs)))
    with torch.inference_mode():
        t0, cpu0 = time.perf_counter(), time.process_time()
        for ids, mask, longest, _ in batches:
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
        hf_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        t0 = time.perf_counter()
        for ids, mask, _, _ in batches:
            hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        prefill_s = time.perf_counter() - t0
    useful = sum(b[3] for b in batches)
    return {"hf_tok_s": useful / hf_s, "hf_tok_per_cpu_s": useful / cpu_s, "hf_prefill_ms": 1e3 * prefill_s}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="alternating engine / transformers runs; medians reported")
    p.add_argument("--varied", action="store_true",
                   help="prompt lengths uniform in [8, 2*prompt], outputs in [4, 2*output] (else all equal: the best "
                        "case for static batching)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    torch.set_num_threads(args.threads)
    import transformers

    shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, torch_dtype="float32")
    g = torch.Generator().manual_seed(1)
    if args.varied:
        lens = torch.randint(8, 2 * args.prompt + 1, (args.requests,), generator=g).tolist()
        outputs = torch.randint(4, 2 * args.output + 1, (args.requests,), generator=g).tolist()
    else:
        lens, outputs = [args.prompt] * args.requests, [args.output] * args.requests
    prompts = [torch.randint(0, shape["vocab_size"], (n,), generator=g).tolist() for n in lens]
    with tempfile.TemporaryDirectory() as d:
        hf_checkpoint(d, shape)
        spec = ModelSpec.from_pretrained(d)
        hf = transformers.LlamaForCausalLM.from_pretrained(d).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        model = build_model(spec)
        with torch.inference_mode():
            hf.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=4, do_sample=False)  # warm-up
        # Engine and transformers alternate, so load from other jobs on the machine hits both alike.
        runs = [{**_engine_run(spec, model, prompts, outputs, args), **_hf_run(hf, prompts, outputs, args)}
                for _ in range(args.repeats)]
    for r in runs:
        r["speedup_vs_hf"] = r["engine_tok_s"] / r["hf_tok_s"]
        r["cpu_speedup_vs_hf"] = r["engine_tok_per_cpu_s"] / r["hf_tok_per_cpu_s"]  # less sensitive to other jobs
    median = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    result = {key: round(median(key), 4 if "share" in key else 3) for key in runs[0]}
    result["engine_steps"] = runs[0]["engine_steps"]
    result.update(speedup_vs_hf_runs=[round(r["speedup_vs_hf"], 3) for r in runs], threads=args.threads,
                  repeats=args.repeats, workload="varied lengths" if args.varied else "equal lengths")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
