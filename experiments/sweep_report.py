"""`python -m experiments.sweep_report MULTIRUN_DIR`: one figure and one table for a Hydra multirun.

Reads every job directory's metrics.json and .hydra/overrides.yaml (job directories are named by job number, and
are found at any depth under MULTIRUN_DIR; jobs that did not finish are left out and named), builds one table row
per job with a column per override key, then pivots it: TTFT p90, max-stall p99 and goodput against one swept key
(``--x``, default the token budget), one line per value of another (``--series``, default the scheduler), and one
row of panels (a facet) per combination of every other key that takes more than one value. Nothing is dropped:
two jobs with the same value of every swept key are refused, naming them; ``--where KEY=VALUE`` keeps only the
jobs with that value (e.g. to draw one facet). Writes sweep_report.png and sweep_report.md into the multirun
directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

import pandas as pd
import yaml
from matplotlib.ticker import FuncFormatter

from core.output import read_metrics
from experiments.plots import axis_label, figure, lines

log = logging.getLogger(__name__)

PANELS = (("ttft_s", "p90", "TTFT p90 (s)"), ("max_stall_s", "p99", "max stall p99 (s)"),
          ("goodput_rps", None, "goodput (req/s)"))
LOG_Y = ("ttft_s", "max_stall_s")
MAX_FACETS = 12


def _natural(name: str) -> tuple:
    """Sort key: job 10 after job 9, at every level of a nested path."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[/\\]", name))


def _job_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` (at any depth) holding a job: a .hydra/overrides.yaml or a metrics.json. A job's
    own subdirectories are not searched; hidden directories (.hydra, .submitit) never are."""
    found = []
    for d, subdirs, files in os.walk(root):
        here = Path(d)
        subdirs[:] = [s for s in subdirs if not s.startswith(".")]
        if here != root and ((here / ".hydra" / "overrides.yaml").is_file() or "metrics.json" in files):
            found.append(here)
            subdirs[:] = []
    return sorted(found, key=lambda p: _natural(p.relative_to(root).as_posix()))


def collect(root: Path, incomplete: list[str] | None = None) -> list[tuple[dict[str, str], dict]]:
    """(overrides, metrics) of every complete job under ``root`` (job directories are named by job number, at any
    depth; the overrides come from each job's .hydra/overrides.yaml). Jobs that did not finish (no metrics.json beside
    their .hydra/, or a ``run_status`` other than ``complete``) are left out and named in ``incomplete``."""
    return [(o, m) for _, o, m in _collect(root, incomplete)]


def _collect(root: Path, incomplete: list[str] | None) -> list[tuple[str, dict[str, str], dict]]:
    jobs, skipped = [], []
    for job in _job_dirs(root):
        name = job.relative_to(root).as_posix()
        overrides_file = job / ".hydra" / "overrides.yaml"
        metrics_file = job / "metrics.json"
        if not metrics_file.is_file():
            skipped.append(f"{name} (no metrics.json)")
            continue
        metrics = read_metrics(metrics_file)
        status = metrics.get("run_status", "complete")  # run directories written before run_status: complete
        if status != "complete":
            skipped.append(f"{name} (run_status {status})")
            continue
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        jobs.append((name, dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o), metrics))
    if incomplete is not None:
        incomplete.extend(skipped)
    if not jobs:
        raise ValueError(f"{root}: no job directories with a complete metrics.json (is it a multirun directory?)"
                         + (f"; incomplete jobs: {', '.join(skipped)}" if skipped else ""))
    return jobs


def value(metrics: dict, key: str, pct: str | None) -> float:
    v = metrics.get(key)
    v = v.get(pct) if pct and v is not None else v
    return float("nan") if v is None else float(v)


def table(root: Path, incomplete: list[str] | None = None) -> tuple[pd.DataFrame, list[str]]:
    """One row per complete job: ``job``, one column per override key (strings; missing where a job lacks the
    key) and one per panel (named by its label). Also the override keys, in first-seen order."""
    rows, keys = [], {}
    for name, overrides, metrics in _collect(root, incomplete):
        keys.update(dict.fromkeys(overrides))
        rows.append({"job": name, **overrides, **{label: value(metrics, k, p) for k, p, label in PANELS}})
    return pd.DataFrame(rows), list(keys)


def swept_keys(df: pd.DataFrame, keys: list[str]) -> list[str]:
    """Override keys that take more than one value (a key missing in some jobs counts as a value)."""
    return [k for k in keys if df[k].nunique(dropna=False) > 1]


def _order(column: pd.Series) -> pd.Series:
    """Sort order of a column: by number where every value is one (64 before 256), else as text."""
    numbers = pd.to_numeric(column, errors="coerce")
    return numbers if numbers.notna().all() else column.astype(str)


def report(root: str | Path, x: str = "scheduler.max_num_batched_tokens", series: str = "scheduler",
           where: dict[str, str] | None = None) -> Path:
    root = Path(root)
    incomplete: list[str] = []
    df, keys = table(root, incomplete)
    for k, v in (where or {}).items():
        if k not in df.columns:
            raise ValueError(f"--where {k}: not an override of any job; override keys: {keys}")
        df = df[df[k] == str(v)]
        if df.empty:
            raise ValueError(f"--where {k}={v}: no job has that value")
    missing = [k for k in (x, series) if k not in df.columns or df[k].isna().any()]
    if missing:
        raise ValueError(f"not swept in every job: {missing}; swept keys: {swept_keys(df, keys)}")
    xv = pd.to_numeric(df[x], errors="coerce")
    if xv.isna().any():
        raise ValueError(f"--x {x}: not a number in every job ({sorted(set(df[x][xv.isna()]))})")
    df = df.assign(**{x: xv})
    facets = [k for k in swept_keys(df, keys) if k not in (x, series)]
    index = [*facets, series, x]
    dup = df[df.duplicated(index, keep=False)]
    if not dup.empty:
        first = dup.groupby(index, dropna=False)["job"].apply(list).iloc[0]
        raise ValueError(f"jobs {', '.join(first)} have the same value of every swept key {index}: one point "
                         f"cannot stand for both; tell them apart with an override, or keep one with --where")
    df = df.sort_values([*facets, series, x], key=_order)
    groups = list(df.groupby(facets, dropna=False, sort=False)) if facets else [((), df)]
    if len(groups) > MAX_FACETS:
        raise ValueError(f"{len(groups)} combinations of the other swept keys {facets}: more than {MAX_FACETS} "
                         f"facets; keep some with --where KEY=VALUE")
    names = sorted(df[series].unique())
    xs = sorted(df[x].unique())
    with figure(len(groups), len(PANELS)) as (fig, axes):
        for row, (fv, g) in zip(axes, groups, strict=True):
            fv = fv if isinstance(fv, tuple) else (fv,)
            facet = ", ".join(f"{k}={v}" for k, v in zip(facets, fv, strict=True))
            for ax, (key, _, label) in zip(row, PANELS, strict=True):
                wide = g.pivot(index=x, columns=series, values=label).reindex(index=xs, columns=names)
                lines(ax, xs, {n: wide[n].to_numpy() for n in names}, axis_label(x), label)
                if all(v > 0 for v in xs):
                    ax.set_xscale("log", base=2)
                    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                if key in LOG_Y and (g[label] > 0).any():
                    ax.set_yscale("log")  # latencies: a 10x spread stays readable
                if facet:
                    ax.set_title(facet, fontsize=8)
        fig.suptitle(f"{root.name}: {series} x {x}" + (f", one row per {', '.join(facets)}" if facets else ""))
        fig.tight_layout()
        fig.savefig(root / "sweep_report.png")
    cols = [*facets, series, x]
    rows = ["| " + " | ".join([*cols, *(p[2] for p in PANELS)]) + " |", "|" + "---|" * (len(cols) + len(PANELS))]
    for _, r in df.iterrows():
        rows.append("| " + " | ".join([*(str(r[k]) for k in (*facets, series)), f"{r[x]:g}",
                                       *(f"{r[p[2]]:.4g}" for p in PANELS)]) + " |")
    if incomplete:
        note = f"Left out, did not finish: job {', '.join(incomplete)}."
        rows += ["", note]
        log.warning(note)
    (root / "sweep_report.md").write_text("\n".join(rows) + "\n")
    return root / "sweep_report.png"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("multirun_dir")
    p.add_argument("--x", default="scheduler.max_num_batched_tokens")
    p.add_argument("--series", default="scheduler")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only the jobs with this override value (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bad = [w for w in args.where if "=" not in w]
    if bad:
        p.error(f"--where wants KEY=VALUE, got {bad}")
    where = dict(w.split("=", 1) for w in args.where)
    log.info("wrote %s", report(args.multirun_dir, args.x, args.series, where))


if __name__ == "__main__":
    main()
