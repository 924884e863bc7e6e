"""Do the arithmetic first: weight and KV bytes, KV capacity, and roofline prefill/decode bounds per batch size;
for a parallel deployment, what each device of each pipeline stage holds.

    python -m experiments.estimate model=llama2_70b hardware=h100 parallel.tp=4 quant.weight_bits=4
    python -m experiments.estimate model=qwen3_30b_a3b hardware=h100 parallel.dp=4 parallel.ep=4
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_bool, check_fraction, check_int, check_keys
from core.specs import HardwareSpec, ModelSpec, QuantSpec
from experiments.cli import hydra_app
from experiments.config import ParallelConfig, stage_memory
from sim.cost.base import as_hardware_spec, as_model_spec, decode_features, prefill_features
from sim.cost.roofline import RooflineCostModel

ESTIMATE_KEYS = ("batch_sizes", "context", "prefill_len", "memory_fraction", "block_size", "json")
ROOFLINE_KEYS = ("compute_eff", "bw_eff", "overhead_s", "weight_bits", "kv_bits", "group_size", "tp", "kernel_s",
                 "host_kernel_s")
PARALLEL_ONLY = ("pp", "dp", "ep", "moe_imbalance", "network_dir")  # roofline keys the step rows leave out


def _step(lower: RooflineCostModel, est: RooflineCostModel, f: StepFeatures, tokens: int) -> dict[str, Any]:
    """FLOPs, bytes and times of one step; the bound compares its arithmetic intensity with the ridge point.

    ``compute_share``: the fraction of the lower bound spent in op groups that are compute-limited (a step can
    be memory-bound overall while its linear layers are compute-bound, e.g. 4-bit weights at a large batch).
    """
    ops = lower.ops(f)
    flops, nbytes = sum(c.flops for c in ops.values()), sum(c.bytes for c in ops.values())
    intensity = flops / nbytes
    t_min, t_est = lower.step_time(f), est.step_time(f)
    compute_s = sum(lower.op_time(c) for c in ops.values() if c.flops / lower.hardware.peak_flops
                    > c.bytes / lower.hardware.mem_bw)
    ridge = lower.hardware.peak_flops / lower.hardware.mem_bw
    return {"flops": flops, "weight_bytes": lower.weight_bytes_per_step,
            "kv_bytes": ops["attention_prefill"].bytes + ops["attention_decode"].bytes, "bytes": nbytes,
            "intensity": intensity, "bound": "compute" if intensity >= ridge else "memory",
            "compute_share": compute_s / t_min,
            "time_lower_bound_s": t_min, "time_est_s": t_est,
            "tokens_per_s_max": tokens / t_min, "tokens_per_s_est": tokens / t_est}


def deployment_split(model: ModelSpec, hardware: HardwareSpec, parallel: ParallelConfig, *, weight_bits: int = 16,
                     kv_bits: int = 16, group_size: int = 128, memory_fraction: float = 0.9,
                     block_size: int = 16) -> dict[str, Any]:
    """What one device of each pipeline stage holds (``experiments.config.stage_memory``: the pool sizing's own
    numbers), the KV blocks its memory left after its weights holds, and the replica's pool: the fullest stage's
    blocks per device (each dp rank has a pool of that size; pp virtual engines split it)."""
    parallel.check(model)
    check_int(block_size, "estimate.block_size", 1)
    quant = QuantSpec(weight_bits=weight_bits, kv_bits=kv_bits, group_size=group_size)
    usable = memory_fraction * hardware.mem_bytes
    stages = [{"stage": i, "layers": [s.layers.start, s.layers.stop], "weight_bytes_per_device": s.weight_bytes,
               "kv_bytes_per_token_per_device": s.kv_bytes_per_token, "kv_bytes_per_block_per_device":
               s.kv_bytes_per_block, "kv_budget_bytes": usable - s.weight_bytes,
               "kv_blocks_per_device": max(0, int((usable - s.weight_bytes) // s.kv_bytes_per_block))}
              for i, s in enumerate(stage_memory(quant, model, parallel, block_size))]
    pool = min(st["kv_blocks_per_device"] for st in stages)
    out = {**dataclasses.asdict(parallel), "devices": parallel.devices, "block_size": block_size, "stages": stages,
           "kv_blocks_per_device": pool, "kv_blocks_per_virtual_engine": pool // parallel.pp, "kv_pools": parallel.dp}
    if model.moe is not None:
        out["experts_per_group"] = model.moe.num_experts // parallel.ep  # ep groups of experts ...
        out["devices_per_expert"] = parallel.tp * parallel.dp // parallel.ep  # ... each sharded over these
    return out


def estimate(model: ModelSpec, hardware: HardwareSpec, *, weight_bits: int = 16, kv_bits: int = 16,
             group_size: int = 128, tp: int = 1, compute_eff: float = 1.0, bw_eff: float = 1.0,
             overhead_s: float = 0.0, batch_sizes: Sequence[int] = (1, 8, 32, 128, 256), context: int = 2048,
             prefill_len: int = 2048, memory_fraction: float = 0.9, pp: int = 1, dp: int = 1, ep: int = 1,
             block_size: int = 16, kernel_s: float | None = None, host_kernel_s: float = 0.0) -> dict[str, Any]:
    """All numbers per device. Lower bounds use datasheet peaks; ``*_est`` use the given efficiencies + overhead.

    The quantised speed-up is the estimated 16-bit decode step time over the quantised one at the same batch.
    Bytes count what the engine stores (``core.arithmetic``): a scale and a zero point per quantised weight group,
    and int8 KV's float32 scales, so ``kv_capacity_gain`` of int8 KV is 2·Dh / (Dh + 4), not 2. ``active_params``:
    the parameters one token uses (a mixture of experts' top_k routed experts, not all of them). The step rows
    are one tensor-parallel replica's; ``parallel`` (``deployment_split``) is what each device of a tp x pp x dp
    (x ep) deployment holds, and ``memory`` (the KV budget, the sequences of ``context`` tokens one dp rank holds,
    whether the weights fit) is its fullest stage's.
    """
    if isinstance(batch_sizes, str | bytes) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise ValueError(f"estimate.batch_sizes={batch_sizes!r}; allowed: a non-empty list of integers >= 1")
    for b in batch_sizes:
        check_int(b, "estimate.batch_sizes", 1)
    check_int(context, "estimate.context", 1)
    check_int(prefill_len, "estimate.prefill_len", 1)
    check_fraction(memory_fraction, "estimate.memory_fraction")
    est = RooflineCostModel(model, hardware, compute_eff=compute_eff, bw_eff=bw_eff, overhead_s=overhead_s,
                            weight_bits=weight_bits, kv_bits=kv_bits, group_size=group_size, tp=tp,
                            kernel_s=kernel_s, host_kernel_s=host_kernel_s)  # None: the hardware's launch cost
    m, hw = est.model, est.hardware
    lower = est.replace(compute_eff=1.0, bw_eff=1.0, overhead_s=0.0, kernel_s=0.0,
                        host_kernel_s=0.0)  # peaks, no launches, no host
    base16 = est.replace(weight_bits=16) if weight_bits < 16 else None

    weights = ar.weight_bytes(m, weight_bits, group_size)
    split = deployment_split(m, hw, ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep), weight_bits=weight_bits,
                             kv_bits=kv_bits, group_size=group_size, memory_fraction=memory_fraction,
                             block_size=block_size)
    # what the devices of the deployment hold (pp stages, dp ranks' experts): the fullest stage bounds a dp rank
    budget = min(st["kv_budget_bytes"] for st in split["stages"])

    def seqs_of(bits: int) -> int:
        return min(ar.max_concurrent_seqs(m, st["kv_budget_bytes"], context, bits, tp, range(*st["layers"]))
                   for st in split["stages"])

    seqs = seqs_of(kv_bits)
    memory: dict[str, Any] = {"memory_fraction": memory_fraction, "context": context, "kv_budget_bytes": budget,
                              "weights_fit": budget > 0, "max_concurrent_seqs": seqs}
    if kv_bits < 16:  # the token capacity ratio (int8 scales included), not the ratio of rounded sequence counts
        memory |= {"max_concurrent_seqs_kv16": seqs_of(16), "kv_capacity_gain": ar.kv_capacity_gain(m, kv_bits)}

    decode = []
    for b in batch_sizes:
        f = decode_features(b, context)
        row = {"batch_size": b, **_step(lower, est, f, b), "fits": b <= seqs}
        if base16 is not None:
            row["quant_speedup"] = base16.step_time(f) / est.step_time(f)
        decode.append(row)
    return {
        "model": m.name, "hardware": hw.name, "per_device": True, **est.params(),
        "params": ar.total_params(m), "active_params": ar.active_params(m),
        "weight_bytes": weights, "weight_bytes_per_device": weights / tp,
        "weight_bytes_16bit": ar.weight_bytes(m, 16, group_size),
        "kv_bytes_per_token": ar.kv_bytes_per_token(m, kv_bits),
        "kv_bytes_per_token_per_device": est.kv_bytes_per_token,
        "ridge_point": hw.peak_flops / hw.mem_bw, "memory": memory,
        "prefill": {"tokens": prefill_len, **_step(lower, est, prefill_features(prefill_len), prefill_len)},
        "decode": decode,
        "parallel": split,
    }


def _si(x: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def format_table(r: dict[str, Any]) -> str:
    mem, p = r["memory"], r["prefill"]
    quant = r["weight_bits"] < 16
    lines = [
        f"{r['model']} on {r['hardware']}: tp={r['tp']}, weights {r['weight_bits']}-bit"
        + (f" (group {r['group_size']})" if quant else "") + f", KV {r['kv_bits']}-bit; numbers per device;"
        f" est = compute_eff {r['compute_eff']}, bw_eff {r['bw_eff']}, overhead {r['overhead_s'] * 1e3:.3g} ms",
        f"params {_si(r['params'], '')}"
        + (f" ({_si(r['active_params'], '')} active per token)" if r["active_params"] != r["params"] else "")
        + f" | weights {_si(r['weight_bytes'], 'B')}"
        + (f" (16-bit: {_si(r['weight_bytes_16bit'], 'B')})" if quant else "")
        + (f", {_si(r['weight_bytes_per_device'], 'B')} per device" if r["tp"] > 1 else "")
        + f" | KV/token {_si(r['kv_bytes_per_token'], 'B')}"
        + (f", {_si(r['kv_bytes_per_token_per_device'], 'B')} per device" if r["tp"] > 1 else "")
        + f" | ridge point {r['ridge_point']:.0f} FLOP/B",
        f"memory: {mem['memory_fraction']} of device - weights = {_si(mem['kv_budget_bytes'], 'B')} for KV -> "
        f"{mem['max_concurrent_seqs']} concurrent sequences of {mem['context']} tokens"
        + ("" if mem["weights_fit"] else "  (WEIGHTS DO NOT FIT: raise tp or quantise)"),
    ]
    if "kv_capacity_gain" in mem:
        lines.append(f"  vs 16-bit KV: {mem['max_concurrent_seqs_kv16']} sequences ({r['kv_bits']}-bit KV holds "
                     f"{mem['kv_capacity_gain']:.3g}x the tokens, its scales included)")
    lines.append(f"prefill {p['tokens']} tokens: {_si(p['flops'], 'FLOP')}, {_si(p['bytes'], 'B')}, "
                 f"intensity {p['intensity']:.0f} FLOP/B, {p['bound']}-bound ({p['compute_share']:.0%} compute-"
                 f"limited), >= {p['time_lower_bound_s'] * 1e3:.3g}"
                 f" ms (est {p['time_est_s'] * 1e3:.3g} ms, {_si(p['tokens_per_s_est'], 'tok/s')})")
    lines += _split_lines(r["parallel"])
    lines.append(f"decode steps at context {mem['context']}:")
    head = ["batch", "FLOPs", "weights", "KV read", "FLOP/B", "bound", "compute %", "t_min ms", "t_est ms", "tok/s max",
            "tok/s est", "fits"] + ([f"W{r['weight_bits']} speed-up"] if quant else [])
    rows = [[str(d["batch_size"]), _si(d["flops"], ""), _si(d["weight_bytes"], "B"), _si(d["kv_bytes"], "B"),
             f"{d['intensity']:.1f}", d["bound"], f"{d['compute_share']:.0%}", f"{d['time_lower_bound_s'] * 1e3:.3g}",
             f"{d['time_est_s'] * 1e3:.3g}", f"{d['tokens_per_s_max']:.0f}", f"{d['tokens_per_s_est']:.0f}",
             "yes" if d["fits"] else "no"] + ([f"{d['quant_speedup']:.2f}x"] if quant else [])
            for d in r["decode"]]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    return "\n".join(lines)


def _split_lines(par: dict[str, Any]) -> list[str]:
    """The per-device split of a deployment beyond one device (none for tp = pp = dp = ep = 1)."""
    if par["devices"] == 1 and par["ep"] == 1:
        return []
    moe = f"; {par['experts_per_group']} experts per ep group, each over {par['devices_per_expert']} device(s)" \
        if "experts_per_group" in par else ""
    lines = [f"deployment tp={par['tp']} pp={par['pp']} dp={par['dp']} ep={par['ep']}: {par['devices']} devices per "
             f"replica{moe}; one device of each stage holds:"]
    head = ["stage", "layers", "weights", "KV/token", f"KV/block ({par['block_size']} tok)", "KV budget", "KV blocks"]
    rows = [[str(s["stage"]), f"{s['layers'][0]}-{s['layers'][1] - 1}", _si(s["weight_bytes_per_device"], "B"),
             _si(s["kv_bytes_per_token_per_device"], "B"), _si(s["kv_bytes_per_block_per_device"], "B"),
             _si(s["kv_budget_bytes"], "B"), str(s["kv_blocks_per_device"])] for s in par["stages"]]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    lines.append(f"KV pool: {par['kv_blocks_per_device']} blocks per device (the fullest stage)"
                 + (f", {par['kv_blocks_per_virtual_engine']} per virtual engine (pp={par['pp']})" if par["pp"] > 1
                    else "") + (f", one pool per dp rank ({par['kv_pools']})" if par["kv_pools"] > 1 else ""))
    return lines


def run(cfg: DictConfig) -> dict[str, Any]:
    """The estimate for a composed ``estimate`` config (what ``main`` prints)."""
    opts = OmegaConf.to_container(cfg.estimate, resolve=True)
    check_keys("estimate", opts, ESTIMATE_KEYS)
    check_bool(opts.get("json", False), "estimate.json")
    cm = OmegaConf.to_container(cfg.cost_model, resolve=True)
    target = cm.pop("_target_", None)
    if not target or not issubclass(get_class(target), RooflineCostModel):
        raise ValueError(f"cost_model._target_={target!r}; the estimate needs a roofline cost model "
                         "(cost_model=roofline)")
    cm.pop("model", None), cm.pop("hardware", None)
    for key in PARALLEL_ONLY:  # the step rows are one tensor-parallel replica's; the split reads cfg.parallel
        cm.pop(key, None)
    par = cfg.get("parallel") or {}
    opts |= {k: par[k] for k in ("pp", "dp", "ep") if k in par}
    check_keys("cost_model", cm, ROOFLINE_KEYS)
    opts.pop("json", None)
    return estimate(as_model_spec(cfg.model), as_hardware_spec(cfg.hardware), **cm, **opts)


@hydra_app("estimate")
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    print(json.dumps(result) if cfg.estimate.get("json", False) else format_table(result))


if __name__ == "__main__":
    main()
