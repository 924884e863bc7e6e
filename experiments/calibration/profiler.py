"""Measured steps for a fit: a profile of the grid's shapes on a backend, or the steps of earlier runs.

The profile admits batches to the replica's KVCacheManager with core.shapes (no workload, no scheduler): each shape
is run ``warmup`` untimed then ``repeats`` timed times back to back like a run's consecutive steps (the decodes
advance one token per execution); the median is the shape's duration. Engine steps are timed on the
``engine_clock`` stopwatch (thread CPU time on the one-thread CPU engine: far steadier than the wall clock on a
shared machine).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from core.batch import LATER_FEATURES, Batch, StepFeatures
from core.output import read_step_features
from core.request import Status
from core.shapes import ShapedBatch, admit_chunk, shape_blocks
from experiments.build import build_executors, build_replicas
from experiments.calibration.grid import Shape, config_grid
from experiments.config import ClusterConfig, RunConfig

log = logging.getLogger(__name__)


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


def profile(run: RunConfig, shapes: Sequence[Shape], repeats: int = 5, warmup: int = 2, seed: int = 0,
            progress: bool = False) -> list[ProfileRow]:
    """Time every shape on the run's backend (one replica, a KV pool sized for the largest shape), shapes in
    a seeded random order.

    A shape's executions run like consecutive steps of a run: its decodes stay admitted and each execution
    decodes one more token of each (an engine keeps their KV copies from step to step and appends, as it does
    in a run, instead of gathering every context anew), its prefill chunks are admitted afresh each time. The
    decodes start a few tokens short so that the row's features, those of the median execution, have the
    shape's contexts (a context near max_model_len is moved down to leave the room)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"calibrate.repeats={repeats} must be >= 1 and calibrate.warmup={warmup} >= 0")
    spec = run.model
    runs, mid = warmup + repeats, warmup + (repeats - 1) // 2

    def start(t: int) -> int:  # a decode's first context: `mid` executions later it is t (or as near as fits)
        return max(2, min(t - mid, spec.max_model_len - (runs - 1)))

    bs = run.kv.block_size
    num_blocks = max(shape_blocks(s.prefills, [start(t) + runs - 1 + s.drafts for t in s.decodes], bs)
                     for s in shapes)
    one = replace(run, num_kv_blocks=num_blocks, cluster=ClusterConfig(num_replicas=1))
    replica = build_replicas(one)[0]
    executor = build_executors(one, [replica])[0]
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
        f, d, _ = read_step_features(csv_path)
        keep = [i for i, x in enumerate(d.tolist()[:limit]) if x > 0 and math.isfinite(x)]
        feats += [f[i] for i in keep]
        durs += [float(d[i]) for i in keep]
    return feats, np.asarray(durs, dtype=float)


def run_profile(run: RunConfig, c: DictConfig, out_dir: str | Path) -> Path:
    """Profile the grid of the ``calibrate`` section ``c`` on the run's backend into ``<out_dir>/profile.csv`` (and
    the resolved grid, with the shapes left out, into ``grid.json`` beside it)."""
    shapes, notes, grid = config_grid(run, c.grid)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps({"grid": grid, "num_shapes": len(shapes), "skipped": notes},
                                              indent=2) + "\n")
    if notes:
        log.info(f"calibrate: {len(shapes)} shapes; {len(notes)} left out (see grid.json), e.g. {notes[0]}")
    rows = profile(run, shapes, int(c.repeats), int(c.warmup), int(c.seed), bool(c.get("progress", False)))
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
