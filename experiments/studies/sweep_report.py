"""`python -m experiments.sweep_report MULTIRUN_DIR`: one figure and one table for a Hydra multirun.

Reads every job directory's metrics.json and .hydra/overrides.yaml (job directories are named by job number, and
are found at any depth under MULTIRUN_DIR; jobs that did not finish are left out and named), builds one table row
per job with a column per override key, then pivots it: TTFT p90, max-stall p99 and goodput against one swept key
(``--x``, default the token budget), one line per value of another (``--series``, default the scheduler), and one
row of panels (a facet) per combination of every other key that takes more than one value. Nothing is dropped:
two jobs with the same value of every swept key are refused, naming them; ``--where KEY=VALUE`` keeps only the
jobs with that value (e.g. to draw one facet). Jobs that differ only in ``seed`` (``--repeat``; a multirun
``seed=0,1,2``) are repeats of one point: it is drawn at their mean with a shaded 95% interval (Student t, n - 1
degrees of freedom), and the table gets n, mean, ci_low and ci_high per metric. Dashed lines: the runs' SLO
targets (metrics.json ``slo``) on the TTFT and max-stall panels. Writes sweep_report.png and sweep_report.md into
the multirun directory.
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
from experiments.plots import axis_label, figure, legend_outside, lines, plain_log_ticks, threshold_line, y_from_zero
from experiments.studies.common import mean_ci

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
            error = f": {metrics['error']}" if metrics.get("error") else ""
            skipped.append(f"{name} (run_status {status}{error})")
            continue
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        jobs.append((name, dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o), metrics))
    if incomplete is not None:
        incomplete.extend(skipped)
    if not jobs:
        raise ValueError(f"{root}: no job directories with a complete metrics.json (is it a multirun directory?)"
                         + (f"; incomplete jobs: {', '.join(skipped)}" if skipped else ""))
    return jobs


def _config_value(job: Path, key: str) -> str | None:
    """``key``'s value in a job that does not override it: the group option Hydra chose (.hydra/hydra.yaml's
    runtime choices, e.g. ``scheduler``), else the key in the job's composed .hydra/config.yaml; None if neither."""
    hydra_file, config_file = job / ".hydra" / "hydra.yaml", job / ".hydra" / "config.yaml"
    if hydra_file.is_file():
        choices = (yaml.safe_load(hydra_file.read_text()) or {}).get("hydra", {}).get("runtime", {}).get("choices")
        if isinstance(choices, dict) and isinstance(choices.get(key), str):
            return choices[key]
    if config_file.is_file():
        node = yaml.safe_load(config_file.read_text())
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return None if node is None or isinstance(node, dict | list) else str(node)
    return None


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
        slo = metrics.get("slo") or {}
        rows.append({"job": name, **overrides, **{label: value(metrics, k, p) for k, p, label in PANELS},
                     **{f"slo:{k}": slo.get(k) for k, _, _ in PANELS}})
    return pd.DataFrame(rows), list(keys)


def repeats(df: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """One row per point (a value of every ``index`` key) over its repeated jobs: ``n``, and per panel the mean
    (named by its label) and ``<label> ci_low`` / ``<label> ci_high`` (95% Student-t interval; NaN with n = 1),
    and the SLO columns of the first job."""
    rows = []
    for key, g in df.groupby(index, dropna=False, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        row = {**dict(zip(index, key, strict=True)), "n": len(g), "jobs": list(g["job"])}
        for _, _, label in PANELS:
            mean, lo, hi = mean_ci(g[label].tolist())
            row.update({label: mean, f"{label} ci_low": lo, f"{label} ci_high": hi})
        row.update({c: g[c].iloc[0] for c in g.columns if c.startswith("slo:")})
        rows.append(row)
    return pd.DataFrame(rows).astype({f"{p[2]} {b}": float for p in PANELS for b in ("ci_low", "ci_high")})


def swept_keys(df: pd.DataFrame, keys: list[str]) -> list[str]:
    """Override keys that take more than one value (a key missing in some jobs counts as a value)."""
    return [k for k in keys if df[k].nunique(dropna=False) > 1]


def _order(column: pd.Series) -> pd.Series:
    """Sort order of a column: by number where every value is one (64 before 256), else as text."""
    numbers = pd.to_numeric(column, errors="coerce")
    return numbers if numbers.notna().all() else column.astype(str)


def report(root: str | Path, x: str = "scheduler.max_num_batched_tokens", series: str = "scheduler",
           where: dict[str, str] | None = None, repeat: str = "seed") -> Path:
    root = Path(root)
    if x == series:
        raise ValueError(f"--x and --series both name {x}: the series must be another swept key")
    incomplete: list[str] = []
    df, keys = table(root, incomplete)
    for k, v in (where or {}).items():
        if k not in df.columns:
            raise ValueError(f"--where {k}: not an override of any job; override keys: {keys}")
        df = df[df[k] == str(v)]
        if df.empty:
            raise ValueError(f"--where {k}={v}: no job has that value")
    for k in (x, series):  # a key no override sets in a job (a preset sweeping only rates) is its config value
        given = df[k] if k in df.columns else pd.Series([None] * len(df), index=df.index, dtype=object)
        df = df.assign(**{k: [v if isinstance(v, str) else _config_value(root / job, k)
                              for v, job in zip(given, df["job"], strict=True)]})
    missing = [k for k in (x, series) if df[k].isna().any()]
    if missing:
        raise ValueError(f"not swept in every job: {missing}; swept keys: {swept_keys(df, keys)}")
    xv = pd.to_numeric(df[x], errors="coerce")
    if xv.isna().any():
        raise ValueError(f"--x {x}: not a number in every job ({sorted(set(df[x][xv.isna()]))})")
    df = df.assign(**{x: xv})
    swept = swept_keys(df, keys)
    repeated = repeat in swept and repeat not in (x, series)
    facets = [k for k in swept if k not in (x, series, repeat)]
    index = [*facets, series, x]
    unique = [repeat, *index] if repeated else index  # the same seed twice is still two jobs for one point
    dup = df[df.duplicated(unique, keep=False)]
    if not dup.empty:
        first = dup.groupby(unique, dropna=False)["job"].apply(list).iloc[0]
        raise ValueError(f"jobs {', '.join(first)} have the same value of every swept key {unique}: one point "
                         f"cannot stand for both; tell them apart with an override, or keep one with --where")
    points = repeats(df, index)
    points = points.sort_values(index, key=_order)
    groups = list(points.groupby(facets, dropna=False, sort=False)) if facets else [((), points)]
    if len(groups) > MAX_FACETS:
        raise ValueError(f"{len(groups)} combinations of the other swept keys {facets}: more than {MAX_FACETS} "
                         f"facets; keep some with --where KEY=VALUE")
    names = sorted(points[series].unique())
    xs = sorted(points[x].unique())
    with figure(len(groups), len(PANELS)) as (fig, axes):
        for row, (fv, g) in zip(axes, groups, strict=True):
            fv = fv if isinstance(fv, tuple) else (fv,)
            facet = ", ".join(f"{k}={v}" for k, v in zip(facets, fv, strict=True))
            for ax, (key, _, label) in zip(row, PANELS, strict=True):
                def wide(column: str, g=g) -> pd.DataFrame:
                    return g.pivot(index=x, columns=series, values=column).reindex(index=xs, columns=names)
                means = wide(label)
                bands = None
                if repeated:
                    lo, hi = wide(f"{label} ci_low"), wide(f"{label} ci_high")
                    if key not in LOG_Y:
                        lo = lo.where(means < 0, lo.clip(lower=0))  # drawn cut at 0, like plots.drawn_ci
                    bands = {n: (lo[n].to_numpy(), hi[n].to_numpy()) for n in names}
                lines(ax, xs, {n: means[n].to_numpy() for n in names}, axis_label(x), label, bands=bands,
                      legend=False)
                for v in sorted(set(g[f"slo:{key}"].dropna())):
                    threshold_line(ax, float(v), f"SLO {float(v):g} s")
                if all(v > 0 for v in xs):
                    ax.set_xscale("log", base=2)
                    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                if key in LOG_Y and (g[label] > 0).any():
                    ax.set_yscale("log")  # latencies: a 10x spread stays readable
                    plain_log_ticks(ax.yaxis)
                y_from_zero(ax)
                if facet:
                    ax.set_title(facet, fontsize=8)
        legend_outside(fig)
        fig.suptitle(f"{root.name}: {series} x {x}" + (f", one row per {', '.join(facets)}" if facets else "")
                     + (f"; mean of {_span(points['n'])} {repeat}s per point, 95% band" if repeated else ""))
        fig.tight_layout()
        fig.savefig(root / "sweep_report.png", bbox_inches="tight")
    cols = [*facets, series, x]
    if repeated:
        metrics = [f"{p[2]} {s}" for p in PANELS for s in ("mean", "ci_low", "ci_high")]
        rows = ["| " + " | ".join([*cols, "n", *metrics]) + " |", "|" + "---|" * (len(cols) + 1 + len(metrics))]
    else:
        rows = ["| " + " | ".join([*cols, *(p[2] for p in PANELS)]) + " |",
                "|" + "---|" * (len(cols) + len(PANELS))]
    for _, r in points.iterrows():
        cells = [*(str(r[k]) for k in (*facets, series)), f"{r[x]:g}"]
        if repeated:
            cells += [str(r["n"]), *(_num(r[c]) for p in PANELS for c in (p[2], f"{p[2]} ci_low", f"{p[2]} ci_high"))]
        else:
            cells += [_num(r[p[2]]) for p in PANELS]
        rows.append("| " + " | ".join(cells) + " |")
    if repeated:
        values = ", ".join(sorted(map(str, df[repeat].dropna().unique())))
        rows += ["", f"Repeats: jobs that differ only in {repeat} ({values}); mean over n of them, [ci_low, ci_high] "
                     "the 95% interval of the mean (Student t, n - 1 degrees of freedom; n/a with n = 1)."]
    if incomplete:
        note = f"Left out, did not finish: job {', '.join(incomplete)}."
        rows += ["", note]
        log.warning(note)
    (root / "sweep_report.md").write_text("\n".join(rows) + "\n")
    return root / "sweep_report.png"


def _span(n: pd.Series) -> str:
    return str(n.min()) if n.min() == n.max() else f"{n.min()}-{n.max()}"


def _num(v: float) -> str:
    return "n/a" if pd.isna(v) else f"{v:.4g}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("multirun_dir")
    p.add_argument("--x", default="scheduler.max_num_batched_tokens")
    p.add_argument("--series", default="scheduler")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only the jobs with this override value (repeatable)")
    p.add_argument("--repeat", default="seed",
                   help="override key whose values are repeats of one point (mean and 95%% interval)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bad = [w for w in args.where if "=" not in w]
    if bad:
        p.error(f"--where wants KEY=VALUE, got {bad}")
    where = dict(w.split("=", 1) for w in args.where)
    log.info("wrote %s", report(args.multirun_dir, args.x, args.series, where, args.repeat))


if __name__ == "__main__":
    main()
