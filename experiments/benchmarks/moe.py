"""MoE benchmark: decode throughput of the engine vs transformers ``generate`` on the same random-weight
mixture-of-experts checkpoint, weights, threads and prompts, at several batch sizes, measured in one run.

Usage: python -m experiments.bench_moe [--arch qwen3_moe|mixtral] [--experts 8] [--top-k 2] [--expert-width 704]
[--batches 1,8,32] [--waves 2] [--prompt 32] [--output 64] [--threads 1] [--repeats 3] [--kernels auto|torch|native].
Default model: the 44M Llama of experiments.bench_engine (4 layers, hidden 512, vocab 32000, fp32) with each MLP
replaced by 8 experts of half its width, top-2 (Qwen3-MoE layout, q/k norms). Per batch size, engine and
transformers runs alternate (experiments.bench_engine's serving loop and transformers batches); every figure is the
median over the repeats. Short prompts, so both throughputs are mostly decode; ``engine_decode_tok_s`` is the
engine's full-batch decode steps alone. No roofline here: the roofline cost model streams every expert's weights in
every step, which overstates a small batch's bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from core.specs import ModelSpec
from engine.loader import build_model
from experiments.benchmarks.engine import _engine_run, _hf_run
from kernels.cpu_gemm import native_gemm_name

WEIGHT_STD = 0.05  # transformers' initializer_range for the checkpoint: routers spread tokens over the experts


def make_moe_checkpoint(directory: str, arch: str, *, layers: int, hidden: int, experts: int, top_k: int,
                        expert_width: int, vocab: int, seed: int = 0):
    """Save a random float32 MoE checkpoint (transformers' own init, std WEIGHT_STD) and return the loaded
    transformers model (greedy, no EOS: it generates exactly max_new_tokens)."""
    import transformers

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=vocab, max_position_embeddings=2048, num_experts_per_tok=top_k,
                  initializer_range=WEIGHT_STD, torch_dtype="float32")
    if arch == "mixtral":  # experts as wide as intermediate_size
        config, cls = transformers.MixtralConfig(**common, intermediate_size=expert_width,
                                                 num_local_experts=experts), transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**common, head_dim=hidden // 8, intermediate_size=2 * expert_width,
                                             moe_intermediate_size=expert_width, num_experts=experts,
                                             norm_topk_prob=True)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cls(config).save_pretrained(directory, safe_serialization=True)
    hf = cls.from_pretrained(directory).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-width", type=int, default=704, help="intermediate size of one expert")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (max concurrent sequences)")
    p.add_argument("--waves", type=int, default=2, help="requests per batch size = waves * batch")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="alternating engine / transformers runs; medians reported")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "native"])
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        hf = make_moe_checkpoint(d, args.arch, layers=args.layers, hidden=args.hidden, experts=args.experts,
                                 top_k=args.top_k, expert_width=args.expert_width, vocab=args.vocab)
        spec = ModelSpec.from_pretrained(d)
        model = build_model(spec)
        with torch.inference_mode():
            hf.generate(torch.tensor([[5] * 8]), max_new_tokens=4, do_sample=False)  # warm-up
        for batch in [int(b) for b in args.batches.split(",")]:
            n = args.waves * batch
            g = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(6, spec.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(n)]
            outputs = [args.output] * n
            runs = [{**_engine_run(spec, model, prompts, outputs, batch, None, args.kernels),
                     **_hf_run(hf, prompts, outputs, batch)} for _ in range(args.repeats)]
            for r in runs:
                r["speedup_vs_hf"] = r["engine_tok_s"] / r["hf_tok_s"]
                r["cpu_speedup_vs_hf"] = r["engine_tok_per_cpu_s"] / r["hf_tok_per_cpu_s"]
                r["engine_decode_tok_s"] = 1e3 * batch / r["decode_step_ms"]
            keys = ("engine_tok_s", "hf_tok_s", "speedup_vs_hf", "cpu_speedup_vs_hf", "engine_decode_tok_s",
                    "decode_step_ms", "prefill_ms", "outside_forward_share")
            res = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
            res["speedup_vs_hf_runs"] = [round(r["speedup_vs_hf"], 3) for r in runs]
            results[f"batch_{batch}"] = res
            print(json.dumps({f"batch_{batch}": res}), flush=True)
    result = {"model": f"{args.arch} {args.layers}L hidden {args.hidden} vocab {args.vocab} fp32, {args.experts} "
                       f"experts of {args.expert_width}, top-{args.top_k}",
              "threads": args.threads, "small_batch_gemm": native_gemm_name(), "kernels": args.kernels,
              "repeats": args.repeats, "prompt": args.prompt, "output": args.output, **results}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
