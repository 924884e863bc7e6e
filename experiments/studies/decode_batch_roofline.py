"""decode_batch_roofline: decode step time and throughput vs batch size and context, roofline vs measured.

The roofline prices B decodes at context C as op groups: weight reads (linear layers + LM head, once per step) and
KV reads (B x C x KV bytes per token), each max(FLOPs / compute rate, bytes / bandwidth). ``roofline.csv`` holds
every shape; KV reads overtake weight reads once B x C x kv_bytes_per_token exceeds the weight bytes. With
``study.engine=true`` the engine times the engine-scale shapes (``experiments.calibration.calibrate.profile``) into
``measured.csv``, with the roofline fitted to those measurements alongside.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from core.batch import StepFeatures
from experiments import plots
from experiments.build import instantiate_group
from experiments.calibration.grid import Shape
from experiments.calibration.profiler import profile
from experiments.config import RunConfig
from experiments.studies.common import Report, backends, fmt, with_section
from sim.cost.roofline import RooflineCostModel
from sim.fit import fit_roofline

COLUMNS = ("context", "batch", "step_s", "tokens_per_s", "weights_s", "kv_s", "weight_bytes", "kv_bytes",
           "fits_memory")


def decode_features(batch: int, context: int) -> StepFeatures:
    """``batch`` decodes, each attending to ``context`` tokens (its new one included)."""
    return StepFeatures(num_seqs=batch, num_batched_tokens=batch, num_decode_seqs=batch,
                        kv_tokens_read=batch * context, max_context_len=context, max_decode_context=context,
                        min_decode_context=context)


def roofline_rows(cost: RooflineCostModel, batches, contexts, kv_capacity_tokens: int,
                  step_s: dict | None = None) -> list[dict]:
    """One row per shape; ``step_s`` (shape -> seconds) replaces the roofline's step time (measured rows)."""
    rows = []
    for c in contexts:
        for b in batches:
            f = decode_features(b, c)
            t = cost.breakdown(f)
            rows.append({"context": c, "batch": b,
                         "step_s": step_s[(b, c)] if step_s else cost.step_time(f),
                         "weights_s": t["linear"] + t.get("moe", 0.0) + t["lm_head"],  # every weight byte streamed
                         "kv_s": t["attention_decode"], "weight_bytes": cost.weight_bytes_per_step,
                         "kv_bytes": cost.kv_bytes_per_token * b * c, "fits_memory": b * c <= kv_capacity_tokens})
            rows[-1]["tokens_per_s"] = b / rows[-1]["step_s"]
    return rows


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows({k: r[k] for k in COLUMNS} for r in rows)
    return path


def read_csv(path: Path) -> dict[str, np.ndarray]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {k: np.array([float(r[k]) if k != "fits_memory" else r[k] == "True" for r in rows]) for k in COLUMNS}


def roofline_of(run: RunConfig) -> RooflineCostModel:
    node = run.config.cost_model
    if node.get("_target_") == "sim.cost.roofline.RooflineCostModel":
        return instantiate_group(node, "cost_model", model=run.model, hardware=run.hardware)
    return RooflineCostModel(run.model, run.hardware)  # the default efficiencies


def crossover_text(t: dict[str, np.ndarray], rep: Report, key: str, src: str) -> str:
    """Per context, the smallest batch whose KV bytes reach the weight bytes (read from the CSV)."""
    parts = []
    for c in np.unique(t["context"]).tolist():
        sel = (t["context"] == c) & (t["kv_bytes"] >= t["weight_bytes"])
        b = int(t["batch"][sel].min()) if sel.any() else None
        parts.append(f"context {int(c)}: " + (f"batch {rep.number(f'{key}.crossover_batch.ctx{int(c)}', b, src)}"
                                              if b is not None else "not within the sweep"))
    return "; ".join(parts)


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Decode step time vs batch size and context: where KV reads overtake weight reads")
    sim = RunConfig.from_config(cfg)
    cost, spec, hw = roofline_of(sim), sim.model, sim.hardware
    capacity = sim.num_kv_blocks * sim.kv.block_size
    path = write_csv(out / "roofline.csv",
                     roofline_rows(cost, cfg.study.batch_sizes, cfg.study.contexts, capacity))
    t = read_csv(path)
    tables = {f"roofline {spec.name} on {hw.name}": t}
    best = int(np.argmax(np.where(t["fits_memory"], t["tokens_per_s"], 0)))
    rep.text(f"Roofline of {spec.name} on {hw.name} (compute_eff {cost.compute_eff}, bw_eff {cost.bw_eff}, "
             f"overhead {cost.overhead_s * 1e3:g} ms/step): {cost.weight_bytes_per_step / 1e9:.3g} GB of weights read "
             f"per step, {cost.kv_bytes_per_token / 1e3:.4g} kB of KV per context token; the KV pool holds "
             f"{capacity} tokens (shapes beyond it are marked in roofline.csv and cannot run).",
             "**KV reads overtake weight reads at** " + crossover_text(t, rep, "roofline", "roofline.csv") + ".",
             f"Highest decode throughput that fits memory: {fmt(t['tokens_per_s'][best])} tok/s at batch "
             f"{int(t['batch'][best])}, context {int(t['context'][best])} (step {fmt(t['step_s'][best], 1e3)} ms).")
    rep.table(["context", *(f"B={b}" for b in cfg.study.batch_sizes)],
              [[int(c), *(fmt(s, 1e3) + ("" if ok else "*") for s, ok in
                          zip(t["step_s"][t["context"] == c], t["fits_memory"][t["context"] == c], strict=True))]
               for c in np.unique(t["context"]).tolist()])
    rep.text("Decode step time (ms) from the roofline; * = does not fit the KV pool.")
    fig = plots.decode_roofline(tables, out / "decode_batch_roofline.png")
    rep.figure(fig, "Roofline decode step time, throughput and the weight vs KV read time per step against batch size")
    if "engine (cpu scale)" in backends(cfg):
        ecfg = with_section(cfg, cfg.study.engine_scale)
        shapes = [Shape("decode", f"b={b},ctx={c}", decodes=(c,) * b) for c in ecfg.study.contexts
                  for b in ecfg.study.batch_sizes]
        engine = RunConfig.from_config(ecfg)
        rows = profile(engine, shapes, int(ecfg.study.repeats), int(ecfg.study.warmup), engine.seed)
        measured = {(len(r.shape.decodes), r.shape.decodes[0]): r.median_s for r in rows}
        fitted, fit = fit_roofline([r.features for r in rows], [r.median_s for r in rows], engine.model,
                                   engine.hardware)
        cap = engine.num_kv_blocks * engine.kv.block_size
        args = (ecfg.study.batch_sizes, ecfg.study.contexts, cap)
        m = read_csv(write_csv(out / "measured.csv", roofline_rows(fitted, *args, step_s=measured)))
        f = read_csv(write_csv(out / "roofline_fitted.csv", roofline_rows(fitted, *args)))
        rep.text("## engine (cpu scale)",
                 f"The engine ({ecfg.model.name} on {ecfg.backend.device}, kernels "
                 f"{ecfg.backend.get('kernels', 'auto')}) timed {len(rows)} decode shapes (median of "
                 f"{ecfg.study.repeats}); the roofline fitted to them: "
                 f"compute_eff {fitted.compute_eff:.3g}, bw_eff {fitted.bw_eff:.3g}, overhead "
                 f"{fitted.overhead_s * 1e3:.3g} ms, "
                 f"median |relative error| {fit.median_rel_error:.1%}. Measured throughput at the largest shape: "
                 f"{fmt(m['tokens_per_s'][-1])} tok/s. KV bytes reach the weight bytes at "
                 + crossover_text(m, rep, "engine", "measured.csv") + ".")
        steps_only = {k: m[k] for k in ("context", "batch", "step_s")}  # measured: no op-group split
        fig = plots.decode_roofline({"roofline fitted": f, "engine measured": steps_only},
                                    out / "decode_engine_vs_roofline.png")
        rep.figure(fig, "CPU scale: engine-measured decode steps (dashed) against the roofline fitted to them (solid)")
    return rep
