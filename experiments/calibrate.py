"""`python -m experiments.calibrate`: time a grid of step shapes on a backend, fit the simulator's cost models.

The profile admits batches to the replica's KVCacheManager with core.shapes (no workload, no scheduler): each shape
is a set of prefill chunks (a chunk of ``n`` tokens after ``c`` cached ones) and decodes (one token attending to a
context), run ``warmup`` untimed then ``repeats`` timed times back to back (a run's consecutive steps are similar
too, with warm caches); the median is the shape's duration. Engine steps are timed on the ``engine_clock``
stopwatch (thread CPU time on the one-thread CPU engine: far steadier than the wall clock on a shared machine). Steps of
earlier runs (``calibrate.steps=[run_dir, ...]``) can join or replace the profile; ``calibrate.profile_from``
reuses an earlier profile.csv. ``sim.calibration`` fits the linear model and the roofline's efficiencies, and the
output directory gets:

- ``linear.yaml`` / ``roofline.yaml``: ready cost models; use one with
  ``python -m experiments.run cost_model=calibrated cost_model.path=<dir>/linear.yaml``
- ``linear.report.json`` / ``roofline.report.json`` and ``fit_report.json`` (both fits, per shape group, and the
  linear model's 5-fold cross-validated relative error)
- ``profile.csv`` (one row per shape: features, median / min / max seconds) and ``calibration_scatter.png``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.batch import StepFeatures
from core.shapes import ShapedBatch, shape_blocks
from experiments.build import build_executors, build_replicas, engine_clock, hardware_spec, model_spec
from sim.calibration import (
    FitReport,
    cross_validate,
    fit_linear,
    fit_roofline,
    predict,
    steps_from_csv,
    write_calibration,
)

GRID_KEYS = ("prefill_lens", "prefill_cached", "decode_batch_sizes", "decode_contexts", "mixed_chunks",
             "mixed_decodes", "mixed_context")
FITS = ("linear", "roofline")
CV_FOLDS = 5
LINEAR_TARGETS = ("mean", "relative")
MEAN_FIT_ITERATIONS = 3


@dataclass(frozen=True)
class Shape:
    """One profiled step: prefill chunks as (cached tokens, chunk tokens) and decodes as the context each attends
    to (its new token included)."""

    group: str  # prefill | decode | mixed
    label: str
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()

    def blocks(self, block_size: int) -> int:
        return shape_blocks(self.prefills, self.decodes, block_size)


@dataclass
class ProfileRow:
    shape: Shape
    features: StepFeatures
    samples: list[float]

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples))


def _ints(grid: Mapping[str, Any], key: str, lo: int) -> list[int]:
    v = grid.get(key, [])
    vals = [v] if isinstance(v, int) else list(v or [])
    if any(isinstance(x, bool) or not isinstance(x, int) or x < lo for x in vals):
        raise ValueError(f"calibrate.grid.{key}={vals!r}; allowed: integers >= {lo}")
    return vals


def grid_shapes(grid: Mapping[str, Any], max_model_len: int) -> list[Shape]:
    """The profile's shapes: prefill lens x cached context, decode batch x context, and mixed steps (one chunk
    after ``mixed_context`` cached tokens plus decodes at ``mixed_context``)."""
    grid = dict(grid)
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise ValueError(f"calibrate.grid: unknown keys {unknown}; allowed: {list(GRID_KEYS)}")
    lens, cached = _ints(grid, "prefill_lens", 1), _ints(grid, "prefill_cached", 0) or [0]
    batches, contexts = _ints(grid, "decode_batch_sizes", 1), _ints(grid, "decode_contexts", 2)
    chunks, mixed_dec = _ints(grid, "mixed_chunks", 1), _ints(grid, "mixed_decodes", 1)
    mixed_ctx = _ints(grid, "mixed_context", 2) or [256]
    if len(mixed_ctx) != 1:
        raise ValueError(f"calibrate.grid.mixed_context={mixed_ctx}; allowed: one integer >= 2")
    ctx = mixed_ctx[0]
    shapes = [Shape("prefill", f"n={n},c={c}", prefills=((c, n),)) for c in cached for n in lens]
    shapes += [Shape("decode", f"b={b},ctx={t}", decodes=(t,) * b) for b in batches for t in contexts]
    shapes += [Shape("mixed", f"n={n},c={ctx},b={b},ctx={ctx}", prefills=((ctx, n),), decodes=(ctx,) * b)
               for n in chunks for b in mixed_dec]
    if not shapes:
        raise ValueError("calibrate.grid describes no shapes; give prefill_lens and/or decode_batch_sizes x "
                         "decode_contexts")
    for s in shapes:
        longest = max([c + n for c, n in s.prefills] + list(s.decodes))
        if longest > max_model_len:
            raise ValueError(f"calibrate.grid: shape {s.group} {s.label} needs {longest} positions > model "
                             f"max_model_len {max_model_len}")
    return shapes


def profile(cfg: DictConfig, shapes: Sequence[Shape], repeats: int = 5, warmup: int = 2, seed: int = 0,
            progress: bool = False) -> list[ProfileRow]:
    """Time every shape on the configured backend (one replica, a KV pool sized for the largest shape), shapes in
    a seeded random order."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"calibrate.repeats={repeats} must be >= 1 and calibrate.warmup={warmup} >= 0")
    spec = model_spec(cfg)
    num_blocks = max(s.blocks(int(cfg.kv.block_size)) for s in shapes)
    one = OmegaConf.merge(cfg, {"replicas": 1, "kv": {"num_blocks": num_blocks}})
    replica = build_replicas(one, spec, num_blocks)[0]
    executor = build_executors(one, spec, [replica])[0]
    # one ShapedBatch per shape, kept across rounds (the engine materialises each prompt once, as in a run) and
    # admitted to the replica's KV pool for every timed execution
    states = [ShapedBatch(s.prefills, s.decodes, name=f"profile{i}") for i, s in enumerate(shapes)]
    samples: list[list[float]] = [[] for _ in shapes]
    features: list[StepFeatures | None] = [None] * len(shapes)
    for n, i in enumerate(np.random.default_rng(seed).permutation(len(shapes)).tolist()):
        for r in range(warmup + repeats):  # back to back, like the similar consecutive steps of a run
            batch = states[i].admit(replica.kv)
            features[i] = batch.features
            out = executor.execute(batch)
            states[i].release(replica.kv)
            if r >= warmup:
                samples[i].append(float(out.duration_s))
        if progress and (n + 1) % 10 == 0:
            print(f"profiled {n + 1}/{len(shapes)} shapes", flush=True)
    return [ProfileRow(s, f, x) for s, f, x in zip(shapes, features, samples, strict=True)]


def write_profile(path: str | Path, rows: Sequence[ProfileRow]) -> Path:
    path = Path(path)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["group", "shape", "repeats", "median_s", "min_s", "max_s", *StepFeatures.names()])
        for r in rows:
            w.writerow([r.shape.group, r.shape.label, len(r.samples), repr(r.median_s), repr(min(r.samples)),
                        repr(max(r.samples)), *astuple(r.features)])
    return path


StepSource = str | Path | tuple[str | Path, int]


def run_steps(sources: Sequence[StepSource]) -> tuple[list[StepFeatures], np.ndarray]:
    """Measured steps of earlier runs: run directories or steps.csv files, or (path, n) for the first n steps.
    Steps without a positive duration are dropped (they carry no timing)."""
    feats: list[StepFeatures] = []
    durs: list[float] = []
    for src in sources:
        p, limit = (src if isinstance(src, tuple) else (src, None))
        p = Path(p)
        csv_path = p / "steps.csv" if p.is_dir() else p
        if not csv_path.is_file():
            raise ValueError(f"calibrate.steps: no steps.csv at {p}")
        f, d, _ = steps_from_csv(csv_path)
        keep = [i for i, x in enumerate(d.tolist()[:limit]) if x > 0 and math.isfinite(x)]
        feats += [f[i] for i in keep]
        durs += [float(d[i]) for i in keep]
    return feats, np.asarray(durs, dtype=float)


def group_of(f: StepFeatures) -> str:
    pre, dec = f.num_prefill_tokens > 0, f.num_decode_seqs > 0
    return "mixed" if pre and dec else "prefill" if pre else "decode"


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


def fit_all(cfg: DictConfig, features: Sequence[StepFeatures], durations: np.ndarray, labels: Sequence[str],
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
        models["roofline"], reports["roofline"] = fit_roofline(features, durations, model_spec(cfg),
                                                               hardware_spec(cfg), labels=labels)
    return models, reports


def run_profile(cfg: DictConfig, out_dir: str | Path) -> Path:
    """Profile ``calibrate.grid`` on the configured backend into ``<out_dir>/profile.csv``."""
    c = cfg.calibrate
    shapes = grid_shapes(OmegaConf.to_container(c.grid, resolve=True), model_spec(cfg).max_model_len)
    rows = profile(cfg, shapes, int(c.repeats), int(c.warmup), int(c.seed), bool(c.get("progress", False)))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return write_profile(Path(out_dir) / "profile.csv", rows)


def read_profile(path: str | Path) -> tuple[list[StepFeatures], list[float], list[str]]:
    """(features, median seconds, group) per row of a profile.csv."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibrate.profile_from: no profile.csv at {path}")
    feats, durs, groups = [], [], []
    with open(path, newline="") as fh:
        for line, row in enumerate(csv.DictReader(fh), start=2):
            try:
                feats.append(StepFeatures(**{k: int(row[k]) for k in StepFeatures.names()}))
                durs.append(float(row["median_s"]))
                groups.append(row["group"])
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line}: not a profile row ({e})") from None
    return feats, durs, groups


def calibrate(cfg: DictConfig, out_dir: str | Path, extra_steps: Sequence[StepSource] = ()) -> Calibration:
    """Profile (``calibrate.profile``; or reuse ``calibrate.profile_from``, a profile.csv) and/or read
    ``calibrate.steps`` + ``extra_steps``, fit, write files."""
    c = cfg.calibrate
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    features: list[StepFeatures] = []
    durations: list[float] = []
    labels: list[str] = []
    paths: dict[str, Path] = {}
    if c.get("profile_from") or c.profile:
        paths["profile"] = Path(c.profile_from) if c.get("profile_from") else run_profile(cfg, out)
        f, d, g = read_profile(paths["profile"])
        features += f
        durations += d
        labels += g
    sources = [*(c.steps or []), *extra_steps]
    if sources:
        f, d = run_steps(sources)
        features += f
        durations += d.tolist()
        labels += [f"run:{group_of(x)}" for x in f]
    if not features:
        raise ValueError("calibrate: nothing to fit; set calibrate.profile=true, calibrate.profile_from=<profile.csv> "
                         "or calibrate.steps=[run_dir, ...]")
    y = np.asarray(durations, dtype=float)
    w = c.get("profile_weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf:
        raise ValueError(f"calibrate.profile_weight={w!r}; allowed: a finite number >= 0")
    weights = [float(w) if not lab.startswith("run:") else 1.0 for lab in labels]
    models, reports = fit_all(cfg, features, y, labels, list(c.fits), weights, c.get("linear_target", "mean"))
    spec, hw = model_spec(cfg), hardware_spec(cfg)
    note = (f"model={spec.name} hardware={hw.name} backend={cfg.backend.name}; {len(features)} measurements "
            f"(profile: {paths.get('profile')}, runs: {[str(s) for s in sources]})")
    for name, model in models.items():
        paths[name] = write_calibration(out / f"{name}.yaml", model, reports[name], note, (spec.name, hw.name))
    summary: dict[str, Any] = {name: rep.to_dict() for name, rep in reports.items()}
    summary.update(model=spec.name, hardware=hw.name, backend=cfg.backend.name, num_measurements=len(features),
                   sources=[str(s) for s in sources], profile=str(paths.get("profile")),
                   engine_clock=engine_clock(cfg) if cfg.backend.name == "engine" else None)
    if "linear" in models and len(y) >= 2 * CV_FOLDS:
        rel = np.abs(cross_validate(lambda f, d: fit_linear_mean(f, d)[0], features, y, folds=CV_FOLDS))
        summary["linear_cv"] = {"folds": CV_FOLDS, "median_rel_error": float(np.median(rel)),
                                "p90_rel_error": float(np.percentile(rel, 90)), "max_rel_error": float(rel.max())}
    paths["fit_report"] = out / "fit_report.json"
    paths["fit_report"].write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if c.get("plot", True):
        from experiments import plots

        panels = {f"{name} (R² {reports[name].r2:.3f})": _by_group(labels, y, predict(m, features))
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


@hydra.main(config_path="../conf", config_name="calibrate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    cal = calibrate(cfg, out)
    print(describe(cal))
    for name in FITS:
        if name in cal.paths:
            print(f"{name}: {cal.paths[name].resolve()}")
    first = next(n for n in FITS if n in cal.paths)
    print(f"use it: python -m experiments.run cost_model=calibrated cost_model.path={cal.paths[first].resolve()}")


if __name__ == "__main__":
    main()
