"""quantization_gain: 16-bit vs W4A16 vs int8 KV; the same work, then the highest load meeting the SLO.

Same work, engine: delegated to ``experiments.quant_study`` (decode step times measured on the engine and predicted
by the roofline, KV capacity, quality), written to ``same_work/`` with its own summary.md. Same work, simulator:
every setting at ``study.reference_rate``. Max load: ``capacity_under_slo``'s search (experiments.studies.capacity) per
setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from core import arithmetic
from core.specs import ModelSpec
from experiments import plots
from experiments.build import CONF_DIR
from experiments.config import plain
from experiments.studies.capacity_under_slo import (
    PANELS,
    attainment_target,
    capacity_bars,
    capacity_report,
    describe_search,
)
from experiments.studies.common import Report, fmt, run_variants

SAME_WORK = [("ttft_s.p50", "TTFT p50 (s)", 1.0), ("tpot_s.p50", "TPOT p50 (ms)", 1e3),
             ("itl_s.p99", "p99 ITL (ms)", 1e3), ("throughput_tok_s", "output throughput (tok/s)", 1.0),
             ("slo_attainment", "SLO attainment", 1.0)]


def quant_study_cfg(overrides: Sequence[str]) -> DictConfig:
    """conf/quant_study.yaml with ``overrides`` (inside a running Hydra app, or standalone)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("quant_study", overrides=list(overrides))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("quant_study", overrides=list(overrides))


def same_work_engine(rep: Report, overrides: Sequence[str], out: Path) -> None:
    from experiments.studies.quant_study import study

    r = study(quant_study_cfg(overrides), out / "same_work")
    gpu, cap = r["gpu"], r["capacity"]
    speed = {n: rep.number(f"gpu_predicted_speedup.{n}", gpu["batch"]["speedup"][n][0],
                           f"same_work/quant_study.json:gpu.batch.speedup.{n}.0") for n in r["settings"][1:]}
    measured = r["cpu"]["batch"]["speedup_measured"]
    rep.text("## Same work on the engine (experiments.studies.quant_study)",
             f"Decode at batch {r['cpu']['batch']['shapes'][0][0]}, context {r['cpu']['batch']['shapes'][0][1]}, "
             f"{r['model']} on {r['device']}: measured speed-up "
             + ", ".join(f"{n} {fmt(v[0])}x" for n, v in measured.items())
             + f". Roofline prediction for {gpu['model']} on {gpu['hardware']} at batch "
             f"{gpu['batch']['shapes'][0][0]}: " + ", ".join(f"{n} {v}x" for n, v in speed.items())
             + f". int8 KV holds {fmt(cap['gain']['num_kv_blocks'])}x the KV blocks of {r['dtype']} KV in the same "
             "memory. Details, figures and the "
             "quality gate: [same_work/summary.md](same_work/summary.md).")


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Quantisation gain: 16-bit vs W4A16 vs int8 KV")
    gain = arithmetic.kv_capacity_gain(ModelSpec.from_config(plain(cfg.model)), 8)
    rep.text(f"Simulator: {cfg.model.name} on {cfg.hardware.name}, roofline with weight_bits / kv_bits per setting "
             f"(the KV pool is sized with the bytes per token, int8 KV's float32 scales included, so int8 KV holds "
             f"{fmt(gain)}x the tokens of model-dtype KV). " + describe_search(cfg))
    if cfg.study.same_work:
        same_work_engine(rep, list(cfg.study.same_work_overrides), out)
    else:
        rep.text("Same work on the engine skipped (study.same_work=false).")
    ref = float(cfg.study.reference_rate)
    key = cfg.study.capacity.rate_key
    at_ref = run_variants(cfg, {k: [*v, f"{key}={ref!r}"] for k, v in cfg.study.variants.items()},
                          out / "same_work_sim")
    rep.text(f"## Same work in the simulator: every setting at {ref:g} req/s")
    rep.metric_table(at_ref, SAME_WORK, first="setting")
    fig = plots.metric_bars(at_ref, SAME_WORK, out / "same_work_sim.png")
    rep.figure(fig, f"Every setting at {ref:g} req/s in the simulator (dashed: the TTFT SLO)")
    bars: dict = {}
    curves = capacity_report(rep, cfg, out, "setting", "Max load under the SLO", bars=bars)
    capacity_bars(rep, bars, out / "quantization_capacity.png", "setting")
    fig = plots.metric_curves(curves, PANELS, out / "quantization_gain.png", "request rate (req/s)",
                              targets=attainment_target(cfg))
    rep.figure(fig, f"Every probe of the searches: SLO attainment (capacity where it crosses "
                    f"{cfg.study.capacity.target}), goodput and tail latency per setting against the request rate")
    return rep
