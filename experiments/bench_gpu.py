"""GPU benchmark (one command, a few minutes on an H100/H200-class GPU): Triton kernels vs their torch references,
decode step time vs the memory-bandwidth lower bound, prefill throughput vs peak FLOPs, for a random-weight model
of a real shape. Writes bench_gpu.json, kernels.csv and steps.csv (StepRecord columns: `experiments.calibrate`
can fit them) into --out.

    python -m experiments.bench_gpu --model llama3_8b --hardware h100 --out outputs/bench_gpu
    python -m experiments.bench_gpu --device cpu --kernels torch --model tiny --hardware cpu --quick   # smoke test

Goals (issue): decode >= 70% of the bandwidth roofline, prefill >= 50% of peak bf16 FLOPs for an 8B-shaped model.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf

from core import arithmetic as ar
from core.kv_cache import KVCacheManager
from core.records import StepRecord
from core.shapes import ShapedBatch
from core.specs import HardwareSpec, ModelSpec
from engine.executor import build_engine_executor
from kernels.ops import get_kernels
from kernels.rope import rope_cos_sin
from kernels.w4a16 import quantize_w4
from policies.eviction.lru import LRUEviction

CONF = Path(__file__).resolve().parent.parent / "conf"
BLOCK = 16


def timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls, synchronising the device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_rows(spec: ModelSpec, device: torch.device, dtype: torch.dtype, reps: int, quick: bool) -> list[dict]:
    """Each op at a decode-like (16 tokens) and a prefill-like token count, torch reference vs Triton."""
    ref, tri = get_kernels("torch"), get_kernels("triton") if device.type == "cuda" else None
    d, H, Hkv, D, F = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    ctx, seqs = (256, 4) if quick else (2048, 32)
    nb = seqs * (ctx // BLOCK + 1)
    kc, vc = rnd(nb, BLOCK, Hkv, D), rnd(nb, BLOCK, Hkv, D)
    tables = torch.arange(nb, device=device, dtype=torch.int32).view(seqs, -1)
    cos_sin = rope_cos_sin(D, ctx + 1, spec.rope_theta, spec.rope_scaling, torch.float32, device)
    rows = []
    for T in (16, 512 if quick else 4096):
        w = torch.ones(d, device=device, dtype=dtype)
        pos = torch.randint(0, ctx, (T,), device=device, generator=g)
        slots = torch.randperm(nb * BLOCK, device=device, generator=g)[:T]
        qw = quantize_w4(torch.randn(F, d, device=device, generator=g).to(dtype), spec_group(d))
        x, res, q, k, v, gu = rnd(T, d), rnd(T, d), rnd(T, H, D), rnd(T, Hkv, D), rnd(T, Hkv, D), rnd(T, 2 * F)
        for name, op in _token_ops(x, w, res, q, k, v, pos, cos_sin, gu, kc, vc, slots, qw).items():
            rows.append(_pair(name, f"T={T}", op, ref, tri, device, reps))
    # attention: a decode batch of `seqs` x `ctx`, and one whole-prompt prefill of `ctx` tokens
    lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
    qdec, qsl = rnd(seqs, H, D), torch.arange(seqs + 1, device=device, dtype=torch.int32)
    rows.append(_pair("attention_decode", f"S={seqs} ctx={ctx}",
                      lambda ks: ks.attention(qdec, kc, vc, tables, lens, qsl, D ** -0.5), ref, tri, device, reps))
    qpre = rnd(ctx, H, D)
    one = torch.tensor([ctx], device=device, dtype=torch.int32)
    rows.append(_pair("attention_prefill", f"T={ctx}",
                      lambda ks: ks.attention(qpre, kc, vc, tables[:1], one,
                                              torch.tensor([0, ctx], device=device, dtype=torch.int32), D ** -0.5),
                      ref, tri, device, reps))
    return rows


def _token_ops(x, w, res, q, k, v, pos, cos_sin, gu, kc, vc, slots, qw) -> dict[str, Callable]:
    """The per-token ops on one set of inputs; each takes a KernelSet."""
    return {
        "rms_norm+residual": lambda ks: ks.rms_norm(x, w, 1e-5, res),
        "rope": lambda ks: ks.rope(q, k, pos, cos_sin),
        "silu_and_mul": lambda ks: ks.silu_and_mul(gu),
        "store_kv": lambda ks: ks.store_kv(k, v, kc, vc, slots),
        "w4a16_linear": lambda ks: ks.w4a16_linear(x, qw),
    }


def spec_group(k: int) -> int:
    return next(gs for gs in (128, 64, 32, 16) if k % gs == 0)


def _pair(name, shape, op, ref, tri, device, reps) -> dict:
    row = {"op": name, "shape": shape, "torch_ms": 1e3 * timeit(lambda: op(ref), device, reps)}
    if tri is not None:
        row["triton_ms"] = 1e3 * timeit(lambda: op(tri), device, reps)
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def step_rows(spec: ModelSpec, hw: HardwareSpec, device: str, kernels: str, dtype: torch.dtype, reps: int,
              quick: bool) -> tuple[list[dict], list[StepRecord]]:
    batches = [1, 4] if quick else [1, 8, 32, 64, 128]
    contexts = [128] if quick else [512, 2048]
    prefills = [128] if quick else [512, 2048, 4096]
    tokens_needed = max(max(batches) * (max(contexts) + 1), max(prefills))
    kv = KVCacheManager(tokens_needed // BLOCK + 2 * max(batches) + 8, BLOCK, LRUEviction(), False)
    ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels, device=device, dtype=dtype)
    wbytes = ar.weight_bytes(spec)
    kv_tok = ar.kv_bytes_per_token(spec)
    rows, records = [], []

    def measure(shape: ShapedBatch, kind: str, **info) -> None:
        batch = shape.admit(kv)  # the shape's requests hold their blocks while the batch is timed
        t = timeit(lambda: ex.runner.execute(batch, kv.block_table), ex.runner.device, reps)
        f = batch.features
        records.append(StepRecord(0, 0.0, t, f, kv.num_used_blocks, 0))
        row = {"kind": kind, **info, "step_ms": 1e3 * t, "tokens_per_s": f.num_batched_tokens / t}
        if kind == "decode":
            bound = (wbytes + f.kv_tokens_read * kv_tok) / hw.mem_bw
            row.update(bandwidth_bound_ms=1e3 * bound, fraction_of_bandwidth_roofline=bound / t)
        else:
            flops = (f.num_prefill_tokens * ar.linear_flops_per_token(spec) + f.attention_pairs
                     * ar.attention_flops_per_pair(spec) + ar.lm_head_flops_per_token(spec))
            row.update(tflops=flops / t / 1e12, fraction_of_peak_flops=flops / t / hw.peak_flops)
        rows.append(row)
        shape.release(kv)

    for ctx in contexts:  # decodes of one token after ctx tokens already in the pool
        for b in batches:
            measure(ShapedBatch(decodes=(ctx + 1,) * b, name=f"decode{b}x{ctx}"), "decode", batch=b, context=ctx)
    for n in prefills:
        measure(ShapedBatch(prefills=((0, n),), name=f"prefill{n}"), "prefill", tokens=n)
    return rows, records


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_8b", help="a conf/model option")
    p.add_argument("--hardware", default="h100", help="a conf/hardware option (for the roofline bounds)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", default="triton", choices=["torch", "triton"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    p.add_argument("--out", default="outputs/bench_gpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here; use --device cpu --kernels torch for a smoke test")
    spec = ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{args.model}.yaml")))
    hw = HardwareSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{args.hardware}.yaml")))
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kernels = kernel_rows(spec, device, dtype, args.reps, args.quick)
    steps, records = step_rows(spec, hw, args.device, args.kernels, dtype, args.reps, args.quick)
    result = {"model": spec.name, "hardware": hw.name, "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "kernels_backend": args.kernels, "dtype": args.dtype, "kernels": kernels, "steps": steps}
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=1))
    with open(out / "kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["op", "shape", "torch_ms", "triton_ms", "speedup"])
        w.writeheader()
        w.writerows(kernels)
    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(StepRecord.columns())
        w.writerows(r.row() for r in records)
    for r in kernels:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in steps:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
