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

from core.batch import StepFeatures
from core.records import StepRecord
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import CostModel, check_keys
from sim.cost.linear import TARGET as LINEAR_TARGET
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import RooflineCostModel

Measurement = StepFeatures | Sequence[StepFeatures]

LINEAR_TERMS = ("c0_s", "per_prefill_token_s", "per_decode_seq_s", "per_attention_pair_s", "per_kv_token_read_s",
                "per_prefill_context_token_s")
FEATURE_COLUMNS = ("steps", "num_prefill_tokens", "num_decode_seqs", "attention_pairs", "kv_tokens_read",
                   "prefill_context_tokens")
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
    labels = set()
    for f in steps_of(m):
        pre, dec = f.num_prefill_tokens > 0, f.num_decode_seqs > 0
        labels.add("mixed" if pre and dec else "prefill" if pre else "decode" if dec else "empty")
    return labels.pop() if len(labels) == 1 else "mixed"


def feature_matrix(features: Sequence[Measurement]) -> np.ndarray:
    """Columns [1, num_prefill_tokens, num_decode_seqs, attention_pairs, kv_tokens_read, prefill context tokens]:
    the linear model's terms (prefill context = cached tokens the prefill chunks attend to).

    A run of steps is the sum of its rows, so its first column counts its steps (each pays the intercept).
    """
    rows = [[sum(v) for v in zip(*((1, f.num_prefill_tokens, f.num_decode_seqs, f.attention_pairs, f.kv_tokens_read,
                                    f.prefill_kv_tokens - f.num_prefill_tokens)
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
    p = predict(cost_model, features)
    labels = [shape_label(m) for m in features] if labels is None else list(labels)
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
    A, b = X * w[:, None], y * w
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, b)
    model = LinearCostModel(**dict(zip(LINEAR_TERMS, (coef / scale).tolist(), strict=True)))
    return model, report(model, features, y, labels)


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


def cross_validate(fit: Callable[[list[Measurement], np.ndarray], CostModel], features: Sequence[Measurement],
                   durations: Sequence[float] | np.ndarray, folds: int = 5, seed: int = CV_SEED) -> np.ndarray:
    """Held-out signed relative errors, one per measurement: k folds of a fixed random permutation; ``fit`` maps
    (training measurements, durations) to the cost model that prices the held-out fold."""
    y = _durations(durations, len(features))
    if not 2 <= folds <= len(y):
        raise ValueError(f"folds={folds}; allowed: 2..{len(y)} (number of measurements)")
    fold = np.empty(len(y), dtype=int)
    fold[np.random.default_rng(seed).permutation(len(y))] = np.arange(len(y)) % folds
    rel = np.empty(len(y))
    for k in range(folds):
        train, test = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        cost = fit([features[i] for i in train], y[train])
        rel[test] = (predict(cost, [features[i] for i in test]) - y[test]) / y[test]
    return rel


def steps_from_csv(path: str | Path) -> tuple[list[StepFeatures], np.ndarray, np.ndarray]:
    """Read a run's steps.csv (columns ``StepRecord.columns()``): (features, durations in s, replica ids)."""
    path = Path(path)
    names = StepFeatures.names()
    features, durations, replicas = [], [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = sorted(set(StepRecord.columns()) - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {StepRecord.columns()}")
        for line, row in enumerate(reader, start=2):
            try:
                features.append(StepFeatures(**{k: int(row[k]) for k in names}))
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
                      fit: FitReport | None = None, note: str = "", fitted_for: tuple[str, str] | None = None) -> Path:
    """A YAML usable as a ``conf/cost_model`` option, with a commented summary; the full report (if given) goes
    next to it as ``<stem>.report.json``. ``fitted_for`` = (model name, hardware name) the measurements came from:
    loading the file for another model or hardware then fails unless the run allows it."""
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
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False))
    return path


def load_calibration(path: str | Path, model: ModelSpec | Mapping[str, Any] | None = None,
                     hardware: HardwareSpec | Mapping[str, Any] | None = None,
                     allow_mismatch: bool = False) -> LinearCostModel | RooflineCostModel:
    """The cost model a calibration file describes; a roofline file needs ``model`` and ``hardware`` (it
    interpolates the run's) unless it spells them out. A file fitted for another model or hardware than the
    run's is refused (its step times would silently be another machine's) unless ``allow_mismatch``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cost_model.path={str(path)!r}: no such calibration file (an experiments.calibrate output)")
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(cfg).__name__}")
    fitted_for = cfg.pop("fitted_for", None) or {}
    for key, given in (("model", model), ("hardware", hardware)):
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
