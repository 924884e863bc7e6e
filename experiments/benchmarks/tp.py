"""Tensor-parallel benchmark: the engine's step times at tp = 1, 2, ... (and ``--ep``) on one checkpoint, the
greedy tokens of every degree checked against tp = 1's, measured in one run.

Usage: python -m experiments.bench_tp [--arch llama|qwen3_moe|mixtral] [--tp 1,2] [--ep 1] [--device cpu|cuda]
[--batch 8] [--prompt 64] [--output 32] [--repeats 3] [--threads 1] [--kernels auto|torch|native|triton]
[--hidden 512] [--layers 4] [--vocab 32000]. Default: the 44M Llama of experiments.bench_engine (4 layers, hidden
512, vocab 32000, fp32); the MoE archs are experiments.bench_moe's checkpoint (8 experts of half the width, top-2).
``batch`` requests of ``prompt`` tokens each generate ``output`` tokens through the serving loop (Sarathi
scheduler); per degree and repeat: the prefill steps' summed time and the full-batch decode steps' median (wall
clock of rank 0, which includes waiting for the other ranks) and rank 0's time inside the collectives per step
(all-reduces, the logits' gather, the step broadcast: transfer plus waiting for the slowest rank). Degrees
alternate within each repeat, so a shared machine's load hits them alike; medians over the repeats, with each
repeat's decode step beside them.

On one CPU the ranks share the cores: tp 2 on 2 cores is expected slower than tp 1 (each rank's GEMMs are half
the size, but the two all-reduces per layer, the embedding's all-reduce and the logits' gather, over gloo on
loopback, come on top); the point here is the communication term a TP cost model must carry, and correctness.
On CUDA (``--device cuda``, NCCL) each rank takes its own GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from experiments.benchmarks.engine import _Requests
from experiments.benchmarks.moe import make_moe_checkpoint
from experiments.benchmarks.tiny_checkpoint import make_checkpoint
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual

BLOCK = 16
COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object_list")  # what the engine's ranks call each step


class _CollectiveTimer:
    """Rank 0's wall time inside torch.distributed's collectives (the transfer plus the wait for the slowest rank:
    the communication term of a TP step) while in use."""

    def __init__(self) -> None:
        self.total_s, self.calls, self._saved = 0.0, 0, {}

    def __enter__(self) -> _CollectiveTimer:
        for name in COLLECTIVES:
            self._saved[name] = fn = getattr(dist, name)
            setattr(dist, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - t0
                self.calls += 1
        return timed

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def serve(spec: ModelSpec, prompts: list[list[int]], output: int, *, tp: int, ep: int, device: str, kernels: str,
          threads: int) -> dict:
    """One run of the prompts at one degree: its step times and tokens."""
    longest = max(map(len, prompts)) + output
    kv = KVCacheManager(len(prompts) * -(-longest // BLOCK) + 8, BLOCK, LRUEviction(), False)
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(4096, len(prompts), spec.max_model_len))
    ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels, device=device, tp=tp, ep=ep,
                               num_threads=threads)
    try:
        ex.warmup(4)
        reqs = [Request(f"r{i}", 0.0, len(p), output, prompt_token_ids=tuple(p)) for i, p in enumerate(prompts)]
        with _CollectiveTimer() as comm:
            res = run_virtual(ServingLoop([replica], [ex], RoundRobinRouter(), _Requests(reqs)))
    finally:
        ex.close()
    full = [s.duration_s for s in res.steps if s.features.num_decode_seqs == len(prompts)
            and s.features.num_prefill_tokens == 0]
    prefill = [s.duration_s for s in res.steps if s.features.num_prefill_tokens]
    return {"decode_step_ms": 1e3 * statistics.median(full) if full else float("nan"),
            "prefill_ms": 1e3 * sum(prefill), "steps": len(res.steps),
            "collective_ms_per_step": 1e3 * comm.total_s / len(res.steps),
            "collectives_per_step": comm.calls / len(res.steps),
            "tokens": [s.output_token_ids for s in sorted(res.states, key=lambda s: s.id)]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3_moe", "mixtral"])
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel degrees")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the tp > 1 runs (MoE archs)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    degrees = [int(t) for t in args.tp.split(",")]
    if args.repeats < 1 or 1 not in degrees:
        raise ValueError(f"--repeats={args.repeats} must be >= 1 and --tp={args.tp} must include 1 (the reference)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        if args.arch == "llama":
            make_checkpoint(d, num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab,
                            intermediate_size=args.hidden * 11 // 4)
        else:
            make_moe_checkpoint(d, args.arch, layers=args.layers, hidden=args.hidden, experts=8, top_k=2,
                                expert_width=args.hidden * 11 // 8, vocab=args.vocab)
        spec = ModelSpec.from_pretrained(d)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(6, spec.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
        runs: dict[int, list[dict]] = {t: [] for t in degrees}
        for _ in range(args.repeats):
            for t in degrees:
                runs[t].append(serve(spec, prompts, args.output, tp=t, ep=args.ep if t > 1 else 1,
                                     device=args.device, kernels=args.kernels, threads=args.threads))
    results = {}
    for t, rs in runs.items():
        results[f"tp_{t}"] = {
            "decode_step_ms": round(statistics.median(r["decode_step_ms"] for r in rs), 3),
            "prefill_ms": round(statistics.median(r["prefill_ms"] for r in rs), 3),
            "decode_step_ms_runs": [round(r["decode_step_ms"], 3) for r in rs],
            "collective_ms_per_step": round(statistics.median(r["collective_ms_per_step"] for r in rs), 3),
            "collectives_per_step": round(rs[0]["collectives_per_step"], 2),
            "tokens_equal_tp1": all(r["tokens"] == runs[1][0]["tokens"] for r in rs)}
        results[f"tp_{t}"]["decode_vs_tp1"] = round(results[f"tp_{t}"]["decode_step_ms"]
                                                    / results["tp_1"]["decode_step_ms"], 3)
    result = {"model": f"{args.arch} {args.layers}L hidden {args.hidden} vocab {args.vocab} fp32",
              "device": args.device, "threads_per_rank": args.threads, "ep": args.ep, "batch": args.batch,
              "prompt": args.prompt, "output": args.output, "repeats": args.repeats, **results}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
