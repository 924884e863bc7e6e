"""`python -m experiments.calibrate`: time a grid of step shapes on a backend, fit the simulator's cost models.

The profile admits batches to the replica's KVCacheManager with core.shapes (no workload, no scheduler): each shape
is a set of prefill chunks (a chunk of ``n`` tokens after ``c`` cached ones) and decodes (one token attending to a
context), run ``warmup`` untimed then ``repeats`` timed times back to back like a run's consecutive steps (the
decodes advance one token per execution); the median is the shape's duration. The grid's ``auto`` values span the
model's context and the scheduler's budget and sequence limit; shapes beyond the KV pool are left out with a note
(``grid.json``). Engine steps are timed on the ``engine_clock`` stopwatch (thread CPU time on the one-thread CPU
engine: far steadier than the wall clock on a shared machine). Steps of earlier runs (``calibrate.steps=[run_dir,
...]``) can join or replace the profile; ``calibrate.profile_from`` reuses an earlier profile.csv;
``calibrate.runs=[run_dir, ...]`` reads runs without steps.csv (a loadgen run against any server, best of the
``profile_prefill`` / ``profile_decode`` workloads) through the step samples their request timings imply
(``experiments.calibration.samples.request_samples``). ``sim.fit`` fits the linear model and the roofline's
efficiencies, and the output directory gets:

- ``linear.yaml`` / ``roofline.yaml``: ready cost models; use one with
  ``python -m experiments.run cost_model=calibrated cost_model.path=<dir>/linear.yaml``
- ``linear.report.json`` / ``roofline.report.json`` and ``fit_report.json`` (both fits, per shape group, and the
  linear model's 5-fold cross-validated relative error)
- with ``calibrate.simulate_runs=[run_dir, ...]`` (loaded loadgen runs of one request list): ``simulated/
  calibrated.yaml``, the linear model's scales and the server terms fitted so that simulating those runs
  reproduces their TTFT / TPOT / ITL quantiles (``experiments.calibration.simfit``; ``calibrate.simulate`` holds
  its options), and ``simulated/simfit.json``;
- ``profile.csv`` (one row per shape: features, median / min / max seconds), ``grid.json`` (the resolved grid and
  the shapes left out) and ``calibration_scatter.png``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.batch import StepFeatures
from core.checks import check_bool
from experiments.calibration.grid import AUTO
from experiments.calibration.profiler import StepSource, read_profile, run_profile, run_steps
from experiments.calibration.samples import DEFAULT_TOLERANCE, request_samples_from_run
from experiments.cli import hydra_app
from experiments.config import RunConfig
from sim.cost.calibrated import write_calibration
from sim.fit import (
    FitReport,
    RequestFit,
    RequestSample,
    cross_validate,
    cross_validate_requests,
    fit_linear,
    fit_linear_requests,
    fit_roofline,
    predict,
)
from sim.noise import record_step_noise

log = logging.getLogger(__name__)
FITS = ("linear", "roofline")
CV_FOLDS = 5
LINEAR_TARGETS = ("mean", "relative")
MEAN_FIT_ITERATIONS = 3


def group_of(f: StepFeatures) -> str:
    """``StepFeatures.kind``, an empty step counted as a decode (the calibration data's groups)."""
    return "decode" if f.kind == "empty" else f.kind


@dataclass
class Calibration:
    """What ``calibrate`` produced: fitted models, their reports on the calibration data, and file paths."""

    models: dict[str, Any]
    reports: dict[str, FitReport]
    paths: dict[str, Path]
    features: list[StepFeatures]
    durations: np.ndarray
    labels: list[str]

    def path(self, fit: str) -> Path:
        if fit not in self.paths:
            raise ValueError(f"calibration has no {fit!r} fit; available: {sorted(k for k in self.paths if k in FITS)}")
        return self.paths[fit]


def fit_linear_mean(features: Sequence[StepFeatures], durations: np.ndarray, weights: Sequence[float] | None = None,
                    labels: Sequence[str] | None = None, iterations: int = MEAN_FIT_ITERATIONS):
    """The linear model fitted to the MEAN step time of each shape, on a relative scale.

    ``fit_linear``'s relative loss divides each error by the measured duration. Under multiplicative timing noise
    (lognormal with sigma ~0.2-0.3 on a shared CPU) that favours the fast draws and lands ~e^(-1.5 sigma²), i.e.
    5-15%, below the median, while a TPOT or an E2E latency is a sum of steps and follows their mean. Dividing by
    the model's own prediction instead (iteratively reweighted least squares, starting from the relative fit)
    keeps the relative scale and is unbiased for the mean.
    """
    model, rep = fit_linear(features, durations, weights, labels=labels)
    w = np.ones(len(durations)) if weights is None else np.asarray(weights, dtype=float)
    for _ in range(iterations):
        pred = predict(model, features)
        if not np.all(pred > 0):
            break  # a zero prediction (all-zero coefficients for a row) has no relative scale; keep the last fit
        model, rep = fit_linear(features, durations, w / pred, relative=False, labels=labels)
    return model, rep


def fit_all(run: RunConfig, features: Sequence[StepFeatures], durations: np.ndarray, labels: Sequence[str],
            fits: Sequence[str], weights: Sequence[float] | None = None,
            target: str = "mean") -> tuple[dict[str, Any], dict[str, FitReport]]:
    """The requested fits; ``weights`` (per measurement) and ``target`` (mean | relative, see ``fit_linear_mean``)
    apply to the linear fit (the roofline fit takes neither)."""
    unknown = sorted(set(fits) - set(FITS))
    if unknown or not fits:
        raise ValueError(f"calibrate.fits={list(fits)}; allowed: a non-empty subset of {list(FITS)}")
    if target not in LINEAR_TARGETS:
        raise ValueError(f"calibrate.linear_target={target!r}; allowed: {list(LINEAR_TARGETS)}")
    models, reports = {}, {}
    if "linear" in fits:
        fit = fit_linear_mean if target == "mean" else fit_linear
        models["linear"], reports["linear"] = fit(features, durations, weights, labels=labels)
    if "roofline" in fits:
        models["roofline"], reports["roofline"] = fit_roofline(features, durations, run.model, run.hardware,
                                                               labels=labels)
    return models, reports


def profiling(c: DictConfig) -> bool:
    """``calibrate.profile``: true, false, or auto (profile unless ``calibrate.runs`` are given: a server's
    request-level runs are another system than the configured backend)."""
    p = c.profile
    if p == AUTO:
        return not c.get("runs")
    if not isinstance(p, bool):
        raise ValueError(f"calibrate.profile={p!r}; allowed: true, false or auto")
    return p


def request_level_samples(c: DictConfig) -> tuple[list[RequestSample], dict[str, Any]]:
    """The step samples implied by ``calibrate.runs`` (run directories with requests.csv + tokens.csv, e.g.
    loadgen runs of the profile workloads against a server) and what was used to read them."""
    runs = [str(r) for r in (c.get("runs") or [])]
    chunk, tol = c.get("prefill_chunk"), c.get("tolerance", DEFAULT_TOLERANCE)
    samples: list[RequestSample] = []
    per_run = {}
    for r in runs:
        got = request_samples_from_run(r, chunk, tol)
        if not got:
            raise ValueError(f"calibrate.runs: {r} implies no step (no isolated request, no decode stretch with a "
                             "fixed batch); measure it with workload=profile_prefill / profile_decode")
        per_run[r] = {k: sum(s.kind == k for s in got) for k in ("ttft", "itl")}
        samples += got
    return samples, {"runs": runs, "prefill_chunk": chunk, "tolerance": tol, "samples": per_run}


def fit_with_requests(run: RunConfig, samples: Sequence[RequestSample], labels: Sequence[str],
                      fits: Sequence[str], target: str) -> tuple[dict[str, Any], dict[str, FitReport], RequestFit]:
    """The requested fits on request-level samples (and measured steps, ``kind="step"``): the linear model with a
    per-request TTFT overhead (``sim.fit.fit_linear_requests``); the roofline on the durations less that
    overhead."""
    unknown = sorted(set(fits) - set(FITS))
    if unknown or not fits:
        raise ValueError(f"calibrate.fits={list(fits)}; allowed: a non-empty subset of {list(FITS)}")
    rfit = fit_linear_requests(samples, target=target, labels=labels)
    models, reports = {}, {}
    if "linear" in fits:
        models["linear"], reports["linear"] = rfit.model, rfit.report
    if "roofline" in fits:
        y = np.array([s.duration_s - (rfit.request_overhead_s if s.kind == "ttft" else 0.0) for s in samples])
        keep = np.flatnonzero(y > 0)
        models["roofline"], reports["roofline"] = fit_roofline(
            [samples[i].steps for i in keep], y[keep], run.model, run.hardware,
            labels=[labels[i] for i in keep])
    return models, reports, rfit


def calibrate(cfg: DictConfig, out_dir: str | Path, extra_steps: Sequence[StepSource] = ()) -> Calibration:
    """Profile (``calibrate.profile``; or reuse ``calibrate.profile_from``, a profile.csv) and/or read
    ``calibrate.steps`` + ``extra_steps`` and/or the request-level ``calibrate.runs``, fit, write files."""
    run, c = RunConfig.from_config(cfg), cfg.calibrate
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    features: list[StepFeatures] = []
    durations: list[float] = []
    labels: list[str] = []
    paths: dict[str, Path] = {}
    if c.get("profile_from") or profiling(c):
        paths["profile"] = Path(c.profile_from) if c.get("profile_from") else run_profile(run, c, out)
        f, d, g = read_profile(paths["profile"])
        features += f
        durations += d
        labels += g
    sources = [*(c.steps or []), *extra_steps]
    run_f, run_d = run_steps(sources) if sources else ([], np.empty(0))
    features += run_f
    durations += run_d.tolist()
    labels += [f"run:{group_of(x)}" for x in run_f]
    samples, request_info = request_level_samples(c)
    if not features and not samples:
        raise ValueError("calibrate: nothing to fit; set calibrate.profile=true, calibrate.profile_from=<profile.csv>, "
                         "calibrate.steps=[run_dir, ...] or calibrate.runs=[run_dir, ...]")
    w = c.get("profile_weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf:
        raise ValueError(f"calibrate.profile_weight={w!r}; allowed: a finite number >= 0")
    weights = [float(w) if not lab.startswith("run:") else 1.0 for lab in labels]
    target = c.get("linear_target", "mean")
    rfit = None
    if samples:  # request-level data: one fit over everything, with the per-request TTFT overhead term
        samples = [RequestSample((f,), d, "step", wt, lab) for f, d, wt, lab in
                   zip(features, durations, weights, labels, strict=True)] + samples
        labels += [f"request:{s.kind}" for s in samples[len(features):]]
        models, reports, rfit = fit_with_requests(run, samples, labels, list(c.fits), target)
        features = [s.steps for s in samples]
        durations = [s.duration_s for s in samples]
    y = np.asarray(durations, dtype=float)
    if rfit is None:
        models, reports = fit_all(run, features, y, labels, list(c.fits), weights, target)
    spec, hw = run.model, run.hardware
    source_text = ", ".join(f"{s[0]} (first {s[1]} steps)" if isinstance(s, tuple) else str(s) for s in sources)
    note = (f"model={spec.name} hardware={hw.name} backend={run.backend}; {len(features)} measurements "
            f"(profile: {paths.get('profile')}, runs: [{source_text}]"
            + (f", request-level runs: {request_info['runs']})\nIsolated TTFTs carry a further "
               f"{rfit.request_overhead_s * 1e3:.3g} ms per request (HTTP, tokenisation): frontend_delay_s, "
               "which a simulation with this file adds before each request reaches a replica" if rfit else ")"))
    noise: dict[str, Any] = {}
    if run_f and rfit is None and check_bool(c.get("step_noise", True), "calibrate.step_noise"):
        # the runs' steps in their order: how the machine's time varied around each model (sim.noise)
        block = c.get("noise_block_steps")
        for name, model in models.items():
            noise[name] = record_step_noise(run_f, run_d, predict(model, run_f), block, source_text)
    for name, model in models.items():
        paths[name] = write_calibration(out / f"{name}.yaml", model, reports[name], note, (spec.name, hw.name),
                                        rfit.request_overhead_s if rfit else None, noise.get(name))
    summary: dict[str, Any] = {name: rep.to_dict() for name, rep in reports.items()}
    summary["step_noise"] = {name: {k: v for k, v in rec.items() if k != "z"} if rec else None
                             for name, rec in noise.items()}
    summary.update(model=spec.name, hardware=hw.name, backend=run.backend, num_measurements=len(features),
                   sources=[str(s) for s in sources], profile=str(paths.get("profile")),
                   engine_clock=run.engine_clock if run.measured else None)
    if paths.get("profile") and (paths["profile"].parent / "grid.json").is_file():
        summary["grid"] = json.loads((paths["profile"].parent / "grid.json").read_text())
    if rfit is not None:
        summary["request_level"] = {**request_info, "request_overhead_s": rfit.request_overhead_s,
                                    "num_samples": rfit.counts}
    if "linear" in models and len(y) >= 2 * CV_FOLDS:
        if rfit is None:
            rel = np.abs(cross_validate(lambda f, d: fit_linear_mean(f, d)[0], features, y, folds=CV_FOLDS))
        else:
            rel = np.abs(cross_validate_requests(samples, folds=CV_FOLDS, target=target))
        summary["linear_cv"] = {"folds": CV_FOLDS, "median_rel_error": float(np.median(rel)),
                                "p90_rel_error": float(np.percentile(rel, 90)), "max_rel_error": float(rel.max())}
    if c.get("simulate_runs"):  # loaded runs: fit the linear model's scales and the server terms by simulation
        from experiments.calibration import simfit

        if "linear" not in paths:
            raise ValueError("calibrate.simulate_runs starts from the linear fit; keep linear in calibrate.fits")
        rep = simfit.fit(cfg, [str(r) for r in c.simulate_runs], paths["linear"], out / "simulated",
                         c.get("simulate") or {}, anchors=[[str(r)] for r in c.get("runs") or []])
        paths["simulated"] = Path(rep["path"])
        summary["simulated"] = {k: rep[k] for k in ("path", "train", "params", "loss_before", "loss_after",
                                                    "num_simulations")}
    paths["fit_report"] = out / "fit_report.json"
    paths["fit_report"].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if c.get("plot", True):
        from experiments import plots

        def predicted(name: str, m: Any) -> np.ndarray:
            return rfit.predict(samples) if rfit is not None and name == "linear" else predict(m, features)

        panels = {f"{name} (R² {reports[name].r2:.3f})": _by_group(labels, y, predicted(name, m))
                  for name, m in models.items()}
        paths["scatter"] = plots.predicted_vs_measured(panels, out / "calibration_scatter.png",
                                                       f"{spec.name} on {hw.name}: step time")
    return Calibration(models, reports, paths, list(features), y, labels)


def _by_group(labels: Sequence[str], measured: np.ndarray, predicted: np.ndarray) -> dict[str, tuple]:
    lab = np.asarray(labels, dtype=object)
    return {g: (measured[lab == g], predicted[lab == g]) for g in sorted(set(labels))}


def describe(cal: Calibration) -> str:
    lines = []
    for name, rep in cal.reports.items():
        groups = ", ".join(f"{g} {s['median_rel_error']:.1%}" for g, s in rep.groups.items())
        lines.append(f"{name}: R² {rep.r2:.4f}, median |rel err| {rep.median_rel_error:.1%}, "
                     f"p90 {rep.p90_rel_error:.1%} (per group median: {groups})")
    return "\n".join(lines)


@hydra_app("calibrate")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    cal = calibrate(cfg, out)
    log.info(describe(cal))
    for name in FITS:
        if name in cal.paths:
            log.info(f"{name}: {cal.paths[name].resolve()}")
    if "simulated" in cal.paths:
        log.info(f"fitted by simulation: {cal.paths['simulated'].resolve()}")
    first = "simulated" if "simulated" in cal.paths else next(n for n in FITS if n in cal.paths)
    log.info(f"use it: python -m experiments.run cost_model=calibrated cost_model.path={cal.paths[first].resolve()}")


if __name__ == "__main__":
    main()
