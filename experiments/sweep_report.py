"""`python -m experiments.sweep_report MULTIRUN_DIR`: one figure and one table for a Hydra multirun.

Reads every job directory's metrics.json and .hydra/overrides.yaml (job directories are named by job number; jobs
that did not finish are left out and named), then plots TTFT p90, max-stall p99 and
goodput against one swept key (``--x``, default the token budget), one line per value of another (``--series``,
default the scheduler). Writes sweep_report.png and sweep_report.md into the multirun directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from matplotlib.ticker import FuncFormatter

from core.output import read_metrics
from experiments.plots import figure, lines

PANELS = (("ttft_s", "p90", "TTFT p90 (s)"), ("max_stall_s", "p99", "max stall p99 (s)"),
          ("goodput_rps", None, "goodput (req/s)"))


def collect(root: Path, incomplete: list[str] | None = None) -> list[tuple[dict[str, str], dict]]:
    """(overrides, metrics) of every complete job under ``root`` (job directories are named by job number; the
    overrides come from each job's .hydra/overrides.yaml). Jobs that did not finish (no metrics.json beside their
    .hydra/, or a ``run_status`` other than ``complete``) are left out and named in ``incomplete``."""
    jobs, skipped = [], []
    for job in sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)):
        overrides_file = job / ".hydra" / "overrides.yaml"
        metrics_file = job / "metrics.json"
        if not metrics_file.is_file():
            if overrides_file.is_file():
                skipped.append(f"{job.name} (no metrics.json)")
            continue
        metrics = read_metrics(metrics_file)
        status = metrics.get("run_status", "complete")  # run directories written before run_status: complete
        if status != "complete":
            skipped.append(f"{job.name} (run_status {status})")
            continue
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else []
        jobs.append((dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o), metrics))
    if incomplete is not None:
        incomplete.extend(skipped)
    if not jobs:
        raise ValueError(f"{root}: no job directories with a complete metrics.json (is it a multirun directory?)"
                         + (f"; incomplete jobs: {', '.join(skipped)}" if skipped else ""))
    return jobs


def value(metrics: dict, key: str, pct: str | None) -> float:
    v = metrics[key][pct] if pct else metrics[key]
    return float("nan") if v is None else float(v)


def report(root: str | Path, x: str = "scheduler.max_num_batched_tokens", series: str = "scheduler") -> Path:
    root = Path(root)
    incomplete: list[str] = []
    jobs = collect(root, incomplete)
    missing = [k for k in (x, series) if not all(k in o for o, _ in jobs)]
    if missing:
        swept = sorted({k for o, _ in jobs for k in o})
        raise ValueError(f"not swept in every job: {missing}; swept keys: {swept}")
    xs = sorted({float(o[x]) for o, _ in jobs})
    names = sorted({o[series] for o, _ in jobs})
    by = {(o[series], float(o[x])): m for o, m in jobs}
    nan = float("nan")
    with figure(1, len(PANELS)) as (fig, axes):
        for ax, (key, pct, label) in zip(axes[0], PANELS, strict=True):
            ys = {n: [value(by[(n, v)], key, pct) if (n, v) in by else nan for v in xs] for n in names}
            lines(ax, xs, ys, x, label)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        fig.suptitle(f"{root.name}: {series} x {x}")
        fig.tight_layout()
        fig.savefig(root / "sweep_report.png")
    rows = [f"| {series} | {x} | " + " | ".join(p[2] for p in PANELS) + " |", "|---|---|" + "---|" * len(PANELS)]
    for (n, v), m in sorted(by.items()):
        rows.append(f"| {n} | {v:g} | " + " | ".join(f"{value(m, k, p):.4g}" for k, p, _ in PANELS) + " |")
    if incomplete:
        note = f"Left out, did not finish: job {', '.join(incomplete)}."
        rows += ["", note]
        print(note)
    (root / "sweep_report.md").write_text("\n".join(rows) + "\n")
    return root / "sweep_report.png"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("multirun_dir")
    p.add_argument("--x", default="scheduler.max_num_batched_tokens")
    p.add_argument("--series", default="scheduler")
    args = p.parse_args(argv)
    print(f"wrote {report(args.multirun_dir, args.x, args.series)}")


if __name__ == "__main__":
    main()
