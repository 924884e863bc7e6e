"""`python -m experiments.compare`: one held-out workload through the engine and the calibrated simulator.

The root config is the *held-out* workload. Each comparison writes into its output directory:

1. ``engine/``: the engine run. With ``compare.train`` (overrides making a *training* workload) and no fixed
   ``compare.calibration``, the training workload runs on the engine alongside it, the two taking turns step by
   step (``experiments.run.run_interleaved``) so that a shared machine's drift hits both alike; it stops when the
   held-out run ends (``train/``).
2. ``calibration/``: ``compare.calibration=<file>`` is used as given; otherwise ``experiments.calibrate`` fits the
   profile grid (measured once, reused by every rate point) plus the training steps measured alongside.
3. ``replay/``: the simulator with the engine's measured durations (``sim.replay``). Its requests.csv and
   tokens.csv must equal the engine's byte for byte: the logic error is zero and every remaining difference
   below is the cost model's.
4. ``sim/``: the simulator with the calibrated cost model (same config, seed and KV pool).
5. ``latency_cdfs.png`` (engine vs sim), ``step_scatter.png`` (the model on the engine's own steps), ``errors.md``
   / ``errors.json`` (relative error of each percentile, (sim - engine) / engine), ``compare.json``; with
   ``compare.rates``, ``rates/<rate>/`` (a comparison per rate), ``rates.json`` and ``rate_curves.png``.

A fixed calibration on many held-out workloads: ``python -m experiments.compare +sweep=heldout
compare.calibration=<dir>/linear.yaml``. See docs/calibration.md.

A measured black box instead of our engine: ``compare.measured=<dir or .json>`` takes a loadgen run directory (any
OpenAI-compatible server: ours, vLLM, SGLang) or a vLLM ``bench serve --save-result --save-detailed`` JSON as the
measured side (with the server's KV pool when the run directory has its ``/metrics`` telemetry,
``server_metrics.json``). There is no engine run, no replay and no step data; the calibration is
``compare.calibration`` or fitted here from ``calibrate.runs`` (request-level profiling runs against the same
server). The simulator runs the measured run's own workload: the ``workload`` section of its config.yaml when it
has one (loadgen writes it: same requests, same prefix sharing), else a request list of its requests.csv (arrivals
and lengths, no sharing).
See docs/serving.md. A recorded GPU vLLM run (``shared/data/gpu-groundtruth/llmservingsim/<GPU>/<model>``) is
simulated under its own engine settings with the published operator profiles (``experiments.calibration.groundtruth``,
docs/calibration.md).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.output import has_table, read_metrics, read_step_features, read_timing
from experiments.build import run_summary_options
from experiments.calibration import groundtruth
from experiments.calibration.calibrate import calibrate, describe, group_of
from experiments.calibration.draws import band_cells, band_summary, headline, simulate_draws, with_band
from experiments.calibration.interleave import run_interleaved
from experiments.calibration.profiler import run_profile
from experiments.cli import hydra_app
from experiments.config import RunConfig
from experiments.overrides import apply_overrides, with_backend, with_calibration
from experiments.run import replay, run, same_files
from sim.cost.calibrated import load_calibration
from sim.fit import FitReport, predict, report

log = logging.getLogger(__name__)

METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
PERCENTILES = (50, 90, 99)


def logic_check(cfg: DictConfig, engine_dir: Path, out_dir: Path) -> dict[str, Any]:
    """Replay the engine run; zero logic error = identical requests.csv and tokens.csv."""
    from sim.replay import ReplayDivergence

    try:
        replay(cfg, engine_dir, out_dir)
    except ReplayDivergence as e:
        return {"identical": False, "divergence": str(e)}
    files = same_files(engine_dir, out_dir)
    return {"identical": all(files.values()), "files": files, "divergence": None}


# ---- errors -------------------------------------------------------------------------------------------------
def rel_error(predicted: float | None, reference: float | None) -> float | None:
    if predicted is None or reference is None or reference == 0:
        return None
    return (predicted - reference) / reference


def percentile_errors(reference: Mapping[str, Any], predicted: Mapping[str, Any], metrics: Sequence[str] = METRICS,
                      percentiles: Sequence[int] = PERCENTILES) -> list[dict[str, Any]]:
    """One row per (metric, percentile): reference (engine) value, predicted (sim) value, relative error."""
    rows = []
    for m in metrics:
        for p in percentiles:
            ref, pred = (reference.get(m) or {}).get(f"p{p}"), (predicted.get(m) or {}).get(f"p{p}")
            rows.append({"metric": m, "percentile": f"p{p}", "engine": ref, "sim": pred,
                         "rel_error": rel_error(pred, ref)})
    for m in ("throughput_tok_s", "goodput_rps", "slo_attainment"):
        rows.append({"metric": m, "percentile": "", "engine": reference.get(m), "sim": predicted.get(m),
                     "rel_error": rel_error(predicted.get(m), reference.get(m))})
    return rows


def _num(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.1%}" if pct else f"{v:.4g}"


def errors_markdown(rows: Sequence[Mapping[str, Any]], title: str = "sim vs engine", reference: str = "engine") -> str:
    """``reference``: what the measured column is (the engine, or a black box's label). With a prediction band
    (step-noise draws) two more columns: the band and whether the measured value falls inside it."""
    banded = any(r.get("band_low") is not None for r in rows)
    header = f"| metric | percentile | {reference} | sim | rel. error (sim - {reference}) / {reference} |"
    header += " sim band | inside |" if banded else ""
    lines = [f"### {title}", "", header, "|---|---|---|---|---|" + ("---|---|" if banded else "")]
    lines += [f"| {r['metric']} | {r['percentile']} | {_num(r['engine'])} | {_num(r['sim'])} | "
              f"{_num(r['rel_error'], True)} |" + (band_cells(r) if banded else "") for r in rows]
    if banded:
        lines += ["", band_summary(rows)]
    return "\n".join(lines) + "\n"


def step_errors(cost_model: Any, run_dir: str | Path) -> tuple[FitReport, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The cost model priced on a run's own steps: report (R², relative errors per shape group) and
    {group: (measured, predicted)} for a scatter."""
    features, durations, _ = read_step_features(Path(run_dir) / "steps.csv")
    keep = [i for i, d in enumerate(durations.tolist()) if d > 0]
    features, y = [features[i] for i in keep], durations[keep]
    labels = [group_of(f) for f in features]
    p = predict(cost_model, features)
    lab = np.asarray(labels, dtype=object)
    return report(cost_model, features, y, labels), {g: (y[lab == g], p[lab == g]) for g in sorted(set(labels))}




# ---- the whole comparison -----------------------------------------------------------------------------------
def measured_run(cfg: DictConfig, source: str | Path, out_dir: Path) -> tuple[dict[str, Any], DictConfig]:
    """A black-box measurement as this comparison's measured side, written into ``out_dir``; returns its metrics and
    ``cfg`` with the workload the measurement ran (see the module docstring)."""
    import shutil

    from experiments.serving.bench_result import bench_serve_to_run

    src = Path(source)
    if src.is_file() and src.suffix == ".json":
        metrics = bench_serve_to_run(src, out_dir, run_summary_options(RunConfig.from_config(cfg)))
        workload_cfg = None
    elif has_table(src, "requests") and (src / "metrics.json").is_file():
        if src.resolve() != out_dir.resolve():
            shutil.copytree(src, out_dir, dirs_exist_ok=True)
        metrics = read_metrics(out_dir / "metrics.json")
        recorded = OmegaConf.load(src / "config.yaml") if (src / "config.yaml").is_file() else None
        workload_cfg = recorded.get("workload") if recorded is not None else None
    else:
        raise ValueError(f"compare.measured={source}: neither a run directory (requests.csv + metrics.json) nor a "
                         "vLLM bench serve .json")
    if workload_cfg is None:
        workload_cfg = {"_target_": "core.workload.RequestList", "path": str(_request_list(out_dir)), "seed": 0}
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.workload = OmegaConf.create(OmegaConf.to_container(workload_cfg, resolve=True)
                                    if OmegaConf.is_config(workload_cfg) else workload_cfg)
    return metrics, out


def _request_list(run_dir: Path) -> Path:
    """The requests of a measured run as a request list (arrival, lengths) for the simulator. A request that
    produced no output (rejected, timed out before its first token) is simulated with one output token."""
    import csv

    from core.output import fmt, read_requests

    r = read_requests(run_dir)  # requests.csv or requests.parquet
    path = run_dir / "request_list.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["id", "arrival_s", "prompt_tokens", "output_tokens", "warmup"])
        warmup = r["warmup"].tolist() if "warmup" in r else [False] * len(r["id"])
        for i, a, n, o, wu in zip(r["id"].tolist(), r["arrival_s"].tolist(), r["prompt_tokens"].tolist(),
                                  r["output_tokens"].tolist(), warmup, strict=True):
            w.writerow([i, fmt(a), fmt(n), max(1, int(o if o == o else 0)), int(wu)])
    return path


def evaluate(cfg: DictConfig, out_dir: str | Path, plots_too: bool = True) -> dict[str, Any]:
    """One comparison point: the engine run (alongside the training run when calibrating here with
    ``compare.train``) or a measured black box (``compare.measured``), the calibration, the replay check (engine
    only), the simulation, the errors and (``plots_too``) figures."""
    c = cfg.compare
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if c.get("measured") and groundtruth.is_groundtruth(c.measured):  # a recorded GPU vLLM run, priced from profiles
        return groundtruth.evaluate(cfg, out)
    if c.get("measured"):
        return _evaluate_measured(cfg, out, plots_too)
    engine_cfg = with_backend(cfg, "engine")
    summary: dict[str, Any] = {"held_out": {"workload": cfg.workload.get("_target_"),
                                            "scheduler": cfg.scheduler.get("_target_")}}
    stages, extra = ["engine"], []
    if c.train and not c.calibration:  # the training run goes step by step in turn with the held-out one
        train_cfg = apply_overrides(engine_cfg, list(c.train))
        runs = run_interleaved({"engine": engine_cfg, "train": train_cfg},
                               {"engine": out / "engine", "train": out / "train"}, primary="engine")
        engine = runs["engine"]
        stages.append("train")
        extra.append((out / "train", runs["train"]["paired_steps"]))  # only the steps measured alongside
        summary["paired_steps"] = {k: v["paired_steps"] for k, v in runs.items()}
    else:
        engine = run(engine_cfg, out / "engine")
    if c.calibration:
        cal_path = Path(c.calibration)
        summary["calibration"] = {"path": str(cal_path.resolve()), "fitted_here": False}
    else:
        cal = calibrate(engine_cfg, out / "calibration", extra_steps=extra)
        cal_path = cal.path(c.fit)
        summary["calibration"] = {"path": str(cal_path.resolve()), "fitted_here": True, "train": list(c.train or []),
                                  "fit": {k: r.to_dict() for k, r in cal.reports.items()}, "text": describe(cal)}
    sim_cfg = with_calibration(cfg, cal_path)
    sim_run = RunConfig.from_config(sim_cfg)
    cost_model = load_calibration(cal_path, sim_run.model, sim_run.hardware)
    # median signed relative error of the model on each engine run's steps: the training run's is the fit's own
    summary["step_bias"] = {s: step_errors(cost_model, out / s)[0].median_signed_rel_error for s in stages}
    if c.replay:
        summary["logic"] = logic_check(cfg, out / "engine", out / "replay")
    if engine.get("draft_acceptance_alpha") is not None:  # speculative decoding: the engine's measured acceptance;
        # the calibrated steps (verify shapes measured with the proposer) already include a draft model's passes
        drafts = [f"spec.acceptance_rate={engine['draft_acceptance_alpha']!r}"]
        drafts += ["spec.draft_cost=included"] if cfg.spec.method == "draft" else []
        sim_cfg = apply_overrides(sim_cfg, drafts)
        summary["draft_acceptance_alpha"] = engine["draft_acceptance_alpha"]
    sim, summary["sim_draws"] = simulate_draws(sim_cfg, out / "sim")
    rows = with_band(percentile_errors(engine, sim, list(c.metrics), list(c.percentiles)),
                     (summary["sim_draws"] or {}).get("band"))
    summary["errors"], summary["sim_metrics"], summary["in_band"] = rows, sim, band_summary(rows)
    (out / "errors.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "errors.md").write_text(errors_markdown(rows))
    steps_report, scatter = step_errors(cost_model, out / "engine")
    summary["held_out_steps"] = steps_report.to_dict()
    summary["engine_clock"] = engine.get("engine_clock")
    summary["wall_s"] = {k: read_timing(out / k).get("wall_s") for k in ("engine", "sim")}
    summary["metrics"] = {"engine": headline(engine), "sim": headline(sim)}
    summary["plots"] = {}
    if plots_too:
        from experiments import plots

        sim_label = "sim (calibrated, one noise draw)" if summary["sim_draws"] else "sim (calibrated)"
        runs = {"engine": plots.load_run(out / "engine"), sim_label: plots.load_run(out / "sim")}
        summary["plots"] = {
            "latency_cdfs": str(plots.latency_cdfs(runs, out / "latency_cdfs.png", "held-out workload: engine vs sim")),
            "step_scatter": str(plots.predicted_vs_measured(
                {f"calibrated model, held-out engine steps (R² {steps_report.r2:.3f})": scatter},
                out / "step_scatter.png"))}
    return summary


def _evaluate_measured(cfg: DictConfig, out: Path, plots_too: bool) -> dict[str, Any]:
    c = cfg.compare
    measured, cfg = measured_run(cfg, c.measured, out / "engine")
    from experiments.calibration.simfit import telemetry_overrides
    from experiments.serving.loadgen.scrape import read_summary

    cfg = apply_overrides(cfg, telemetry_overrides(c.measured))  # the server's own KV pool, when it reported one
    summary: dict[str, Any] = {"measured": {"source": str(c.measured), "backend": measured.get("backend"),
                                            "workload": cfg.workload.get("_target_"),
                                            "server_telemetry": read_summary(c.measured)
                                            if Path(c.measured).is_dir() else None}}
    if c.calibration:
        cal_path = Path(c.calibration)
        summary["calibration"] = {"path": str(cal_path.resolve()), "fitted_here": False}
    elif cfg.calibrate.get("runs"):
        cal = calibrate(cfg, out / "calibration")
        cal_path = cal.path(c.fit)
        summary["calibration"] = {"path": str(cal_path.resolve()), "fitted_here": True, "text": describe(cal)}
    else:
        raise ValueError("compare.measured needs compare.calibration=<linear.yaml> or calibrate.runs=[...] "
                         "(request-level profiling runs against the same server)")
    sim, summary["sim_draws"] = simulate_draws(with_calibration(cfg, cal_path), out / "sim")
    rows = with_band(percentile_errors(measured, sim, list(c.metrics), list(c.percentiles)),
                     (summary["sim_draws"] or {}).get("band"))
    summary["errors"], summary["sim_metrics"], summary["in_band"] = rows, sim, band_summary(rows)
    (out / "errors.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "errors.md").write_text(errors_markdown(rows, title="sim vs measured", reference="measured"))
    summary["metrics"] = {"measured": headline(measured), "sim": headline(sim)}
    summary["plots"] = {}
    if plots_too:
        from experiments import plots

        sim_label = "sim (calibrated, one noise draw)" if summary["sim_draws"] else "sim (calibrated)"
        runs = {str(measured.get("backend") or "measured"): plots.load_run(out / "engine"),
                sim_label: plots.load_run(out / "sim")}
        summary["plots"]["latency_cdfs"] = str(plots.latency_cdfs(runs, out / "latency_cdfs.png",
                                                                  "held-out workload: measured vs sim"))
    return summary


def compare(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """The held-out comparison, then (``compare.rates``) the same at each request rate: on the engine each rate
    point is its own comparison (with its own training run alongside when calibrating here; the profile is
    measured once and reused), or with ``compare.rate_backends=[sim]`` only simulated with the main calibration."""
    if cfg.compare.get("measured") and groundtruth.is_groundtruth(cfg.compare.measured):
        cfg = apply_overrides(cfg, ["compare.rates=[]"])  # one recorded run: no rate sweep to measure
    c = cfg.compare
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    unknown = sorted(set(c.rate_backends) - {"sim", "engine"})
    if unknown or not c.rate_backends:
        raise ValueError(f"compare.rate_backends={list(c.rate_backends)}; allowed: [sim, engine] or [sim]")
    if c.get("measured") and c.rates:
        raise ValueError("compare.measured compares one measured run; set compare.rates=[] (measure each rate with "
                         "loadgen and compare each)")
    if not c.get("measured") and not c.calibration and cfg.calibrate.profile and not cfg.calibrate.get("profile_from"):
        engine = RunConfig.from_config(with_backend(cfg, "engine"))
        profile_csv = run_profile(engine, cfg.calibrate, out / "calibration")
        cfg = apply_overrides(cfg, [f"calibrate.profile_from={profile_csv}"])
    summary = evaluate(cfg, out)
    summary.pop("sim_metrics")  # the simulator's (median) metrics: its headline is in summary["metrics"]
    if c.rates:
        if OmegaConf.select(cfg, c.rate_key) is None:
            raise ValueError(f"compare.rate_key={c.rate_key!r} is not a key of this workload "
                             f"({cfg.workload.get('_target_')}); set compare.rate_key or compare.rates=[]")
        curves: dict[str, dict[float, dict[str, Any]]] = {}
        base = ["compare.rates=[]"] + ([f"workload.num_requests={c.rate_num_requests}"] if c.rate_num_requests else [])
        for r in map(float, c.rates):
            point_cfg = apply_overrides(cfg, [*base, f"{c.rate_key}={r!r}"])
            d = out / "rates" / f"{r:g}"
            if "engine" in c.rate_backends:
                point = evaluate(point_cfg, d, plots_too=False)
                curves.setdefault("engine", {})[r] = read_metrics(d / "engine" / "metrics.json")
                curves.setdefault("sim", {})[r] = point["sim_metrics"]
            else:
                curves.setdefault("sim", {})[r] = simulate_draws(
                    with_calibration(point_cfg, summary["calibration"]["path"]), d / "sim")[0]
        (out / "rates.json").write_text(json.dumps({k: {str(r): m for r, m in v.items()} for k, v in curves.items()},
                                                   indent=2, sort_keys=True) + "\n")
        from experiments import plots

        xlabel = plots.axis_label(c.rate_key)
        summary["plots"]["rate_curves"] = str(plots.rate_curves(curves, out / "rate_curves.png", xlabel=xlabel))
        summary["rates"] = {label: {str(r): headline(m) for r, m in v.items()} for label, v in curves.items()}
    summary["total_wall_s"] = time.perf_counter() - t0
    (out / "compare.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return summary


@hydra_app("compare")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    summary = compare(cfg, out)
    if "text" in summary["calibration"]:
        log.info(summary["calibration"]["text"])
    logic = summary.get("logic")
    if logic is not None:
        verdict = ("identical (logic error 0)" if logic["identical"]
                   else f"DIFFERS: {logic['divergence'] or logic['files']}")
        log.info(f"replay of the engine's step times: {verdict}")
    log.info(summary.get("errors_md") or errors_markdown(summary["errors"]))
    log.info(f"wrote {out}")


if __name__ == "__main__":
    main()
