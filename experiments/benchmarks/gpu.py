"""GPU benchmark (one command, a few minutes on an H100/H200-class GPU), for a random-weight model of a real shape
in the run's dtype (bf16 by default):

- kernels: each Triton op vs its torch reference; attention vs torch SDPA on dense K/V (the speed to beat) with
  contiguous and fragmented block tables, int8 KV vs 16-bit KV; W4A16 vs bf16 ``F.linear`` (cuBLAS) per projection
  shape, measured speed-up next to the bytes-predicted one;
- MoE grouped GEMM (fixed expert shapes, whatever --model: Qwen3-30B-A3B, Mixtral-8x7B): one grouped launch vs a
  loop of per-expert cuBLAS matmuls, TFLOP/s and the roofline fraction at decode and prefill token counts; the
  fused SiLU-and-mul gate_up vs gate_up then silu_and_mul; the routing helpers' own cost;
- steps: decode step time vs the memory-bandwidth lower bound (weights read per step: the linear layers and the LM
  head, not the embedding table, of which a step reads a few rows; plus the KV read), prefill throughput vs peak
  FLOPs; W4A16 and int8-KV engines' decode steps, measured vs predicted speed-up over the 16-bit engine.

Writes bench_gpu.json, kernels.csv, grouped_gemm.csv and steps.csv (StepRecord columns: `experiments.calibrate` can
fit them) into --out.

    python -m experiments.bench_gpu --model llama3_8b --hardware h100 --out outputs/bench_gpu
    python -m experiments.bench_gpu --device cpu --kernels torch --model tiny --hardware cpu --quick   # smoke test
    python -m experiments.bench_gpu --hardware h200 --moe-only   # the MoE grouped-GEMM rows alone

Goals (issue): decode >= 70% of the bandwidth roofline, prefill >= 50% of peak bf16 FLOPs for an 8B-shaped model.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from core import arithmetic as ar
from core.kv_cache import KVCacheManager
from core.records import StepRecord
from core.shapes import ShapedBatch
from core.specs import HardwareSpec, ModelSpec
from engine.executor import build_engine_executor
from experiments.build import CONF_DIR
from kernels.grouped_gemm import route_tokens
from kernels.ops import KernelSet, get_kernels
from kernels.rope import rope_cos_sin
from kernels.w4a16 import GEMV_MAX_M, quantize_w4
from policies.eviction.lru import LRUEviction

BLOCK = 16
# MoE expert shapes for the grouped GEMM rows: (name, experts, top_k, hidden, expert intermediate, token counts)
MOE_SHAPES = (("qwen3_30b_a3b", 128, 8, 2048, 768, (1, 16, 128, 4096)),
              ("mixtral_8x7b", 8, 2, 4096, 14336, (16, 4096)))
MOE_QUICK = (("tiny_moe", 8, 2, 64, 32, (4, 64)),)


def timeit(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, synchronising the device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median GPU seconds of one kernel-level call: on CUDA ``triton.testing.do_bench`` (device events, and an L2
    flush between calls that also hides the host's launch time, which a single small kernel would otherwise be
    timed by); elsewhere ``timeit``, without warm-up under the Triton interpreter (a smoke run: nothing compiles,
    and each interpreted call takes seconds)."""
    if device.type != "cuda":
        return timeit(fn, device, reps, warmup=0 if os.environ.get("TRITON_INTERPRET") == "1" else 2)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=max(20, 5 * reps), return_mode="median") / 1e3


def decode_bytes(spec: ModelSpec, dtype: torch.dtype, kv_tokens_read: int, weight_bits: int = 16,
                 kv_bits: int = 16, group_size: int = 128) -> float:
    """Bytes a decode step must read at least: linear weights as stored, the LM head in the run dtype (never
    quantised), the KV of every context token; not the embedding table (a step reads only its own rows)."""
    run = dataclasses.replace(spec, dtype=str(dtype).removeprefix("torch."))
    head = spec.vocab_size * spec.hidden_size * dtype.itemsize
    return (ar.linear_weight_bytes(run, weight_bits, group_size) + head
            + kv_tokens_read * ar.kv_bytes_per_token(run, kv_bits))


def spec_group(k: int) -> int:
    return next(gs for gs in (128, 64, 32, 16) if k % gs == 0)


def kernel_rows(spec: ModelSpec, device: torch.device, dtype: torch.dtype, reps: int, quick: bool,
                hw: HardwareSpec | None = None) -> list[dict]:
    """Each op at a decode-like (16 tokens) and a prefill-like token count, torch reference vs Triton; attention
    and W4A16 against the baselines a GPU engine must beat (SDPA on dense K/V, cuBLAS in the run dtype)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU smoke run of the Triton rows
    ref, tri = get_kernels("torch"), get_kernels("triton") if device.type == "cuda" or interpreted else None
    d, H, Hkv, D, F_ = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    ctx, seqs = (256, 4) if quick else (2048, 32)
    nb = seqs * (ctx // BLOCK + 1)
    kc, vc = rnd(nb, BLOCK, Hkv, D), rnd(nb, BLOCK, Hkv, D)
    cos_sin = rope_cos_sin(D, ctx + 1, spec.rope_theta, spec.rope_scaling, torch.float32, device)
    rows = []
    for T in (16, 512 if quick else 4096):
        w = torch.ones(d, device=device, dtype=dtype)
        pos = torch.randint(0, ctx, (T,), device=device, generator=g)
        slots = torch.randperm(nb * BLOCK, device=device, generator=g)[:T]
        x, res, q, k, v, gu = rnd(T, d), rnd(T, d), rnd(T, H, D), rnd(T, Hkv, D), rnd(T, Hkv, D), rnd(T, 2 * F_)
        for name, op in _token_ops(x, w, res, q, k, v, pos, cos_sin, gu, kc, vc, slots).items():
            rows.append(_pair(name, f"T={T}", op, ref, tri, device, reps))
    rows += _linear_rows(spec, device, dtype, reps, quick, tri, g)
    rows += _attention_rows(spec, device, dtype, reps, quick, tri, g, hw)
    return rows


def _token_ops(x, w, res, q, k, v, pos, cos_sin, gu, kc, vc, slots) -> dict[str, Callable]:
    """The per-token ops on one set of inputs; each takes a KernelSet."""
    return {
        "rms_norm+residual": lambda ks: ks.rms_norm(x, w, 1e-5, res),
        "rope": lambda ks: ks.rope(q, k, pos, cos_sin),
        "silu_and_mul": lambda ks: ks.silu_and_mul(gu),
        "store_kv": lambda ks: ks.store_kv(k, v, kc, vc, slots),
    }


def _linear_rows(spec, device, dtype, reps, quick, tri, g) -> list[dict]:
    """W4A16 (the backend's kernel) vs ``F.linear`` in the run dtype, per projection shape: decode-sized M is
    memory-bound, so the predicted speed-up is the bytes ratio; prefill-sized M is compute-bound (predicted 1). At
    M = 1 and 16 (M = 1 on CPU) the Triton backend also times the other decode path, forced: ``_dot`` rows (the
    GEMM) where M <= GEMV_MAX_M takes the GEMV, ``_gemv`` rows where M takes the GEMM."""
    d, H, Hkv, D, F_ = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    shapes = {"qkv": ((H + 2 * Hkv) * D, d), "o": (d, H * D), "gate_up": (2 * F_, d), "down": (d, F_)}
    ks = tri or get_kernels("torch")
    rows = []
    for name, (N, K) in shapes.items():
        group = spec_group(K)
        w = torch.randn(N, K, device=device, generator=g).to(dtype) * 0.02
        qw = quantize_w4(w, group)
        for M in (1, 16, 512 if quick else 4096):
            x = torch.randn(M, K, device=device, generator=g).to(dtype)
            dense = kernel_time(lambda: F.linear(x, w), device, reps)  # noqa: B023
            w4 = kernel_time(lambda: ks.w4a16_linear(x, qw), device, reps)  # noqa: B023
            act = (M * K + M * N) * dtype.itemsize
            predicted = (N * K * dtype.itemsize + act) / (N * K / 2 + N * K / group * 4 + act) if M <= 16 else 1.0
            rows.append({"op": f"w4a16_{name}", "shape": f"M={M} N={N} K={K}", "baseline": "F.linear",
                         "baseline_ms": 1e3 * dense, "ms": 1e3 * w4, "speedup": dense / w4,
                         "predicted_speedup": predicted})
            # the decode path the dispatch did not take, forced (on CPU only at M = 1: the interpreter is slow)
            if M in ((1, 16) if device.type == "cuda" else (1,)) and tri is not None:
                other = "dot" if M <= GEMV_MAX_M else "gemv"
                t = kernel_time(lambda: ks.w4a16_linear(x, qw, gemv=other == "gemv"), device, reps)  # noqa: B023
                rows.append({"op": f"w4a16_{name}_{other}", "shape": f"M={M} N={N} K={K}", "baseline": "F.linear",
                             "baseline_ms": 1e3 * dense, "ms": 1e3 * t, "speedup": dense / t,
                             "predicted_speedup": predicted})
            if M == 1 and name == "qkv" and tri is not None:  # split-K counts for a decode GEMV (tuning data)
                for split in (1, 2, 4, 8, 16):
                    t = kernel_time(lambda sp=split: ks.w4a16_linear(x, qw, split_k=sp), device, reps)  # noqa: B023
                    rows.append({"op": f"w4a16_{name}_splitk{split}", "shape": f"M=1 N={N} K={K}",
                                 "baseline": "F.linear", "baseline_ms": 1e3 * dense, "ms": 1e3 * t,
                                 "speedup": dense / t, "predicted_speedup": predicted})
    return rows


def _attention_rows(spec, device, dtype, reps, quick, tri, g, hw) -> list[dict]:
    """Paged attention (the backend's kernel; the torch reference too) vs SDPA on dense K/V: a decode batch with
    contiguous and with fragmented block tables, int8 KV, and one whole-prompt prefill."""
    from kernels.kv_store import store_kv_torch

    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    ctx, seqs = (256, 4) if quick else (2048, 32)
    per_seq = -(-ctx // BLOCK)
    nb = seqs * per_seq
    rnd = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    kc, vc = rnd(nb, BLOCK, Hkv, D), rnd(nb, BLOCK, Hkv, D)
    k8, v8 = (torch.empty(nb, BLOCK, Hkv, D, dtype=torch.int8, device=device) for _ in range(2))
    s8 = [torch.empty(nb, BLOCK, Hkv, dtype=torch.float32, device=device) for _ in range(2)]
    all_slots = torch.arange(nb * BLOCK, device=device)
    store_kv_torch(kc.flatten(0, 1), vc.flatten(0, 1), k8, v8, all_slots, *s8)
    contiguous = torch.arange(nb, device=device, dtype=torch.int32).view(seqs, per_seq)
    fragmented = torch.randperm(nb, device=device, generator=g).to(torch.int32).view(seqs, per_seq)
    lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
    qdec, qsl = rnd(seqs, H, D), torch.arange(seqs + 1, device=device, dtype=torch.int32)
    kd, vd = (c[contiguous.long()].reshape(seqs, ctx, Hkv, D).transpose(1, 2) for c in (kc, vc))  # dense K/V
    sdpa_dec = kernel_time(lambda: F.scaled_dot_product_attention(qdec[:, :, None], kd, vd, enable_gqa=True), device,
                           reps)
    ks = tri or get_kernels("torch")
    hints = dict(max_query_len=1, max_seq_len=ctx)
    rows = []
    kv_bytes = seqs * ctx * Hkv * D * 2 * dtype.itemsize
    for name, tables, caches, nbytes in (
            ("attention_decode", contiguous, (kc, vc, None, None), kv_bytes),
            ("attention_decode_fragmented", fragmented, (kc, vc, None, None), kv_bytes),
            ("attention_decode_int8kv", contiguous, (k8, v8, *s8), seqs * ctx * Hkv * (D + 4) * 2)):
        t = kernel_time(lambda c=caches, bt=tables: ks.attention(qdec, c[0], c[1], bt, lens, qsl, D ** -0.5, c[2], c[3],
                                                            **hints), device, reps)
        row = {"op": name, "shape": f"S={seqs} ctx={ctx}", "baseline": "sdpa_dense", "baseline_ms": 1e3 * sdpa_dec,
               "ms": 1e3 * t, "speedup": sdpa_dec / t}
        if hw is not None:
            row["fraction_of_bandwidth_roofline"] = nbytes / hw.mem_bw / t
        if name.endswith("int8kv"):
            row["predicted_speedup_vs_16bit"] = kv_bytes / nbytes
        rows.append(row)
    rows[-1]["speedup_vs_16bit"] = rows[0]["ms"] / rows[-1]["ms"]
    if tri is not None:  # split-K counts on this decode batch and on a quarter of it (tuning data)
        for n in (seqs, max(1, seqs // 4)):
            for splits in (1, 2, 4, 8):
                t = kernel_time(lambda n=n, sp=splits: ks.attention(qdec[:n], kc, vc, contiguous[:n], lens[:n],
                                                                     qsl[:n + 1], D ** -0.5, num_splits=sp, **hints),
                                device, reps)
                rows.append({"op": f"attention_decode_split{splits}", "shape": f"S={n} ctx={ctx}",
                             "baseline": "sdpa_dense", "ms": 1e3 * t,
                             "fraction_of_bandwidth_roofline": kv_bytes * n / seqs / hw.mem_bw / t if hw else None})
    if tri is not None:  # the torch reference on the same decode batch, for scale
        rows[0]["torch_ref_ms"] = 1e3 * kernel_time(lambda: get_kernels("torch").attention(
            qdec, kc, vc, contiguous, lens, qsl, D ** -0.5), device, reps)
    qpre = rnd(ctx, H, D)
    one, qsl1 = torch.tensor([ctx], device=device, dtype=torch.int32), torch.tensor([0, ctx], device=device,
                                                                                      dtype=torch.int32)
    qd = qpre.transpose(0, 1)[None]
    sdpa_pre = kernel_time(lambda: F.scaled_dot_product_attention(qd, kd[:1], vd[:1], is_causal=True, enable_gqa=True),
                      device, reps)
    t = kernel_time(lambda: ks.attention(qpre, kc, vc, contiguous[:1], one, qsl1, D ** -0.5, max_query_len=ctx,
                                    max_seq_len=ctx), device, reps)
    rows.append({"op": "attention_prefill", "shape": f"T={ctx}", "baseline": "sdpa_dense_causal",
                 "baseline_ms": 1e3 * sdpa_pre, "ms": 1e3 * t, "speedup": sdpa_pre / t})
    return rows


def _pair(name, shape, op, ref, tri, device, reps) -> dict:
    baseline = kernel_time(lambda: op(ref), device, reps)
    row = {"op": name, "shape": shape, "baseline": "torch_ref", "baseline_ms": 1e3 * baseline}
    if tri is not None:
        row["ms"] = 1e3 * kernel_time(lambda: op(tri), device, reps)
        row["speedup"] = row["baseline_ms"] / row["ms"]
    return row


def grouped_gemm_rows(device: torch.device, dtype: torch.dtype, reps: int, quick: bool,
                      hw: HardwareSpec | None = None) -> list[dict]:
    """The MoE grouped GEMM (the Triton kernel; the torch reference where there is none) vs a loop of per-expert
    cuBLAS matmuls, per expert projection, at each MOE_SHAPES token count (MOE_QUICK with ``quick``), on uniformly
    routed tokens (top_k distinct experts each)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU smoke run of the Triton rows
    tri = get_kernels("triton") if device.type == "cuda" or interpreted else None
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, E, top_k, d, f, token_counts in MOE_QUICK if quick else MOE_SHAPES:
        weights = {"gate_up": torch.randn(E, 2 * f, d, device=device, generator=g).to(dtype) * d**-0.5,
                   "down": torch.randn(E, d, f, device=device, generator=g).to(dtype) * f**-0.5}
        for i, T in enumerate(token_counts):  # the last is the prefill count
            rows += _moe_rows(f"{name} T={T}", T, top_k, weights, tri, device, reps, hw, g,
                              sweep=i == len(token_counts) - 1)
    return rows


def _moe_rows(shape: str, T: int, top_k: int, weights: dict[str, torch.Tensor], tri: KernelSet | None,
              device: torch.device, reps: int, hw: HardwareSpec | None, g: torch.Generator,
              sweep: bool) -> list[dict]:
    """One token count of one MoE shape. The baseline is the torch reference handed host offsets: the loop's best
    case (a real layer must also wait for them). TFLOP/s for both, and the fraction of whichever roofline binds: a
    decode batch reads every hit expert's weights (bandwidth), a prefill one is compute-bound. Also the fused
    SiLU-and-mul gate_up vs gate_up then silu_and_mul, BLOCK_M = 128 vs the default where ``sweep`` (tuning data),
    and route_tokens + permute + combine."""
    ks, torch_ref = tri or get_kernels("torch"), get_kernels("torch").grouped_gemm
    timed = lambda fn: kernel_time(fn, device, reps)  # noqa: E731
    E, d = weights["down"].shape[:2]
    dtype = weights["down"].dtype
    topk_w, ids = torch.randn(T, E, device=device, generator=g).topk(top_k, dim=-1)
    route = route_tokens(ids, E)
    offsets, host = route.expert_offsets, route.expert_offsets.cpu()
    hit, M = int((host.diff() > 0).sum()), T * top_k
    rows = []
    for proj, w in weights.items():
        N, K = w.shape[1:]
        x = torch.randn(M, K, device=device, generator=g).to(dtype)
        loop = timed(lambda x=x, w=w: torch_ref(x, host, w))
        t = timed(lambda x=x, w=w: ks.grouped_gemm(x, offsets, w))
        flops, nbytes = 2 * M * N * K, (hit * N * K + M * (K + N)) * dtype.itemsize
        row = {"op": f"grouped_gemm_{proj}", "shape": f"{shape} rows={M} E={E} N={N} K={K}",
               "baseline": "cublas_loop", "baseline_ms": 1e3 * loop, "ms": 1e3 * t, "speedup": loop / t,
               "tflops": flops / t / 1e12, "baseline_tflops": flops / loop / 1e12}
        if hw is not None:
            bound = "bandwidth_roofline" if nbytes / hw.mem_bw > flops / hw.peak_flops else "peak_flops"
            row[f"fraction_of_{bound}"] = max(nbytes / hw.mem_bw, flops / hw.peak_flops) / t
        rows.append(row)
        if sweep and tri is not None:
            t = timed(lambda x=x, w=w: tri.grouped_gemm(x, offsets, w, block_m=128))
            rows.append({"op": f"grouped_gemm_{proj}_bm128", "shape": row["shape"], "baseline": "cublas_loop",
                         "baseline_ms": 1e3 * loop, "ms": 1e3 * t, "speedup": loop / t, "tflops": flops / t / 1e12})
        if proj == "gate_up":
            pair = timed(lambda x=x, w=w: ks.silu_and_mul(ks.grouped_gemm(x, offsets, w)))
            t = timed(lambda x=x, w=w: ks.grouped_gemm(x, offsets, w, True))
            rows.append({"op": "grouped_gemm_gate_up_silu", "shape": row["shape"], "baseline": "gate_up+silu_and_mul",
                         "baseline_ms": 1e3 * pair, "ms": 1e3 * t, "speedup": pair / t, "tflops": flops / t / 1e12})
    h, y = (torch.randn(n, d, device=device, generator=g).to(dtype) for n in (T, M))
    t = timed(lambda: _route_permute_combine(h, y, ids, topk_w, E))
    rows.append({"op": "moe_route_permute_combine", "shape": f"{shape} rows={M} E={E} d={d}", "ms": 1e3 * t})
    return rows


def _route_permute_combine(h: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, topk_w: torch.Tensor,
                           num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer's work around its grouped GEMMs: sort the choices, gather the rows, sum each token's outputs."""
    route = route_tokens(ids, num_experts)
    return route.permute(h), route.combine(y, topk_w)


def step_rows(spec: ModelSpec, hw: HardwareSpec, device: str, kernels: str, dtype: torch.dtype, reps: int,
              quick: bool, quant: str | None = None, kv_dtype: str = "auto",
              only: tuple[int, int] | None = None) -> tuple[list[dict], list[StepRecord]]:
    """Decode and prefill steps through the engine. ``only=(batch, context)``: that one decode shape (the W4A16 and
    int8-KV comparisons)."""
    batches = [1, 4] if quick else [1, 8, 32, 64, 128]
    contexts = [128] if quick else [512, 2048]
    prefills = [128] if quick else [512, 2048, 4096]
    if only is not None:
        batches, contexts, prefills = [only[0]], [only[1]], []
    tokens_needed = max(max(batches) * (max(contexts) + 1), max(prefills, default=0))
    kv = KVCacheManager(tokens_needed // BLOCK + 2 * max(batches) + 8, BLOCK, LRUEviction(), False)
    group = spec_group(spec.hidden_size)
    ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels, device=device, dtype=dtype, quant=quant,
                               group_size=group, kv_dtype=kv_dtype)
    ex.warmup(2, cuda_graphs=True)
    weight_bits, kv_bits = (4 if quant else 16), ar.kv_bits_of(kv_dtype)
    rows, records = [], []

    def measure(shape: ShapedBatch, kind: str, **info) -> None:
        batch = shape.admit(kv)  # the shape's requests hold their blocks while the batch is timed
        t = timeit(lambda: ex.runner.execute(batch, kv.block_table), ex.runner.device, reps)
        f = batch.features
        records.append(StepRecord(0, 0.0, t, f, kv.num_used_blocks, 0))
        row = {"kind": kind, "quant": quant or "none", "kv_dtype": kv_dtype, **info, "step_ms": 1e3 * t,
               "tokens_per_s": f.num_batched_tokens / t}
        if kind == "decode":
            bound = decode_bytes(spec, dtype, f.kv_tokens_read, weight_bits, kv_bits, group) / hw.mem_bw
            row.update(bandwidth_bound_ms=1e3 * bound, fraction_of_bandwidth_roofline=bound / t)
            graphs = ex.runner.graphs
            if graphs is not None:  # the same step without its CUDA graph: what the graphs save
                ex.runner.graphs = None
                t_eager = timeit(lambda: ex.runner.execute(batch, kv.block_table), ex.runner.device, reps)
                ex.runner.graphs = graphs
                row.update(eager_step_ms=1e3 * t_eager, graph_speedup=t_eager / t)
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


def quant_rows(spec: ModelSpec, hw: HardwareSpec, args, dtype: torch.dtype, base: list[dict]) -> list[dict]:
    """W4A16 and int8-KV engines on one decode shape: measured speed-up over the 16-bit engine's same shape vs the
    speed-up the bytes predict."""
    b, ctx = (4, 128) if args.quick else (32, 2048)
    ref = next((r for r in base if r["kind"] == "decode" and r["batch"] == b and r["context"] == ctx), None)
    out = []
    for quant, kv_dtype in ((args.quant_method, "auto"), (None, "int8")):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the previous engine's weights and KV are garbage by now
        rows, _ = step_rows(spec, hw, args.device, args.kernels, dtype, args.reps, args.quick, quant, kv_dtype,
                            only=(b, ctx))
        row = rows[0]
        if ref is not None:
            row.update(speedup_vs_16bit=ref["step_ms"] / row["step_ms"],
                       predicted_speedup_vs_16bit=ref["bandwidth_bound_ms"] / row["bandwidth_bound_ms"])
        out.append(row)
    return out


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
    p.add_argument("--no-quant", dest="quant", action="store_false", help="skip the W4A16 / int8-KV engines")
    p.add_argument("--kernels-only", action="store_true", help="only the kernel rows (no engine steps)")
    p.add_argument("--moe-only", action="store_true", help="only the MoE grouped-GEMM rows")
    p.set_defaults(quant_method="w4a16")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device here; use --device cpu --kernels torch for a smoke test")
    spec = ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml")))
    hw = HardwareSpec.from_mapping(
        OmegaConf.to_container(OmegaConf.load(CONF_DIR / "hardware" / f"{args.hardware}.yaml")))
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    def show(rows: list[dict]) -> list[dict]:
        """Print each section as soon as it is measured: a run stopped by a time limit still shows what it had."""
        for r in rows:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        return rows

    kernels = [] if args.moe_only else show(kernel_rows(spec, device, dtype, args.reps, args.quick, hw))
    moe = show(grouped_gemm_rows(device, dtype, args.reps, args.quick, hw))
    _write_rows(out / "grouped_gemm.csv", moe)
    if args.kernels_only or args.moe_only:
        (out / "bench_gpu.json").write_text(json.dumps({"kernels": kernels, "grouped_gemm": moe}, indent=1))
        return {"kernels": kernels, "grouped_gemm": moe}
    steps, records = step_rows(spec, hw, args.device, args.kernels, dtype, args.reps, args.quick)
    show(steps)
    with open(out / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(StepRecord.columns())
        w.writerows(r.row() for r in records)
    quant = show(quant_rows(spec, hw, args, dtype, steps)) if args.quant else []
    result = {"model": spec.name, "hardware": hw.name, "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "kernels_backend": args.kernels, "dtype": args.dtype, "kernels": kernels, "steps": steps,
              "quant": quant, "grouped_gemm": moe}
    (out / "bench_gpu.json").write_text(json.dumps(result, indent=1))
    _write_rows(out / "kernels.csv", kernels)
    print(f"wrote {out}")
    return result


def _write_rows(path: Path, rows: list[dict]) -> None:
    """A section's rows as CSV, "op" first, the other columns sorted (rows may lack some)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}, key=lambda k: (k != "op", k)))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
