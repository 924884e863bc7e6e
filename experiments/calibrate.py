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
(``sim.calibration.request_samples``). ``sim.calibration`` fits the linear model and the roofline's efficiencies,
and the output directory gets:

- ``linear.yaml`` / ``roofline.yaml``: ready cost models; use one with
  ``python -m experiments.run cost_model=calibrated cost_model.path=<dir>/linear.yaml``
- ``linear.report.json`` / ``roofline.report.json`` and ``fit_report.json`` (both fits, per shape group, and the
  linear model's 5-fold cross-validated relative error)
- ``profile.csv`` (one row per shape: features, median / min / max seconds), ``grid.json`` (the resolved grid and
  the shapes left out) and ``calibration_scatter.png``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.batch import LATER_FEATURES, Batch, StepFeatures
from core.checks import check_bool
from core.request import Status
from core.shapes import ShapedBatch, admit_chunk, shape_blocks
from experiments.build import (
    build_executors,
    build_replicas,
    engine_clock,
    hardware_spec,
    model_spec,
    num_kv_blocks,
    spec_method,
)
from experiments.cli import user_errors
from sim.calibration import (
    DEFAULT_TOLERANCE,
    FitReport,
    RequestFit,
    RequestSample,
    cross_validate,
    cross_validate_requests,
    fit_linear,
    fit_linear_requests,
    fit_roofline,
    predict,
    request_samples_from_run,
    steps_from_csv,
    write_calibration,
)
from sim.noise import record_step_noise

log = logging.getLogger(__name__)

GRID_KEYS = ("prefill_lens", "prefill_cached", "decode_batch_sizes", "decode_contexts", "mixed_chunks",
             "mixed_decodes", "mixed_context", "verify_drafts")
AUTO = "auto"
AUTO_KEYS = ("prefill_lens", "prefill_cached", "decode_batch_sizes", "decode_contexts")
FITS = ("linear", "roofline")
CV_FOLDS = 5
LINEAR_TARGETS = ("mean", "relative")
MEAN_FIT_ITERATIONS = 3


@dataclass(frozen=True)
class Shape:
    """One profiled step: prefill chunks as (cached tokens, chunk tokens) and decodes as the context each attends
    to (its new token included)."""

    group: str  # prefill | decode | mixed | verify
    label: str
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    drafts: int = 0  # verify: draft tokens each decode verifies (speculative decoding)

    def blocks(self, block_size: int) -> int:
        return shape_blocks(self.prefills, [t + self.drafts for t in self.decodes], block_size)


@dataclass
class ProfileRow:
    shape: Shape
    features: StepFeatures
    samples: list[float]

    @property
    def median_s(self) -> float:
        """The median sample (the lower of the two middle ones for an even count: a sample that was measured,
        at the features the row records)."""
        return float(sorted(self.samples)[(len(self.samples) - 1) // 2])


def _ints(grid: Mapping[str, Any], key: str, lo: int) -> list[int]:
    v = grid.get(key, [])
    vals = [v] if isinstance(v, int) else list(v or [])
    if any(isinstance(x, bool) or not isinstance(x, int) or x < lo for x in vals):
        raise ValueError(f"calibrate.grid.{key}={vals!r}; allowed: integers >= {lo}, or auto")
    return vals


def geometric(lo: int, hi: int, ratio: int) -> list[int]:
    """lo, lo*ratio, lo*ratio², ... below ``hi``, then ``hi`` itself ([] when hi < lo)."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= ratio
    return out + [hi] if hi >= lo else out


def auto_grid(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, list[int]]:
    """What ``auto`` stands for in ``calibrate.grid``: the whole range a run of this model and scheduler reaches.

    - prefill_lens: 8, 16, 32, ... up to the scheduler's token budget (a step's prefill never exceeds it);
    - prefill_cached: 0, 128, 512, 2048, ... (x4) up to max_model_len minus the budget (the context a chunk of a
      long prompt, or a suffix after a prefix-cache hit, attends to);
    - decode_batch_sizes: 1, 2, 4, ... up to max_num_seqs;
    - decode_contexts: 32, 128, 512, ... (x4) up to max_model_len.
    """
    budget = min(max_num_batched_tokens, max_model_len)
    return {"prefill_lens": geometric(8, budget, 2),
            "prefill_cached": [0] + geometric(128, max_model_len - budget, 4),
            "decode_batch_sizes": geometric(1, max_num_seqs, 2),
            "decode_contexts": geometric(32, max_model_len, 4)}


def resolve_grid(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None) -> dict[str, Any]:
    """``grid`` with every ``auto`` value replaced (``auto_grid``); auto needs the scheduler limits."""
    grid = dict(grid)
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise ValueError(f"calibrate.grid: unknown keys {unknown}; allowed: {list(GRID_KEYS)}")
    autos = [k for k, v in grid.items() if v == AUTO]
    if autos:
        bad = sorted(set(autos) - set(AUTO_KEYS))
        if bad:
            raise ValueError(f"calibrate.grid.{bad[0]}=auto is not supported; auto applies to {list(AUTO_KEYS)}")
        if max_num_batched_tokens is None or max_num_seqs is None:
            raise ValueError("calibrate.grid: auto values need the scheduler's max_num_batched_tokens and max_num_seqs")
        grid.update({k: v for k, v in auto_grid(max_model_len, max_num_batched_tokens, max_num_seqs).items()
                     if k in autos})
    return grid


def grid_plan(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
              max_num_seqs: int | None = None, max_blocks: int | None = None,
              block_size: int = 16) -> tuple[list[Shape], list[str]]:
    """The profile's shapes and a note per shape left out: prefill lens x cached context, decode batch x context,
    and mixed steps (one chunk after ``mixed_context`` cached tokens plus decodes at ``mixed_context``).

    A single value beyond ``max_model_len`` is an error; a combination beyond it (a chunk after a long cached
    context) is skipped, as is a shape needing more KV blocks than ``max_blocks`` (the run's KV pool: a batch that
    big never happens there)."""
    grid = resolve_grid(grid, max_model_len, max_num_batched_tokens, max_num_seqs)
    lens, cached = _ints(grid, "prefill_lens", 1), _ints(grid, "prefill_cached", 0) or [0]
    batches, contexts = _ints(grid, "decode_batch_sizes", 1), _ints(grid, "decode_contexts", 2)
    chunks, mixed_dec = _ints(grid, "mixed_chunks", 1), _ints(grid, "mixed_decodes", 1)
    mixed_ctx = _ints(grid, "mixed_context", 2) or [256]
    if len(mixed_ctx) != 1:
        raise ValueError(f"calibrate.grid.mixed_context={mixed_ctx}; allowed: one integer >= 2")
    ctx = mixed_ctx[0]
    for key, vals, extra in (("prefill_lens", lens, 0), ("decode_contexts", contexts, 0),
                             ("mixed_context", mixed_ctx, 0), ("prefill_cached", cached, 1)):
        too_long = [v for v in vals if v + extra > max_model_len]
        if too_long:
            raise ValueError(f"calibrate.grid.{key}: {too_long} needs more positions than the model's "
                             f"max_model_len {max_model_len}")
    shapes = [Shape("prefill", f"n={n},c={c}", prefills=((c, n),)) for c in cached for n in lens]
    shapes += [Shape("decode", f"b={b},ctx={t}", decodes=(t,) * b) for b in batches for t in contexts]
    shapes += [Shape("mixed", f"n={n},c={ctx},b={b},ctx={ctx}", prefills=((ctx, n),), decodes=(ctx,) * b)
               for n in chunks for b in mixed_dec]
    shapes += [Shape("verify", f"b={b},ctx={t},k={k}", decodes=(t,) * b, drafts=k)
               for k in _ints(grid, "verify_drafts", 1) for b in batches for t in contexts]
    if not shapes:
        raise ValueError("calibrate.grid describes no shapes; give prefill_lens and/or decode_batch_sizes x "
                         "decode_contexts")
    kept, notes = [], []
    for s in shapes:
        longest = max([c + n for c, n in s.prefills] + [t + s.drafts for t in s.decodes])
        if longest > max_model_len:
            notes.append(f"{s.group} {s.label}: {longest} positions > max_model_len {max_model_len}")
        elif max_blocks is not None and s.blocks(block_size) > max_blocks:
            notes.append(f"{s.group} {s.label}: {s.blocks(block_size)} KV blocks > the pool's {max_blocks}")
        else:
            kept.append(s)
    if not kept:
        raise ValueError(f"calibrate.grid: no shape fits ({'; '.join(notes[:3])}, ...)")
    return kept, notes


def grid_shapes(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
                max_num_seqs: int | None = None, max_blocks: int | None = None, block_size: int = 16) -> list[Shape]:
    """``grid_plan``'s shapes."""
    return grid_plan(grid, max_model_len, max_num_batched_tokens, max_num_seqs, max_blocks, block_size)[0]


def profile(cfg: DictConfig, shapes: Sequence[Shape], repeats: int = 5, warmup: int = 2, seed: int = 0,
            progress: bool = False) -> list[ProfileRow]:
    """Time every shape on the configured backend (one replica, a KV pool sized for the largest shape), shapes in
    a seeded random order.

    A shape's executions run like consecutive steps of a run: its decodes stay admitted and each execution
    decodes one more token of each (an engine keeps their KV copies from step to step and appends, as it does
    in a run, instead of gathering every context anew), its prefill chunks are admitted afresh each time. The
    decodes start a few tokens short so that the row's features, those of the median execution, have the
    shape's contexts (a context near max_model_len is moved down to leave the room)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"calibrate.repeats={repeats} must be >= 1 and calibrate.warmup={warmup} >= 0")
    spec = model_spec(cfg)
    runs, mid = warmup + repeats, warmup + (repeats - 1) // 2

    def start(t: int) -> int:  # a decode's first context: `mid` executions later it is t (or as near as fits)
        return max(2, min(t - mid, spec.max_model_len - (runs - 1)))

    bs = int(cfg.kv.block_size)
    num_blocks = max(shape_blocks(s.prefills, [start(t) + runs - 1 + s.drafts for t in s.decodes], bs)
                     for s in shapes)
    one = OmegaConf.merge(cfg, {"replicas": 1, "kv": {"num_blocks": num_blocks}})
    replica = build_replicas(one, spec, num_blocks)[0]
    executor = build_executors(one, spec, [replica])[0]
    kv = replica.kv
    samples: list[list[float]] = [[] for _ in shapes]
    features: list[StepFeatures | None] = [None] * len(shapes)
    for n, i in enumerate(np.random.default_rng(seed).permutation(len(shapes)).tolist()):
        s = shapes[i]
        shaped = ShapedBatch(s.prefills, [start(t) for t in s.decodes], name=f"profile{i}", num_draft_tokens=s.drafts)
        batch = shaped.admit(kv)
        for r in range(runs):  # back to back, like the consecutive steps of a run
            if r:
                batch = _next_step(shaped, kv)
            if r == mid:
                features[i] = batch.features
            out = executor.execute(batch)
            if r >= warmup:
                samples[i].append(float(out.duration_s))
        shaped.release(kv)
        for st in shaped.states:
            executor.release(st.id)
        if progress and (n + 1) % 10 == 0:
            log.info(f"profiled {n + 1}/{len(shapes)} shapes")
    return [ProfileRow(s, f, x) for s, f, x in zip(shapes, features, samples, strict=True)]


def _next_step(shaped: ShapedBatch, kv: Any) -> Batch:
    """The shape's next step: each prefill chunk admitted afresh, each decode one token further."""
    chunks = []
    k = len(shaped.prefills)
    for st, (c, n) in zip(shaped.states[:k], shaped.prefills, strict=True):
        kv.free(st, 0.0)
        st.status = Status.WAITING
        chunks.append(admit_chunk(kv, st, c, n))
    for st in shaped.states[k:]:
        st.output_token_ids.append(0)
        chunks.append(admit_chunk(kv, st, st.num_computed_tokens + 1, 1, num_draft_tokens=shaped.num_draft_tokens))
    return Batch(chunks)


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
        if not csv_path.is_file() and not csv_path.with_suffix(".parquet").is_file():  # either format
            raise ValueError(f"calibrate.steps: no steps.csv at {p}")
        f, d, _ = steps_from_csv(csv_path)
        keep = [i for i, x in enumerate(d.tolist()[:limit]) if x > 0 and math.isfinite(x)]
        feats += [f[i] for i in keep]
        durs += [float(d[i]) for i in keep]
    return feats, np.asarray(durs, dtype=float)


def group_of(f: StepFeatures) -> str:
    """``StepFeatures.kind``, an empty step counted as a decode (the calibration data's groups)."""
    return "decode" if f.kind == "empty" else f.kind


def draft_length(cfg: DictConfig) -> int:
    """The drafts per decode a speculation policy asks for at most (``k``, else ``max_k``; 4 if it names neither)."""
    policy = cfg.spec.policy
    return int(policy.get("k", policy.get("max_k", 4)))


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


def config_grid(cfg: DictConfig) -> tuple[list[Shape], list[str], dict[str, Any]]:
    """``calibrate.grid`` for this config: (shapes, notes on the shapes left out, the grid with auto resolved).
    Auto values follow the model's max_model_len and the scheduler's limits; shapes beyond the KV pool
    (``kv.num_blocks``, else what ``kv.memory_bytes`` or the hardware holds) are left out."""
    spec, sched = model_spec(cfg), cfg.scheduler
    grid = OmegaConf.to_container(cfg.calibrate.grid, resolve=True)
    if grid.get("verify_drafts") == AUTO:  # the draft length of the run's speculative decoding; none without it
        grid["verify_drafts"] = [draft_length(cfg)] if spec_method(cfg) else []
    limits = (spec.max_model_len, int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
    pool = num_kv_blocks(cfg, spec, hardware_spec(cfg))
    shapes, notes = grid_plan(grid, *limits, max_blocks=pool, block_size=int(cfg.kv.block_size))
    return shapes, notes, resolve_grid(grid, *limits)


def run_profile(cfg: DictConfig, out_dir: str | Path) -> Path:
    """Profile ``calibrate.grid`` on the configured backend into ``<out_dir>/profile.csv`` (and the resolved grid,
    with the shapes left out, into ``grid.json`` beside it)."""
    c = cfg.calibrate
    shapes, notes, grid = config_grid(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps({"grid": grid, "num_shapes": len(shapes), "skipped": notes},
                                              indent=2) + "\n")
    if notes:
        log.info(f"calibrate: {len(shapes)} shapes; {len(notes)} left out (see grid.json), e.g. {notes[0]}")
    rows = profile(cfg, shapes, int(c.repeats), int(c.warmup), int(c.seed), bool(c.get("progress", False)))
    return write_profile(out / "profile.csv", rows)


def read_profile(path: str | Path) -> tuple[list[StepFeatures], list[float], list[str]]:
    """(features, median seconds, group) per row of a profile.csv."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibrate.profile_from: no profile.csv at {path}")
    feats, durs, groups = [], [], []
    with open(path, newline="") as fh:
        for line, row in enumerate(csv.DictReader(fh), start=2):
            try:
                # features added since the first profiles (core.batch.LATER_FEATURES): older ones have none (0)
                feats.append(StepFeatures(**{k: int(row[k] if k not in LATER_FEATURES else row.get(k) or 0)
                                             for k in StepFeatures.names()}))
                durs.append(float(row["median_s"]))
                groups.append(row["group"])
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{line}: not a profile row ({e})") from None
    return feats, durs, groups


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


def fit_with_requests(cfg: DictConfig, samples: Sequence[RequestSample], labels: Sequence[str],
                      fits: Sequence[str], target: str) -> tuple[dict[str, Any], dict[str, FitReport], RequestFit]:
    """The requested fits on request-level samples (and measured steps, ``kind="step"``): the linear model with a
    per-request TTFT overhead (``sim.calibration.fit_linear_requests``); the roofline on the durations less that
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
            [samples[i].steps for i in keep], y[keep], model_spec(cfg), hardware_spec(cfg),
            labels=[labels[i] for i in keep])
    return models, reports, rfit


def calibrate(cfg: DictConfig, out_dir: str | Path, extra_steps: Sequence[StepSource] = ()) -> Calibration:
    """Profile (``calibrate.profile``; or reuse ``calibrate.profile_from``, a profile.csv) and/or read
    ``calibrate.steps`` + ``extra_steps`` and/or the request-level ``calibrate.runs``, fit, write files."""
    c = cfg.calibrate
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    features: list[StepFeatures] = []
    durations: list[float] = []
    labels: list[str] = []
    paths: dict[str, Path] = {}
    if c.get("profile_from") or profiling(c):
        paths["profile"] = Path(c.profile_from) if c.get("profile_from") else run_profile(cfg, out)
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
        models, reports, rfit = fit_with_requests(cfg, samples, labels, list(c.fits), target)
        features = [s.steps for s in samples]
        durations = [s.duration_s for s in samples]
    y = np.asarray(durations, dtype=float)
    if rfit is None:
        models, reports = fit_all(cfg, features, y, labels, list(c.fits), weights, target)
    spec, hw = model_spec(cfg), hardware_spec(cfg)
    source_text = ", ".join(f"{s[0]} (first {s[1]} steps)" if isinstance(s, tuple) else str(s) for s in sources)
    note = (f"model={spec.name} hardware={hw.name} backend={cfg.backend.name}; {len(features)} measurements "
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
    summary.update(model=spec.name, hardware=hw.name, backend=cfg.backend.name, num_measurements=len(features),
                   sources=[str(s) for s in sources], profile=str(paths.get("profile")),
                   engine_clock=engine_clock(cfg) if cfg.backend.name == "engine" else None)
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


@hydra.main(config_path="../conf", config_name="calibrate", version_base="1.3")
@user_errors
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    cal = calibrate(cfg, out)
    log.info(describe(cal))
    for name in FITS:
        if name in cal.paths:
            log.info(f"{name}: {cal.paths[name].resolve()}")
    first = next(n for n in FITS if n in cal.paths)
    log.info(f"use it: python -m experiments.run cost_model=calibrated cost_model.path={cal.paths[first].resolve()}")


if __name__ == "__main__":
    main()
