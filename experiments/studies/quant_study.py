"""`python -m experiments.quant_study`: W4A16 weights and int8 KV, measured on the engine and predicted by the
roofline, plus the quality gate and the KV capacity gain. Config: conf/quant_study.yaml (``quick=true`` for a
seconds-long smoke run).

Settings: ``base`` (unquantised, the model dtype) and each of ``quant_settings``. Output files in the run dir:

- ``quant_study.json``: every number below; ``summary.md``: the same as tables, with what it means;
- ``quant_step_times.png``: decode step time vs batch size and vs context, measured and predicted;
- ``quant_speedup.png``: base time / quantised time, measured vs predicted (CPU), and the GPU prediction;
- ``quality.json``: the quality gate (engine.quality).

Engine: decode batches admitted to a KVCacheManager with core.shapes (no scheduler), the (setting, shape) pairs timed
in a fresh random order each round so a shared machine's drift spreads over all of them; median of ``repeats``
after ``warmup`` rounds. The context's KV is zeros (decode cost does not depend on the values). Simulator: the
roofline's step time for the same batches' features (what the sim backend's executor charges), once with the
configured efficiencies (``conf``) and once with efficiencies fitted to the measured base steps (``fit``), so the
fitted prediction isolates what the cost model says quantisation changes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_int, check_keys
from core.kv_cache import KVCacheManager
from core.shapes import ShapedBatch, shape_blocks
from core.specs import HardwareSpec, ModelSpec, QuantSpec
from engine.attention import allocate_kv_caches
from engine.executor import EngineExecutor, build_engine_executors, resolve_kernels
from engine.options import EngineOptions
from engine.quality import QuantSetting
from experiments.cli import hydra_app
from experiments.config import KVConfig, RunConfig, conf_option, num_kv_blocks
from experiments.studies.quant_quality import DTYPES, effective, resolve_group_size, run_quality, settings
from policies.eviction.lru import LRUEviction
from sim.cost.base import decode_features
from sim.cost.roofline import RooflineCostModel
from sim.fit import fit_roofline

log = logging.getLogger(__name__)

BASE = QuantSetting("base")
STUDY_KEYS = ("batch_sizes", "batch_context", "contexts", "context_batch", "repeats", "warmup", "kv_memory_bytes",
              "capacity_contexts", "gpu")
GPU_KEYS = ("model", "hardware", "group_size", "memory_fraction", "batch_sizes", "batch_context", "contexts",
            "context_batch")
ROOFLINE_CONF_KEYS = ("compute_eff", "bw_eff", "overhead_s", "tp")

Shape = tuple[int, int]  # (decode sequences, context tokens each, its new token included)


def sweeps(s: Mapping[str, Any]) -> dict[str, list[Shape]]:
    """The two decode sweeps of a study / gpu section: over batch size, and over context length."""
    for key in ("batch_sizes", "contexts"):
        v = s[key]
        if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
            raise ValueError(f"study.{key}={v!r}; allowed: a non-empty list of integers >= 1")
    for key in ("batch_context", "context_batch"):
        check_int(s[key], f"study.{key}", 1)
    if min(s["contexts"] + [s["batch_context"]]) < 2:
        raise ValueError("study contexts must be >= 2 (a decode attends to at least one earlier token)")
    return {"batch": [(b, s["batch_context"]) for b in s["batch_sizes"]],
            "context": [(s["context_batch"], c) for c in s["contexts"]]}


def quant_spec(q: QuantSetting) -> QuantSpec:
    """How a setting stores weights and KV (what both the engine and the roofline read)."""
    return QuantSpec(weight_bits=4 if q.quant == "w4a16" else 16, group_size=q.group_size,
                     kv_bits=ar.kv_bits_of(q.kv_dtype))


def quant_bits(q: QuantSetting) -> dict[str, int]:
    """The roofline's view of a setting."""
    return asdict(quant_spec(q))


# ---- engine measurement ---------------------------------------------------------------------------------------

def _executor(spec: ModelSpec, options: EngineOptions, q: QuantSetting, num_blocks: int, block_size: int,
              seed: int) -> EngineExecutor:
    kv = KVCacheManager(num_blocks, block_size, LRUEviction(), False)
    ex = build_engine_executors(spec, options, quant_spec(q), [kv], seed)[0]
    for c in ex.runner.kv_caches:  # defined contents (no stray NaN / denormal bit patterns) in the context KV
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                t.zero_()
    return ex


def measure_decode(spec: ModelSpec, backend: EngineOptions, quants: Sequence[QuantSetting],
                   shapes: Sequence[Shape], *, block_size: int, repeats: int, warmup: int,
                   seed: int = 0) -> tuple[dict[str, list[list[float]]], list[StepFeatures]]:
    """Seconds per decode step: {setting: [samples of each shape]}, and each shape's step features."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"study.repeats={repeats} must be >= 1 and study.warmup={warmup} >= 0")
    num_blocks = max(shape_blocks((), (c,) * b, block_size) for b, c in shapes)
    execs = {q.name: _executor(spec, backend, q, num_blocks, block_size, seed) for q in quants}
    # ``b`` decodes at ``context`` tokens per shape, admitted to the setting's KV pool for every timed execution
    states = {(q.name, i): ShapedBatch(decodes=(c,) * b, name=f"{q.name}-{i}") for q in quants
              for i, (b, c) in enumerate(shapes)}
    samples: dict[str, list[list[float]]] = {q.name: [[] for _ in shapes] for q in quants}
    features: list[StepFeatures] = [StepFeatures()] * len(shapes)
    pairs = list(states)
    rng = np.random.default_rng(seed)
    for r in range(warmup + repeats):
        for k in rng.permutation(len(pairs)).tolist():
            name, i = pairs[k]
            ex, st = execs[name], states[pairs[k]]
            batch = st.admit(ex.kv_manager)
            out = ex.execute(batch)
            st.release(ex.kv_manager)
            features[i] = batch.features
            if r >= warmup:
                samples[name][i].append(float(out.duration_s))
    return samples, features


# ---- predictions ------------------------------------------------------------------------------------------------

def conf_roofline(cfg: DictConfig, spec: ModelSpec, hw: HardwareSpec) -> RooflineCostModel:
    """The configured roofline (cost_model=roofline) for ``spec`` on ``hw``, unquantised."""
    cm = OmegaConf.to_container(cfg.cost_model, resolve=True)
    if "RooflineCostModel" not in str(cm.get("_target_", "")):
        raise ValueError(f"cost_model._target_={cm.get('_target_')!r}; the quant study needs cost_model=roofline")
    return RooflineCostModel(spec, hw, **{k: cm[k] for k in ROOFLINE_CONF_KEYS if k in cm})


def _speedups(times: Mapping[str, Sequence[float]]) -> dict[str, list[float]]:
    base = times["base"]
    return {name: [b / t for b, t in zip(base, ts, strict=True)] for name, ts in times.items() if name != "base"}


def gpu_prediction(cfg: DictConfig, quants: Sequence[QuantSetting]) -> dict[str, Any]:
    """Roofline decode times / speed-ups and KV capacity of a 7B/8B-class model on a GPU (prediction only)."""
    g = OmegaConf.to_container(cfg.study.gpu, resolve=True)
    check_keys("study.gpu", g, GPU_KEYS)
    spec = ModelSpec.from_mapping(conf_option("model", g["model"], "study.gpu.model"))
    hw = HardwareSpec.from_mapping(conf_option("hardware", g["hardware"], "study.gpu.hardware"))
    gq = [BASE] + [QuantSetting(q.name, q.quant, int(g["group_size"]), q.kv_dtype) for q in quants]
    base = conf_roofline(cfg, spec, hw)
    out: dict[str, Any] = {"model": spec.name, "hardware": hw.name, "group_size": int(g["group_size"]),
                           "roofline": base.params()}
    for sweep, shapes in sweeps(g).items():
        times = {q.name: [base.replace(**quant_bits(q)).step_time(decode_features(b, c)) for b, c in shapes]
                 for q in gq}
        out[sweep] = {"shapes": shapes, "predicted_s": times, "speedup": _speedups(times)}
    frac, contexts = float(g["memory_fraction"]), g["contexts"]
    cap = {}
    for q in gq:
        bits = quant_bits(q)
        budget = frac * hw.mem_bytes - ar.weight_bytes(spec, bits["weight_bits"], bits["group_size"])
        cap[q.name] = {"kv_budget_bytes": budget,
                       "max_seqs": [ar.max_concurrent_seqs(spec, budget, c, bits["kv_bits"]) for c in contexts]}
    out["capacity"] = {"memory_fraction": frac, "contexts": contexts, "settings": cap}
    return out


# ---- KV capacity -----------------------------------------------------------------------------------------------

def kv_capacity(cfg: DictConfig, spec: ModelSpec, hw: HardwareSpec) -> dict[str, Any]:
    """Blocks in ``study.kv_memory_bytes`` with model-dtype vs int8 KV: as the framework sizes pools
    (experiments.build.num_kv_blocks, from core.arithmetic) and as the engine's tensors take memory (the bytes of
    one block of ``allocate_kv_caches`` on the meta device: int8 + one float32 scale per token and head), and the
    sequences of each capacity context that fit. ``token_gain`` is core.arithmetic's per-token ratio, which the block
    ratios approach as the budget grows."""
    budget = float(cfg.study.kv_memory_bytes)
    bs = int(cfg.kv.block_size)
    dtype = DTYPES[spec.dtype]
    out: dict[str, Any] = {"memory_bytes": budget, "block_size": bs, "contexts": list(cfg.study.capacity_contexts)}
    for kv_dtype in ("auto", "int8"):
        kv = KVConfig(block_size=bs, memory_bytes=budget)
        blocks = {"num_kv_blocks": num_kv_blocks(kv, QuantSpec(kv_bits=ar.kv_bits_of(kv_dtype)), spec, hw),
                  "engine_tensors": int(budget // _engine_block_bytes(spec, bs, dtype, kv_dtype))}
        out[kv_dtype] = {k: {"blocks": n, "max_seqs": [n // -(-c // bs) for c in out["contexts"]]}
                         for k, n in blocks.items()}
    out["gain"] = {k: out["int8"][k]["blocks"] / out["auto"][k]["blocks"] for k in ("num_kv_blocks", "engine_tensors")}
    out["token_gain"] = ar.kv_capacity_gain(ModelSpec.from_mapping({**spec.to_dict(), "dtype": _dtype_name(dtype)}),
                                            ar.kv_bits_of("int8"))
    return out


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _engine_block_bytes(spec: ModelSpec, block_size: int, dtype, kv_dtype: str) -> int:
    """Bytes of one KV block as the engine allocates it (tensors on the meta device: no memory is touched)."""
    caches = allocate_kv_caches(spec, 1, block_size, dtype, "meta", kv_dtype)
    return sum(t.nbytes for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None)


# ---- the study ---------------------------------------------------------------------------------------------------

def _check_study(cfg: DictConfig) -> dict[str, Any]:
    s = OmegaConf.to_container(cfg.study, resolve=True)
    check_keys("study", s, STUDY_KEYS)
    return s


def study(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Run everything and write the files (module docstring); returns what ``quant_study.json`` holds."""
    t0 = time.perf_counter()
    cfg = effective(cfg)
    s = _check_study(cfg)
    run = RunConfig.from_config(cfg)
    spec, hw, backend = run.model, run.hardware, run.engine
    group = resolve_group_size(spec, cfg.get("quant_group_size"))
    quants = settings(cfg, group)
    names = [BASE.name] + [q.name for q in quants]
    if len(set(names)) != len(names):
        raise ValueError(f"quant_settings={list(cfg.quant_settings)}: names must be distinct and not 'base'")
    groups = sweeps(s)
    longest = max(c for shapes in groups.values() for _, c in shapes)
    if longest > spec.max_model_len:
        raise ValueError(f"study: context {longest} > model max_model_len {spec.max_model_len}")
    shapes = sorted({sh for v in groups.values() for sh in v})
    conf = conf_roofline(cfg, spec, hw)
    gpu, capacity = gpu_prediction(cfg, quants), kv_capacity(cfg, spec, hw)  # cheap: bad keys fail before timing
    samples, feats = measure_decode(spec, backend, [BASE, *quants], shapes, block_size=run.kv.block_size,
                                    repeats=int(s["repeats"]), warmup=int(s["warmup"]), seed=int(cfg.seed))
    median = {n: [float(np.median(x)) for x in samples[n]] for n in names}

    fitted, fit_report = fit_roofline(feats, median["base"], spec, hw)
    models = {"conf": conf, "fit": fitted}
    all_q = {q.name: q for q in [BASE, *quants]}
    cpu: dict[str, Any] = {}
    for sweep, sh in groups.items():
        idx = [shapes.index(x) for x in sh]
        entry: dict[str, Any] = {"shapes": sh, "measured_s": {n: [median[n][i] for i in idx] for n in names},
                                 "measured_min_s": {n: [min(samples[n][i]) for i in idx] for n in names}}
        for label, m in models.items():
            entry[f"predicted_{label}_s"] = {n: [m.replace(**quant_bits(all_q[n])).step_time(feats[i]) for i in idx]
                                             for n in names}
        for kind in ("measured", "measured_min", "predicted_conf", "predicted_fit"):
            entry[f"speedup_{kind}"] = _speedups(entry[f"{kind}_s"])
        cpu[sweep] = entry

    quality = run_quality(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    quality.write(out / "quality.json")
    result = {
        "model": spec.name, "checkpoint": spec.path, "hardware": hw.name,
        "dtype": spec.dtype, "kernels": resolve_kernels(backend.kernels, backend.device), "device": backend.device,
        "num_threads": backend.num_threads, "group_size": group, "settings": names,
        "quick": bool(cfg.get("quick", False)), "repeats": int(s["repeats"]), "warmup": int(s["warmup"]),
        "cpu": cpu,
        "roofline": {"conf": conf.params(), "fit": {**fitted.params(), "median_rel_error":
                                                    fit_report.median_rel_error}},
        "gpu": gpu, "capacity": capacity, "quality": quality.to_dict(),
    }
    result["wall_s"] = time.perf_counter() - t0
    (out / "quant_study.json").write_text(json.dumps(result, indent=2) + "\n")
    _figures(result, out)
    (out / "summary.md").write_text(summary(result))
    return result


def _figures(r: Mapping[str, Any], out: Path) -> None:
    from experiments import plots

    cpu, gpu = r["cpu"], r["gpu"]
    axes = {"batch": ("decode batch size", lambda sh: [b for b, _ in sh]),
            "context": ("context tokens per sequence", lambda sh: [c for _, c in sh])}

    def panel(title, sweep, data, ylabel, series):
        xlabel, xs = axes[sweep]
        return {"title": title, "xlabel": xlabel, "ylabel": ylabel, "x": xs(data[sweep]["shapes"]),
                "series": series, "logx": True}

    def where(sweep, data):
        b, c = data[sweep]["shapes"][0]
        return f"context {c}" if sweep == "batch" else f"batch {b}"

    times = [panel(f"{r['model']} on CPU, {where(sw, cpu)}", sw, cpu, "decode step time (ms)",
                   {n: {k: [t * 1e3 for t in cpu[sw][f"{k}_s"][n]] for k in ("measured", "predicted_fit")}
                    for n in r["settings"]}) for sw in ("batch", "context")]
    plots.measured_and_predicted_curves(times, out / "quant_step_times.png",
                                        "decode step time: measured (engine) vs roofline fitted on the base steps")
    speed = [panel(f"{r['model']} on CPU, {where(sw, cpu)}", sw, cpu, "base time / quantised time",
                   {n: {k: cpu[sw][f"speedup_{k}"][n] for k in ("measured", "predicted_fit", "predicted_conf")}
                    for n in r["settings"][1:]}) for sw in ("batch", "context")]
    speed += [panel(f"{gpu['model']} on {gpu['hardware']} (W4 g{gpu['group_size']}), {where(sw, gpu)}: predicted",
                    sw, gpu, "base time / quantised time",
                    {n: {"predicted_conf": gpu[sw]["speedup"][n]} for n in r["settings"][1:]})
              for sw in ("batch", "context")]
    plots.measured_and_predicted_curves(speed, out / "quant_speedup.png", "quantisation speed-up (1 = no change)",
                                hline=1.0, ncols=2)


# ---- summary -----------------------------------------------------------------------------------------------------

def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows])


def _x(v: float) -> str:
    return f"{v:.2f}x"


def summary(r: Mapping[str, Any]) -> str:
    """summary.md: every number from ``r`` (this run); the explanations depend on what was measured."""
    cpu, gpu, cap, qual = r["cpu"], r["gpu"], r["capacity"], r["quality"]
    quants = r["settings"][1:]
    fit = r["roofline"]["fit"]
    lines = [f"# Quantisation study: {r['model']} ({r['dtype']}) on {r['hardware']}, {r['kernels']} kernels",
             "",
             f"W4A16 group size {r['group_size']}; settings {', '.join(quants)} against `base` (unquantised, "
             f"{r['dtype']} weights and KV). Decode steps built directly against a KV pool; median of "
             f"{r['repeats']} timed runs after {r['warmup']} warm-up rounds, (setting, shape) order shuffled per "
             f"round; torch threads: {r['num_threads']}. Wall time of the study: {r['wall_s']:.1f} s"
             + (" (quick mode)." if r["quick"] else "."), "",
             "Predictions are the roofline's step times for the same batches (what the simulator charges): `conf` "
             "uses conf/cost_model/roofline.yaml's efficiencies on this hardware spec; `fit` uses efficiencies "
             f"fitted to the measured base steps (compute_eff {fit['compute_eff']:.3g}, bw_eff "
             f"{fit['bw_eff']:.3g}, overhead {fit['overhead_s'] * 1e3:.3g} ms; median |rel err| on the base "
             f"steps {fit['median_rel_error']:.1%}), so its speed-up is what the cost model says quantisation "
             "changes once the base case is right.", ""]
    for sweep, title in (("batch", "batch size"), ("context", "context length")):
        e = cpu[sweep]
        lines += [f"## Decode step time vs {title} (engine, measured)", ""]
        head = ["batch", "context"] + [f"{n} ms" for n in r["settings"]] + \
               [f"{n} speed-up meas / fit / conf" for n in quants]
        rows = []
        for i, (b, c) in enumerate(e["shapes"]):
            rows.append([b, c] + [f"{e['measured_s'][n][i] * 1e3:.3g}" for n in r["settings"]]
                        + [" / ".join(_x(e[f"speedup_{k}"][n][i]) for k in ("measured", "predicted_fit",
                                                                             "predicted_conf")) for n in quants])
        lines += [_table(head, rows), ""]
    def span(kind: str, n: str) -> tuple[float, float]:
        v = [x for sw in cpu.values() for x in sw[f"speedup_{kind}"][n]]
        return min(v), max(v)

    lines += ["## What was measured, and why", ""]
    for n in quants:
        (lo, hi), (mlo, mhi), (plo, phi) = span("measured", n), span("measured_min", n), span("predicted_fit", n)
        verdict = "slower than" if hi < 1 else "faster than" if lo > 1 else "mixed against"
        lines.append(f"- **{n}**: speed-up {_x(lo)}–{_x(hi)} from medians, {_x(mlo)}–{_x(mhi)} from fastest runs "
                     f"({verdict} base); the fitted roofline predicts {_x(plo)}–{_x(phi)}.")
    spread = max(m / f for sw in cpu.values() for n in r["settings"]
                 for m, f in zip(sw["measured_s"][n], sw["measured_min_s"][n], strict=True))
    lines.append(f"- Timing noise: the median of a shape is up to {_x(spread)} its fastest run; medians and minima "
                 "of every shape are in quant_study.json.")
    if r["kernels"] in ("torch", "native"):
        lines += ["", "On the torch (CPU) backend, `w4a16_linear_torch` unpacks and dequantises every 4-bit weight "
                  "matrix to float32 on every forward and then runs an ordinary float32 matmul, so it reads the "
                  "packed weights *and* writes and re-reads a full-precision copy: more memory traffic and extra "
                  "arithmetic, never less. The int8 KV path likewise gathers and dequantises the cached K/V before "
                  "attention. The roofline assumes a fused kernel that streams the packed bytes once (the Triton "
                  "W4A16 GEMM, which dequantises tiles in registers), which is where the bandwidth saving applies: "
                  "a memory-bound decode on a GPU. This run had no GPU, so the GPU numbers below are predictions "
                  "only; the CPU speed-ups measure the reference implementation, not the idea."]
    lines += ["", f"## Predicted on {gpu['hardware']}: {gpu['model']}, W4 group {gpu['group_size']} (roofline, conf "
              "efficiencies)", ""]
    for sweep in ("batch", "context"):
        e = gpu[sweep]
        rows = [[b, c, f"{e['predicted_s']['base'][i] * 1e3:.3g}"] + [_x(e["speedup"][n][i]) for n in quants]
                for i, (b, c) in enumerate(e["shapes"])]
        lines += [_table(["batch", "context", "base ms"] + [f"{n} speed-up" for n in quants], rows), ""]
    gc = gpu["capacity"]
    rows = [[n, f"{s['kv_budget_bytes'] / 1e9:.1f} GB"] + s["max_seqs"] for n, s in gc["settings"].items()]
    lines += [f"Max concurrent sequences on one {gpu['hardware']} ({gc['memory_fraction']} of memory minus the "
              "weights; W4 frees weight memory for KV too):", "",
              _table(["setting", "KV budget"] + [f"ctx {c}" for c in gc["contexts"]], rows), ""]
    lines += [f"## KV capacity of int8 ({cap['memory_bytes'] / 1e9:.3g} GB budget, block size {cap['block_size']})", ""]
    rows = []
    for k, label in (("num_kv_blocks", "framework (num_kv_blocks)"), ("engine_tensors", "engine tensors")):
        rows.append([label, cap["auto"][k]["blocks"], cap["int8"][k]["blocks"], _x(cap["gain"][k])]
                    + [f"{a} -> {b}" for a, b in zip(cap["auto"][k]["max_seqs"], cap["int8"][k]["max_seqs"],
                                                     strict=True)])
    lines += [_table(["sized by", f"blocks {r['dtype']}", "blocks int8", "gain"]
                     + [f"max seqs ctx {c}" for c in cap["contexts"]], rows), ""]
    lines += [f"int8 KV stores one float32 scale per (token, KV head) for K and for V besides the int8 elements, so "
              f"a budget holds {cap['token_gain']:.3g}x the tokens of {r['dtype']} KV, not the "
              f"{ar.DTYPE_BYTES[r['dtype']]}x of the element widths alone.", ""]
    if cap["gain"]["num_kv_blocks"] != cap["gain"]["engine_tensors"]:
        lines += ["The pool sizing (`num_kv_blocks`) and the engine's tensors disagree on the bytes per block: "
                  "the pool is sized for a different number of blocks than the memory really holds.", ""]
    lines += [f"## Quality gate ({qual['num_prompts']} prompts, {qual['prompt_tokens']} prompt tokens, "
              f"{qual['new_tokens']} new tokens each)", ""]
    rows = [[q["setting"], f"{q['max_abs_logit_err']:.3g}", f"{q['mean_abs_logit_err']:.3g}",
             f"{q['rel_logit_err']:.2%}", f"{q['top1_agreement']:.3f}", f"{q['kl_mean']:.3g}",
             f"{q['greedy_token_agreement']:.3f}", f"{q['greedy_first_divergence']:.1f}"] for q in qual["rows"]]
    lines += [_table(["setting", "max abs dlogit", "mean abs dlogit", "rel err", "top-1 agree", "KL mean",
                      "greedy agree", "first divergence"], rows), ""]
    if not r["checkpoint"]:
        lines += ["Quality on a random-weight model says how much the numbers move, not how much a trained model "
                  "loses; run `python -m experiments.quant_quality model.path=<checkpoint>` for that.", ""]
    return "\n".join(lines)


@hydra_app("quant_study")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    study(cfg, out)
    log.info((out / "summary.md").read_text())
    log.info(f"wrote {out.resolve()}")


if __name__ == "__main__":
    main()
