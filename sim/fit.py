"""Fit cost models to measured step times (a profile, a run's steps.csv) or to request-level samples (a server
seen as a black box).

A *measurement* is one step (``StepFeatures``) or a run of steps whose durations were measured as one sum (e.g. the
chunks of one chunked prefill): the linear model sums the run's feature rows (its intercept counts steps), the
roofline sums its step times. Errors are relative: (predicted − measured) / measured. The fitted model is written as
a ready ``cost_model`` config by ``sim.cost.calibrated``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares, nnls

from core.batch import StepFeatures
from core.checks import check_keys
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import CostModel
from sim.cost.linear import LinearCostModel
from sim.cost.roofline import COMM, RooflineCostModel
from sim.cost.roofline import PARAMS as ROOFLINE_PARAMS

Measurement = StepFeatures | Sequence[StepFeatures]
LINEAR_TERMS = ("c0_s", "per_prefill_token_s", "per_decode_seq_s", "per_attention_pair_s", "per_kv_token_read_s",
                "per_prefill_context_token_s", "per_draft_token_s")
FEATURE_COLUMNS = ("steps", "num_prefill_tokens", "num_decode_seqs", "attention_pairs", "kv_tokens_read",
                   "prefill_context_tokens", "num_draft_tokens")
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
    percent. On the published GPU measurements (experiments.published, 5-fold) relative weighting had the lower held-out
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
    fixed: np.ndarray  # (steps,) collective and kernel-launch seconds (not scaled by the efficiencies)
    owner: np.ndarray  # (steps,) which measurement each step belongs to
    num_rows: int
    host: float = 0.0  # host seconds a step's device time overlaps (sim.cost.roofline: max(device, host))

    def step(self, groups: np.ndarray, fixed: np.ndarray) -> np.ndarray:
        """A step's price (no overhead) from its summed op-group times: max(groups + fixed, host)."""
        return np.maximum(groups + fixed, self.host)

    def predict(self, compute_eff: float, bw_eff: float, overhead_s: float) -> np.ndarray:
        per_step = self.step(np.maximum(self.compute / compute_eff, self.memory / bw_eff).sum(axis=1),
                               self.fixed) + overhead_s
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
            parts = ref.breakdown(f)
            fixed.append((sum(parts[k] for k in COMM) if ops is None or "allreduce" in ops else 0.0)
                         + (parts["kernels"] if ops is None else 0.0))
            owner.append(i)
    shape = (len(owner), len(groups))
    return _RooflineTerms(np.array(compute, float).reshape(shape), np.array(memory, float).reshape(shape),
                          np.array(fixed, float), np.array(owner, dtype=np.int64), len(features),
                          ref.host_s[0] if ops is None else 0.0)


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
        steps = terms.step(np.maximum(terms.compute[None] / ce, terms.memory[None] / bes).sum(axis=2), terms.fixed)
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
    if ref.host_kernel_s and ref.pp > 1:
        raise ValueError("fit_roofline: host_kernel_s > 0 is fitted with pp = 1 only (one host term per step)")
    y = _durations(durations, len(features))
    if loss not in ("linear", "soft_l1"):
        raise ValueError(f"loss={loss!r}; allowed: 'linear', 'soft_l1'")
    if not f_scale > 0:
        raise ValueError(f"f_scale={f_scale!r}; allowed: a number > 0")
    ce, be, o = _fit_terms(_roofline_terms(ref, features, ops), y, loss, f_scale)
    fitted = ref.replace(compute_eff=ce, bw_eff=be, overhead_s=o)
    priced = fitted if ops is None else OpGroupCost(fitted, tuple(ops))
    return fitted, report(priced, features, y, labels)


HOST_GRID = 4001  # candidates of fit_host_kernel_s, 0 to the longest measurement / kernels


def fit_host_kernel_s(ref: RooflineCostModel, features: Sequence[Measurement],
                      durations: Sequence[float] | np.ndarray) -> float:
    """The per-kernel host cost (``host_kernel_s``) that minimises the median relative error of ``ref`` (pp = 1;
    everything else of it fixed) on the measurements.

    A step with tokens costs max(device, kernels x host_kernel_s) + overhead (``sim.cost.roofline``), so each step's
    device time is priced once and the candidates (a grid of ``HOST_GRID`` from 0 to the longest measurement over
    the kernel count: the host alone explaining it) are compared vectorised; the smallest best candidate wins."""
    if ref.pp > 1:
        raise ValueError("fit_host_kernel_s: pp = 1 only (one host term per step)")
    y = _durations(durations, len(features))
    device = ref.replace(host_kernel_s=0.0, overhead_s=0.0)
    steps = [f for m in features for f in steps_of(m)]
    dev = np.array([device.step_time(f) for f in steps])
    busy = np.array([f.num_batched_tokens > 0 for f in steps])  # an empty step launches nothing
    starts = np.cumsum([0] + [len(steps_of(m)) for m in features])[:-1]
    kernels = ref.kernels[0]
    grid = np.linspace(0.0, float(y.max()) / kernels, HOST_GRID)
    per_step = np.where(busy, np.maximum(dev, grid[:, None] * kernels), dev) + ref.overhead_s
    err = np.median(np.abs(np.add.reduceat(per_step, starts, axis=1) - y) / y, axis=1)
    return float(grid[int(np.argmin(err))])


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


# ---- calibration from request-level timings (a server seen as a black box) --------------------------------------
SAMPLE_KINDS = ("ttft", "itl", "step")


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
