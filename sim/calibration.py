"""Fit cost models to measured step times and write the result as a ready ``cost_model`` config (DESIGN §9).

A *measurement* is one step (``StepFeatures``) or a run of steps whose durations were measured as one sum (e.g. the
chunks of one chunked prefill): the linear model sums the run's feature rows (its intercept counts steps), the
roofline sums its step times. Errors are relative: (predicted − measured) / measured.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.optimize import least_squares, nnls

from core.batch import LATER_FEATURES, StepFeatures
from core.checks import check_keys
from core.records import StepRecord
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import CostModel, as_model_spec
from sim.cost.linear import TARGET as LINEAR_TARGET
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import RooflineCostModel

Measurement = StepFeatures | Sequence[StepFeatures]

LINEAR_TERMS = ("c0_s", "per_prefill_token_s", "per_decode_seq_s", "per_attention_pair_s", "per_kv_token_read_s",
                "per_prefill_context_token_s", "per_draft_token_s")
FEATURE_COLUMNS = ("steps", "num_prefill_tokens", "num_decode_seqs", "attention_pairs", "kv_tokens_read",
                   "prefill_context_tokens", "num_draft_tokens")
ROOFLINE_TARGET = "sim.cost.roofline.RooflineCostModel"
ROOFLINE_PARAMS = ("compute_eff", "bw_eff", "overhead_s", "weight_bits", "kv_bits", "group_size", "tp")
FITTED_ROOFLINE = ("compute_eff", "bw_eff", "overhead_s")
MIN_EFF = 1e-3  # lower bound of a fitted efficiency
EFF_GRID = np.geomspace(0.01, 1.0, 31)  # coarse grid the roofline fit starts from (then refined)
CV_SEED = 0
ROBUST_SCALE = 0.1  # relative error beyond which the robust roofline loss grows linearly


def steps_of(m: Measurement) -> tuple[StepFeatures, ...]:
    steps = (m,) if isinstance(m, StepFeatures) else tuple(m)
    if not steps or not all(isinstance(f, StepFeatures) for f in steps):
        raise ValueError(f"a measurement must be a StepFeatures or a non-empty sequence of them, got {m!r}")
    return steps


def shape_label(m: Measurement) -> str:
    """prefill | decode | mixed | empty (a run whose steps differ is mixed)."""
    labels = {f.kind for f in steps_of(m)}
    return labels.pop() if len(labels) == 1 else "mixed"


def feature_matrix(features: Sequence[Measurement]) -> np.ndarray:
    """Columns [1, num_prefill_tokens, num_decode_seqs, attention_pairs, kv_tokens_read, prefill context tokens,
    num_draft_tokens]: the linear model's terms (prefill context = cached tokens the prefill chunks attend to).

    A run of steps is the sum of its rows, so its first column counts its steps (each pays the intercept).
    """
    rows = [[sum(v) for v in zip(*((1, f.num_prefill_tokens, f.num_decode_seqs, f.attention_pairs, f.kv_tokens_read,
                                    f.prefill_kv_tokens - f.num_prefill_tokens, f.num_draft_tokens)
                                   for f in steps_of(m)), strict=True)] for m in features]
    return np.array(rows, dtype=float).reshape(len(rows), len(FEATURE_COLUMNS))


def _durations(durations: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
    y = np.asarray(durations, dtype=float).ravel()
    if len(y) != n:
        raise ValueError(f"durations: {len(y)} values for {n} measurements")
    if n == 0:
        raise ValueError("no measurements to fit")
    bad = np.flatnonzero(~np.isfinite(y) | (y <= 0))
    if len(bad):
        raise ValueError(f"durations must be finite and > 0; row {bad[0]} is {y[bad[0]]!r}")
    return y


def predict(cost_model: CostModel, features: Sequence[Measurement]) -> np.ndarray:
    """Seconds per measurement (a run's steps summed)."""
    return np.array([sum(cost_model.step_time(f) for f in steps_of(m)) for m in features], dtype=float)


def _stats(rel: np.ndarray) -> dict[str, float]:
    a = np.abs(rel)
    return {"num_rows": int(len(rel)), "mean_rel_error": float(a.mean()), "median_rel_error": float(np.median(a)),
            "p90_rel_error": float(np.percentile(a, 90)), "max_rel_error": float(a.max()),
            "median_signed_rel_error": float(np.median(rel))}


@dataclass
class FitReport:
    """How well a cost model predicts measured durations. Errors are |pred − meas| / meas; signed > 0: too slow."""

    num_rows: int
    r2: float
    mean_rel_error: float
    median_rel_error: float
    p90_rel_error: float
    max_rel_error: float
    median_signed_rel_error: float
    groups: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def report(cost_model: CostModel, features: Sequence[Measurement], durations: Sequence[float] | np.ndarray,
           labels: Sequence[str] | None = None) -> FitReport:
    """Evaluate any cost model on data; groups by ``labels`` (default: ``shape_label`` of each measurement)."""
    y = _durations(durations, len(features))
    labels = [shape_label(m) for m in features] if labels is None else list(labels)
    return _report(predict(cost_model, features), y, labels)


def _report(p: np.ndarray, y: np.ndarray, labels: Sequence[str]) -> FitReport:
    if len(labels) != len(y):
        raise ValueError(f"labels: {len(labels)} values for {len(y)} measurements")
    rel = (p - y) / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((p - y) ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan
    lab = np.array(labels, dtype=object)
    groups = {g: _stats(rel[lab == g]) for g in sorted(set(labels))}
    return FitReport(r2=r2, groups=groups, **_stats(rel))


def fit_linear(features: Sequence[Measurement], durations: Sequence[float] | np.ndarray,
               weights: Sequence[float] | None = None, *, relative: bool = True,
               labels: Sequence[str] | None = None) -> tuple[LinearCostModel, FitReport]:
    """Non-negative least squares for the linear model's five coefficients.

    ``relative=True`` (default) divides each row by its duration, i.e. minimises squared *relative* error. Step times
    span orders of magnitude (a decode step vs a long prefill) and timing noise is roughly multiplicative, so an
    absolute fit lets the longest steps dictate every coefficient and mispredicts short decode steps by tens of
    percent. On the published GPU measurements (sim.published, 5-fold) relative weighting had the lower held-out
    median relative error in 20 of 24 setups (Splitwise: 3-6% vs 11-53%); the rest differ by < 1 point.
    ``weights`` multiply the rows on top. Columns are scaled to unit max before NNLS (they span ~12 orders of
    magnitude) and the solution unscaled after.
    """
    X = feature_matrix(features)
    y = _durations(durations, len(X))
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float).ravel()
    if len(w) != len(y) or not np.all(np.isfinite(w) & (w >= 0)):
        raise ValueError(f"weights: need {len(y)} finite values >= 0")
    if relative:
        w = w / y
    coef = _nnls(X, y, w)
    model = LinearCostModel(**dict(zip(LINEAR_TERMS, coef.tolist(), strict=True)))
    return model, report(model, features, y, labels)


def _nnls(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin ||w * (X c - y)|| over c >= 0; columns scaled to unit max first (they span ~12 orders of magnitude)."""
    A, b = X * w[:, None], y * w
    scale = np.abs(A).max(axis=0)
    used = scale > 0  # a term no step has (no drafts, no cached prefills) gets 0, not whatever NNLS leaves there
    coef = np.zeros(X.shape[1])
    if used.any():
        coef[used] = nnls(A[:, used] / scale[used], b)[0] / scale[used]
    return coef


@dataclass(frozen=True)
class OpGroupCost:
    """A roofline restricted to some op groups plus its overhead: the predictor for measurements of single
    operators (e.g. only a layer's linear layers), where the rest of a step was not timed."""

    roofline: RooflineCostModel
    ops: tuple[str, ...]

    def step_time(self, f: StepFeatures) -> float:
        times = self.roofline.breakdown(f)
        return sum(times.get(name, 0.0) for name in self.ops) + self.roofline.overhead_s


@dataclass(frozen=True)
class _RooflineTerms:
    """Per-step op times at 100% efficiency, so a candidate (compute_eff, bw_eff, overhead) is priced vectorised."""

    compute: np.ndarray  # (steps, groups) seconds at peak FLOP/s
    memory: np.ndarray  # (steps, groups) seconds at peak bandwidth
    fixed: np.ndarray  # (steps,) all-reduce seconds (not scaled by the efficiencies)
    owner: np.ndarray  # (steps,) which measurement each step belongs to
    num_rows: int

    def predict(self, compute_eff: float, bw_eff: float, overhead_s: float) -> np.ndarray:
        per_step = np.maximum(self.compute / compute_eff, self.memory / bw_eff).sum(axis=1) + self.fixed + overhead_s
        return np.bincount(self.owner, weights=per_step, minlength=self.num_rows)

    @property
    def steps_per_row(self) -> np.ndarray:
        return np.bincount(self.owner, minlength=self.num_rows).astype(float)


def _roofline_terms(ref: RooflineCostModel, features: Sequence[Measurement],
                    ops: Sequence[str] | None) -> _RooflineTerms:
    groups = tuple(RooflineCostModel.GROUPS)
    if ops is not None:
        unknown = sorted(set(ops) - set(groups) - {"allreduce"})
        if unknown:
            raise ValueError(f"ops: unknown op groups {unknown}; allowed: {[*groups, 'allreduce']}")
        groups = tuple(g for g in groups if g in ops)
    peak, bw = ref.hardware.peak_flops, ref.hardware.mem_bw
    compute, memory, fixed, owner = [], [], [], []
    for i, m in enumerate(features):
        for f in steps_of(m):
            op = ref.ops(f)
            compute.append([op[g].flops / peak if g in op else 0.0 for g in groups])
            memory.append([op[g].bytes / bw if g in op else 0.0 for g in groups])
            fixed.append(ref.breakdown(f)["allreduce"] if ops is None or "allreduce" in ops else 0.0)
            owner.append(i)
    shape = (len(owner), len(groups))
    return _RooflineTerms(np.array(compute, float).reshape(shape), np.array(memory, float).reshape(shape),
                          np.array(fixed, float), np.array(owner, dtype=np.int64), len(features))


def _rho(r: np.ndarray, loss: str, f_scale: float) -> np.ndarray:
    """Per-row loss of relative residuals: scipy.optimize.least_squares's scaled rho (its cost is half the sum)."""
    z = (r / f_scale) ** 2
    return f_scale**2 * (z if loss == "linear" else 2.0 * (np.sqrt(1.0 + z) - 1.0))


def _fit_terms(terms: _RooflineTerms, y: np.ndarray, loss: str, f_scale: float) -> tuple[float, float, float]:
    """Minimise the loss of relative errors: a log grid over both efficiencies × candidate overheads (a log grid
    plus the closed-form least-squares overhead, clipped at 0), then a bounded refinement from the best point."""
    k = terms.steps_per_row / y  # d(relative residual) / d(overhead)
    scale = float(np.median(y))  # overhead in units of a typical duration keeps the problem well conditioned
    o_grid = np.concatenate([[0.0], np.geomspace(1e-4, 1.0, 13) * scale])
    starts = np.searchsorted(terms.owner, np.arange(terms.num_rows))  # steps are stored grouped by measurement
    bes = EFF_GRID[:, None, None]
    best = (math.inf, 1.0, 1.0, 0.0)
    for ce in EFF_GRID:  # vectorised over bw_eff (axis 0) and overhead candidates (last axis)
        steps = np.maximum(terms.compute[None] / ce, terms.memory[None] / bes).sum(axis=2) + terms.fixed
        r0 = (np.add.reduceat(steps, starts, axis=1) - y) / y
        o = np.concatenate([np.broadcast_to(o_grid, (len(EFF_GRID), len(o_grid))),
                            np.maximum(0.0, -(r0 @ k) / float(k @ k))[:, None]], axis=1)
        cost = _rho(r0[:, :, None] + k[None, :, None] * o[:, None, :], loss, f_scale).sum(axis=1)
        b, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        if cost[b, j] < best[0]:
            best = (float(cost[b, j]), float(ce), float(EFF_GRID[b]), float(o[b, j]))
    cost0, ce, be, o = best

    def residual(x: np.ndarray) -> np.ndarray:
        return (terms.predict(x[0], x[1], x[2] * scale) - y) / y

    res = least_squares(residual, x0=[ce, be, o / scale], bounds=([MIN_EFF, MIN_EFF, 0.0], [1.0, 1.0, np.inf]),
                        method="trf", x_scale=[0.1, 0.1, 0.1], loss=loss, f_scale=f_scale)
    if res.success and _rho(res.fun, loss, f_scale).sum() < cost0:
        ce, be, o = float(res.x[0]), float(res.x[1]), float(res.x[2]) * scale
    return float(ce), float(be), float(o)


def fit_roofline(features: Sequence[Measurement], durations: Sequence[float] | np.ndarray,
                 model: ModelSpec | Mapping[str, Any], hardware: HardwareSpec | Mapping[str, Any],
                 base: RooflineCostModel | Mapping[str, Any] | None = None, *, labels: Sequence[str] | None = None,
                 ops: Sequence[str] | None = None, loss: str = "soft_l1",
                 f_scale: float = ROBUST_SCALE) -> tuple[RooflineCostModel, FitReport]:
    """Fit compute_eff, bw_eff in (0, 1] and overhead_s >= 0 of a roofline on relative error.

    ``loss="soft_l1"`` (default) counts relative errors beyond ``f_scale`` linearly rather than squared, so a few
    rows the roofline cannot express (a memory-starved batch, a warm-up step) do not drag every parameter;
    ``"linear"`` is plain least squares.

    ``base``: the other roofline parameters (weight_bits, kv_bits, group_size, tp; a RooflineCostModel or its
    ``params()``); its efficiencies and overhead are ignored. ``ops``: the measurements time only these op groups
    (plus a fixed overhead), e.g. ``("linear",)`` for per-operator profiles; None = whole steps. With ``ops`` the
    report prices measurements with ``OpGroupCost``.
    """
    params = dict(base.params() if isinstance(base, RooflineCostModel) else (base or {}))
    check_keys("fit_roofline.base", params, ROOFLINE_PARAMS)
    fixed = {k: v for k, v in params.items() if k not in FITTED_ROOFLINE}
    ref = RooflineCostModel(model, hardware, compute_eff=1.0, bw_eff=1.0, overhead_s=0.0, **fixed)
    y = _durations(durations, len(features))
    if loss not in ("linear", "soft_l1"):
        raise ValueError(f"loss={loss!r}; allowed: 'linear', 'soft_l1'")
    if not f_scale > 0:
        raise ValueError(f"f_scale={f_scale!r}; allowed: a number > 0")
    ce, be, o = _fit_terms(_roofline_terms(ref, features, ops), y, loss, f_scale)
    fitted = ref.replace(compute_eff=ce, bw_eff=be, overhead_s=o)
    priced = fitted if ops is None else OpGroupCost(fitted, tuple(ops))
    return fitted, report(priced, features, y, labels)


def _folds(n: int, folds: int, seed: int):
    """(train, test) index arrays of k folds over a fixed random permutation of ``n`` rows."""
    if not 2 <= folds <= n:
        raise ValueError(f"folds={folds}; allowed: 2..{n} (number of measurements)")
    fold = np.empty(n, dtype=int)
    fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % folds
    for k in range(folds):
        yield np.flatnonzero(fold != k), np.flatnonzero(fold == k)


def cross_validate(fit: Callable[[list[Measurement], np.ndarray], CostModel], features: Sequence[Measurement],
                   durations: Sequence[float] | np.ndarray, folds: int = 5, seed: int = CV_SEED) -> np.ndarray:
    """Held-out signed relative errors, one per measurement: k folds of a fixed random permutation; ``fit`` maps
    (training measurements, durations) to the cost model that prices the held-out fold."""
    y = _durations(durations, len(features))
    rel = np.empty(len(y))
    for train, test in _folds(len(y), folds, seed):
        cost = fit([features[i] for i in train], y[train])
        rel[test] = (predict(cost, [features[i] for i in test]) - y[test]) / y[test]
    return rel


def steps_from_csv(path: str | Path) -> tuple[list[StepFeatures], np.ndarray, np.ndarray]:
    """Read a run's steps.csv (columns ``StepRecord.columns()``): (features, durations in s, replica ids). A run
    written as Parquet: its steps.parquet (the path itself, or the sibling of an absent steps.csv)."""
    from core.output import read_steps, table_path

    path = Path(path)
    names = StepFeatures.names()
    if not path.is_file() or path.suffix == ".parquet":
        cols = read_steps(table_path(path))
        missing = sorted(set(StepRecord.columns()) - set(cols) - LATER_FEATURES)
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {StepRecord.columns()}")
        zeros = np.zeros(len(cols["duration_s"]), dtype=np.int64)
        feats = [StepFeatures(*row) for row in zip(*(cols[k].astype(np.int64).tolist() if k in cols else zeros.tolist()
                                                     for k in names), strict=True)]
        return feats, cols["duration_s"].astype(float), cols["replica"].astype(int)
    features, durations, replicas = [], [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        # features added since the first recordings (core.batch.LATER_FEATURES): older files have none (0)
        missing = sorted(set(StepRecord.columns()) - set(reader.fieldnames or ()) - LATER_FEATURES)
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {StepRecord.columns()}")
        for line, row in enumerate(reader, start=2):
            try:
                features.append(StepFeatures(**{k: int(row.get(k) or 0) for k in names}))
                durations.append(float(row["duration_s"]))
                replicas.append(int(row["replica"]))
            except ValueError as e:
                raise ValueError(f"{path}:{line}: bad value ({e})") from None
    return features, np.array(durations, dtype=float), np.array(replicas, dtype=int)


def calibration_dict(cost_model: LinearCostModel | RooflineCostModel) -> dict[str, Any]:
    """The ``cost_model`` config entry: ``_target_`` + parameters; a roofline takes the run's model and hardware."""
    if isinstance(cost_model, LinearCostModel):
        return cost_model.to_dict()
    if isinstance(cost_model, RooflineCostModel):
        return {"_target_": ROOFLINE_TARGET, "model": "${model}", "hardware": "${hardware}", **cost_model.params()}
    raise ValueError(f"cannot write a calibration for {type(cost_model).__name__}; expected a linear or roofline model")


def write_calibration(path: str | Path, cost_model: LinearCostModel | RooflineCostModel,
                      fit: FitReport | None = None, note: str = "", fitted_for: tuple[str, str] | None = None,
                      frontend_delay_s: float | None = None, step_noise: Mapping[str, Any] | None = None) -> Path:
    """A YAML usable as a ``conf/cost_model`` option, with a commented summary; the full report (if given) goes
    next to it as ``<stem>.report.json``. ``fitted_for`` = (model name, hardware name) the measurements came from:
    loading the file for another model or hardware then fails unless the run allows it. ``frontend_delay_s``: a
    server's per-request time outside its steps (fitted from request-level runs), which a simulation with this
    file adds before each request reaches a replica (``calibrated_frontend_delay``). ``step_noise``: the measured
    steps' variability around this model (``sim.noise.record_step_noise``), last in the file: a simulation with
    this file replays it (``backend.step_noise``)."""
    path = Path(path)
    header = ["# Calibrated cost model (sim.calibration.write_calibration)."]
    if note:
        header += [f"# {line}" for line in note.splitlines()]
    if isinstance(cost_model, RooflineCostModel):
        header.append(f"# Fitted for model={cost_model.model.name} hardware={cost_model.hardware.name}; "
                      "${model} / ${hardware} take the run's selection.")
    if fit is not None:
        header.append(f"# Fit on {fit.num_rows} rows: median |rel err| {fit.median_rel_error:.1%}, "
                      f"p90 {fit.p90_rel_error:.1%}, max {fit.max_rel_error:.1%}, r2 {fit.r2:.4f}. "
                      f"Report: {path.stem}.report.json")
        path.with_name(path.stem + ".report.json").write_text(json.dumps(fit.to_dict(), indent=2))
    body = calibration_dict(cost_model)
    if fitted_for is not None:
        body["fitted_for"] = {"model": fitted_for[0], "hardware": fitted_for[1]}
    if frontend_delay_s is not None:
        body["frontend_delay_s"] = float(frontend_delay_s)
    text = yaml.safe_dump(body, sort_keys=False)
    if step_noise is not None:
        sigmas = ", ".join(f"{k} {v:.3f}" for k, v in step_noise["sigma"].items())
        header.append(f"# Step noise (sim/noise.py): {step_noise['num_steps']} run steps' log(measured / predicted), "
                      f"sd {step_noise['sigma_all']:.3f} ({sigmas}), standardised per kind (z) in step order; a "
                      f"simulation replays z in blocks of {step_noise['block_steps']} steps unless "
                      "backend.step_noise=false.")
        text += yaml.safe_dump({"step_noise": dict(step_noise)}, sort_keys=False, default_flow_style=None, width=116)
    path.write_text("\n".join(header) + "\n" + text)
    return path


def read_calibration_file(path: str | Path) -> Any:
    """A calibration file's YAML (libyaml's parser where installed: a step noise section holds up to 10,000
    numbers, 0.04 s to read instead of 0.25 s); None if there is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def calibrated_step_noise(path: str | Path) -> dict[str, Any] | None:
    """The ``step_noise`` section a calibration file records (None when it has none: no run's steps were fitted)."""
    cfg = read_calibration_file(path)
    return cfg.get("step_noise") if isinstance(cfg, dict) else None


def calibrated_frontend_delay(path: str | Path) -> float:
    """The per-request front-end delay a calibration file records (0 when it has none: a step-level fit)."""
    cfg = read_calibration_file(path)
    return float(cfg.get("frontend_delay_s") or 0.0) if isinstance(cfg, dict) else 0.0


def load_calibration(path: str | Path, model: ModelSpec | Mapping[str, Any] | None = None,
                     hardware: HardwareSpec | Mapping[str, Any] | None = None,
                     allow_mismatch: bool = False) -> LinearCostModel | RooflineCostModel:
    """The cost model a calibration file describes; a roofline file needs ``model`` and ``hardware`` (it
    interpolates the run's) unless it spells them out. A file fitted for another model or hardware than the
    run's is refused (its step times would silently be another machine's) unless ``allow_mismatch``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cost_model.path={str(path)!r}: no such calibration file (an experiments.calibrate output)")
    cfg = read_calibration_file(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(cfg).__name__}")
    fitted_for = cfg.pop("fitted_for", None) or {}
    cfg.pop("frontend_delay_s", None)  # the loop's, not the cost model's (calibrated_frontend_delay)
    cfg.pop("step_noise", None)  # the executor's (calibrated_step_noise)
    for key, given in (("model", model), ("hardware", hardware)):
        if key == "model" and isinstance(given, Mapping) and given.get("path"):
            given = as_model_spec(given)  # a checkpoint's name is its directory's, as calibrate recorded it
        name = getattr(given, "name", None) or (given.get("name") if isinstance(given, Mapping) else None)
        if fitted_for.get(key) and name and name != fitted_for[key] and not allow_mismatch:
            raise ValueError(f"cost_model.path={str(path)!r} was fitted for {key}={fitted_for[key]}, this run has "
                             f"{key}={name}; calibrate for it, or set cost_model.allow_mismatch=true")
    target = cfg.get("_target_")
    if target == LINEAR_TARGET:
        return LinearCostModel.from_mapping(cfg)
    if target != ROOFLINE_TARGET:
        raise ValueError(f"{path}: _target_={target!r}; expected {LINEAR_TARGET!r} or {ROOFLINE_TARGET!r}")
    cfg.pop("_target_")
    specs = {}
    for key, given in (("model", model), ("hardware", hardware)):
        in_file = cfg.pop(key, None)
        specs[key] = given if given is not None else in_file if isinstance(in_file, Mapping) else None
        if specs[key] is None:
            raise ValueError(f"{path}: {key}={in_file!r} is not a spec; pass {key}= to load_calibration")
    check_keys(f"{path}", cfg, ROOFLINE_PARAMS)
    return RooflineCostModel(specs["model"], specs["hardware"], **cfg)


# ---- calibration from request-level timings (a server seen as a black box) --------------------------------------
SAMPLE_KINDS = ("ttft", "itl", "step")
DEFAULT_TOLERANCE = 0.25  # client-side timing jitter allowed, as a fraction of one step


@dataclass(frozen=True)
class RequestSample:
    """One measurement implied by request-level timings (or a measured step, ``kind="step"``).

    ``steps``: the server steps the duration spans; ``kind``: ``ttft`` (an isolated request's TTFT: its prefill
    steps plus the fixed per-request overhead), ``itl`` (an inter-token gap: decode steps of a known batch) or
    ``step`` (a step measured directly: a profile row or a steps.csv row); ``weight``: a step seen by several
    requests' gaps (the batch of a decode) counts once in all.
    """

    steps: tuple[StepFeatures, ...]
    duration_s: float
    kind: str
    weight: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in SAMPLE_KINDS:
            raise ValueError(f"RequestSample.kind={self.kind!r}; allowed: {list(SAMPLE_KINDS)}")


def prefill_steps(prompt_len: int, cached: int = 0, chunk: int | None = None) -> tuple[StepFeatures, ...]:
    """The steps of one request's prefill alone on a server: chunks of at most ``chunk`` tokens (None: one step)
    after ``cached`` prefix-cache hits (a fully cached prompt still computes its last token)."""
    c = min(max(0, int(cached)), prompt_len - 1)
    steps, left = [], prompt_len - c
    while left > 0:
        n = left if chunk is None else min(left, chunk)
        steps.append(StepFeatures(num_seqs=1, num_batched_tokens=n, num_prefill_seqs=1, num_prefill_tokens=n,
                                  attention_pairs=n * c + n * (n + 1) // 2, prefill_kv_tokens=c + n,
                                  max_context_len=c + n))
        c, left = c + n, left - n
    return tuple(steps)


def _decode_step(contexts: Sequence[int]) -> StepFeatures:
    b = len(contexts)
    return StepFeatures(num_seqs=b, num_batched_tokens=b, num_decode_seqs=b, kv_tokens_read=int(sum(contexts)),
                        max_context_len=int(max(contexts)), max_decode_context=int(max(contexts)),
                        min_decode_context=int(min(contexts)))


def _col(cols: Mapping[str, np.ndarray], name: str, n: int, default: float) -> np.ndarray:
    v = cols.get(name)
    if v is None:
        return np.full(n, default, dtype=float)
    v = np.asarray(v, dtype=float)
    return np.where(np.isnan(v), default, v)


def request_samples(requests: Mapping[str, np.ndarray], tokens: Mapping[str, np.ndarray],
                    prefill_chunk: int | None = None, tolerance: float = DEFAULT_TOLERANCE,
                    source: str = "") -> list[RequestSample]:
    """The step durations a run's request-level timings imply (requests.csv and tokens.csv columns, as read by
    ``core.output.read_requests_csv`` / ``read_tokens_csv``): the calibration data of a server without steps.csv.

    Assumptions (a server this does not describe gives wrong samples, not an error):

    - the server serves only these requests (no other client), one replica (or the ``replica`` column says which);
    - it runs in steps; a decode step gives every running request exactly one token (no speculative decoding, no
      multi-token steps), and a token reaches the client at the end of its step; a streamed event carrying k
      tokens spans k steps;
    - a request alone on the server is prefilled right away, in chunks of ``prefill_chunk`` tokens (the server's
      token budget per step; None: one step), after the ``cached_tokens`` the server reported;
    - no batching across requests the client sees as isolated; no preemption (rows with ``num_preemptions`` > 0,
      and requests that did not finish, make every sample they overlap unusable).

    Samples:

    - ``ttft``: a request whose [arrival, first token] no other request overlaps: TTFT = its prefill steps + a fixed
      per-request overhead (HTTP, tokenisation, client; fitted as its own term).
    - ``itl``: a gap between two output events of a request while the set of requests on the server is fixed and
      every one of them is decoding (first token before the gap, finish after it): one decode step per token of
      the later event, of batch = those requests, each attending to its prompt + the tokens it had so far. The
      gaps of one step seen by b requests weigh 1/b each.

    ``tolerance``: the client-side jitter allowed when telling which events belong to the same step, as a fraction
    of one step (a request whose first token or finish lies that close to a gap's ends counts as in the same step).
    """
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"calibrate.prefill_chunk={prefill_chunk!r}; allowed: an integer >= 1 or null")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < 0.5:
        raise ValueError(f"calibrate.tolerance={tolerance!r}; allowed: a number in [0, 0.5)")
    missing = sorted({"id", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "status"} - set(requests))
    missing += sorted({"request_id", "index", "time_s", "num_tokens"} - set(tokens))
    if missing:
        raise ValueError(f"{source or 'run'}: requests.csv / tokens.csv lack columns {missing}")
    ids = [str(x) for x in requests["id"]]
    n = len(ids)
    arrival = np.asarray(requests["arrival_s"], dtype=float)
    first = np.asarray(requests["first_token_s"], dtype=float)
    finish = np.asarray(requests["finish_s"], dtype=float)
    prompt = np.asarray(requests["prompt_tokens"], dtype=np.int64)
    cached = _col(requests, "cached_tokens", n, 0.0).astype(np.int64)
    preempted = _col(requests, "num_preemptions", n, 0.0) > 0
    replica = _col(requests, "replica", n, 0.0).astype(np.int64)
    warmup = _col(requests, "warmup", n, 0.0) > 0
    finished = np.array([str(s) == "FINISHED" for s in requests["status"]], dtype=bool)
    end = np.where(np.isfinite(finish), finish, np.inf)  # a request still open at the end overlaps all after it

    # output events per request: times and token counts, in order
    pos = {rid: i for i, rid in enumerate(ids)}
    ev_rows: list[list[tuple[int, float, int]]] = [[] for _ in range(n)]
    for rid, idx, t, k in zip(tokens["request_id"], tokens["index"], tokens["time_s"], tokens["num_tokens"],
                              strict=True):
        i = pos.get(str(rid))
        if i is not None:
            ev_rows[i].append((int(idx), float(t), int(k)))
    ev_times, ev_cum = [], []  # per request: event times, tokens received up to and including each event
    for rows in ev_rows:
        rows.sort()
        ev_times.append(np.array([t for _, t, _ in rows], dtype=float))
        ev_cum.append(np.cumsum([k for _, _, k in rows], dtype=np.int64))
    good = finished & ~preempted & np.isfinite(first) & np.isfinite(finish) & \
        np.array([len(t) > 0 for t in ev_times], dtype=bool)

    samples: list[RequestSample] = []
    for r in np.unique(replica):
        members = np.flatnonzero(replica == r)
        members = members[np.argsort(arrival[members], kind="stable")]
        arr_m, end_m = arrival[members], end[members]
        for pos_i, i in enumerate(members):
            if not good[i] or warmup[i]:
                continue
            # every other request on this replica whose [arrival, end] meets i's
            hi = np.searchsorted(arr_m, end[i], side="right")
            near = np.flatnonzero(end_m[:hi] >= arrival[i])
            cand = members[near[near != pos_i]]
            c_arr, c_end, c_first = arrival[cand], end[cand], first[cand]
            c_good = good[cand]
            label = f"{source}:{ids[i]}" if source else ids[i]
            # -- isolated TTFT: nothing else on the server from its arrival to its first token
            if np.all((c_end <= arrival[i]) | (c_arr >= first[i])):
                steps = prefill_steps(int(prompt[i]), int(cached[i]), prefill_chunk)
                ttft = first[i] - arrival[i]
                if ttft > 0:
                    samples.append(RequestSample(steps, float(ttft), "ttft", 1.0, label))
            # -- inter-token gaps while the batch is fixed and all of it decodes
            t, cum = ev_times[i], ev_cum[i]
            if len(t) < 2:
                continue
            ta, tb = t[:-1], t[1:]
            k = np.diff(cum)  # steps spanned by each gap = tokens of its later event
            q = cum[:-1]  # tokens i had before the gap's first step
            with np.errstate(divide="ignore", invalid="ignore"):
                delta = tolerance * (tb - ta) / k
            usable = (tb > ta) & (k >= 1)
            if len(cand):
                lo, hi_t = (ta + delta)[:, None], (tb - delta)[:, None]
                disjoint = (c_end[None, :] <= lo) | (c_arr[None, :] >= hi_t)
                through = c_good[None, :] & (c_first[None, :] <= lo) & (c_end[None, :] >= hi_t)
                usable &= np.all(disjoint | through, axis=1)
                # tokens each co-running request had received by the gap's start (+ jitter)
                had = np.stack([_tokens_by(ev_times[j], ev_cum[j], ta + delta) for j in cand], axis=1)
            for g in np.flatnonzero(usable):
                others = [] if not len(cand) else [int(prompt[j] + had[g, m]) for m, j in enumerate(cand)
                                                   if through[g, m]]
                base = [int(prompt[i] + q[g])] + others
                steps = tuple(_decode_step([x + s for x in base]) for s in range(int(k[g])))
                samples.append(RequestSample(steps, float(tb[g] - ta[g]), "itl", 1.0 / len(base), label))
    return samples


def _tokens_by(times: np.ndarray, cum: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Tokens received by each time in ``t`` (events at ``times`` carrying ``cum`` tokens in all so far)."""
    idx = np.searchsorted(times, t, side="right")
    return np.where(idx > 0, cum[np.maximum(idx - 1, 0)] if len(cum) else 0, 0)


def request_samples_from_run(run_dir: str | Path, prefill_chunk: int | None = None,
                             tolerance: float = DEFAULT_TOLERANCE) -> list[RequestSample]:
    """``request_samples`` of a run directory (its requests.csv and tokens.csv; steps.csv is not needed)."""
    from core.output import has_table, read_requests, read_tokens

    d = Path(run_dir)
    for name in ("requests", "tokens"):
        if not has_table(d, name):
            raise ValueError(f"calibrate.runs: no {name}.csv (or .parquet) in {d} (a run directory: "
                             "experiments.loadgen, .run, .serve; tokens need output.tokens=all)")
    return request_samples(read_requests(d), read_tokens(d), prefill_chunk, tolerance, source=d.name)


@dataclass
class RequestFit:
    """``fit_linear_requests``' result: the step-cost model, the per-request overhead it found in isolated TTFTs
    (not part of the model: a simulated request has none), and the fit's report (overhead included)."""

    model: LinearCostModel
    request_overhead_s: float
    report: FitReport
    counts: dict[str, int]

    def predict(self, samples: Sequence[RequestSample]) -> np.ndarray:
        return predict(self.model, [s.steps for s in samples]) + self.request_overhead_s * _is_ttft(samples)


def _is_ttft(samples: Sequence[RequestSample]) -> np.ndarray:
    return np.array([s.kind == "ttft" for s in samples], dtype=float)


def fit_linear_requests(samples: Sequence[RequestSample], *, target: str = "mean", iterations: int = 3,
                        labels: Sequence[str] | None = None) -> RequestFit:
    """The linear step-cost model from request-level samples (``request_samples``) and/or measured steps
    (``kind="step"``), by non-negative least squares, with one more non-negative term: a fixed overhead of each
    isolated TTFT (HTTP and tokenisation on a server; 0 in a simulated run), kept out of the model.

    ``target``: ``relative`` minimises the squared relative error of each sample; ``mean`` (default) then
    reweights by the model's own prediction (``iterations`` times), which fits each shape's mean duration on a
    relative scale (see ``experiments.calibrate.fit_linear_mean``). Sample weights multiply in. Labels default to
    each sample's kind.
    """
    if target not in ("mean", "relative"):
        raise ValueError(f"calibrate.linear_target={target!r}; allowed: ['mean', 'relative']")
    if not samples:
        raise ValueError("no request-level samples to fit (does the run have isolated requests or decode stretches?)")
    X = np.column_stack([feature_matrix([s.steps for s in samples]), _is_ttft(samples)])
    y = _durations([s.duration_s for s in samples], len(samples))
    w0 = np.array([s.weight for s in samples], dtype=float)
    if not np.all(np.isfinite(w0) & (w0 >= 0)):
        raise ValueError("sample weights must be finite and >= 0")
    coef = _nnls(X, y, w0 / y)
    for _ in range(iterations if target == "mean" else 0):
        pred = X @ coef
        if not np.all(pred > 0):
            break
        coef = _nnls(X, y, w0 / pred)
    model = LinearCostModel(**dict(zip(LINEAR_TERMS, coef[:-1].tolist(), strict=True)))
    labels = [s.kind for s in samples] if labels is None else list(labels)
    counts = {k: sum(s.kind == k for s in samples) for k in SAMPLE_KINDS}
    return RequestFit(model, float(coef[-1]), _report(X @ coef, y, labels), counts)


def cross_validate_requests(samples: Sequence[RequestSample], folds: int = 5, seed: int = CV_SEED,
                            target: str = "mean") -> np.ndarray:
    """Held-out signed relative errors of ``fit_linear_requests``, one per sample (k folds, as ``cross_validate``)."""
    y = np.array([s.duration_s for s in samples], dtype=float)
    rel = np.empty(len(y))
    for train, test in _folds(len(y), folds, seed):
        fit = fit_linear_requests([samples[i] for i in train], target=target)
        rel[test] = (fit.predict([samples[i] for i in test]) - y[test]) / y[test]
    return rel
