"""The one plotting module: every figure of every experiment uses these styles and helpers.

Figures read the run directory files (docs/outputs.md), so they work the same on sim and engine runs and
on runs made earlier. Several runs passed together are overlaid (e.g. sim vs engine).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from core.output import has_table, read_metrics, read_requests, read_steps, read_tokens  # noqa: E402

STYLE = {"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False, "legend.frameon": False, "font.size": 9}
COLORS = plt.get_cmap("tab10").colors


# ---- figure conventions (issue 14): legends off the data, thresholds drawn, linear y axes from 0 -----------------
def legend_outside(target, fontsize: float = 7, below: bool = False, **kw):
    """The one legend placement of every figure: outside the plotting area, to its right (``_save`` writes with
    ``bbox_inches="tight"`` so it is kept). ``target``: an Axes (its own entries) or a Figure (one legend for all
    its panels, each label once: for panels that share their series). Threshold lines (``threshold_line``) are
    labelled where they are drawn and left out; the key of the 95% bands (``interval_key``) comes last. ``below``:
    under an Axes instead (side-by-side panels whose long entries differ). None when nothing is labelled."""
    axes = target.axes if isinstance(target, matplotlib.figure.Figure) else [target]
    seen: dict = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if getattr(h, "get_gid", lambda: None)() != "threshold":
                seen.setdefault(lab, h)
    if not seen:
        return None
    seen = dict(sorted(seen.items(), key=lambda kv: getattr(kv[1], "get_gid", lambda: None)() == "interval"))
    if isinstance(target, matplotlib.figure.Figure):
        return target.legend(list(seen.values()), list(seen), loc="upper left", bbox_to_anchor=(1.0, 0.98),
                             fontsize=fontsize, **kw)
    if below:
        return target.legend(list(seen.values()), list(seen), loc="upper center", bbox_to_anchor=(0.5, -0.16),
                             borderaxespad=0.0, fontsize=fontsize, **kw)
    return target.legend(list(seen.values()), list(seen), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                         borderaxespad=0.0, fontsize=fontsize, **kw)


def y_from_zero(ax) -> None:
    """A linear y axis over non-negative data starts at 0: an axis zoomed to its data turns a 1% difference into a
    cliff. Log axes and axes with negative data are left as they are."""
    if ax.get_yscale() == "linear" and np.isfinite(ax.dataLim.y0) and ax.dataLim.y0 >= 0:
        ax.set_ylim(bottom=0)


def threshold_line(ax, value: float, label: str, axis: str = "y"):
    """A dashed reference line at a threshold that matters (an SLO target, a required attainment), its label
    written beside it (above the right end of a horizontal line, left of the top of a vertical one: inside the
    axes, clear of a legend outside them) rather than in the legend,
    where several dashed lines would look alike."""
    if axis == "y":
        line = ax.axhline(value, color="0.25", ls="--", lw=0.9, label=label, zorder=1.5)
        ax.text(0.995, value, label, transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=6,
                color="0.25")
    else:
        line = ax.axvline(value, color="0.25", ls="--", lw=0.9, label=label, zorder=1.5)
        ax.text(value, 0.98, label, transform=ax.get_xaxis_transform(), rotation=90, ha="right", va="top",
                fontsize=6, color="0.25")
    line.set_gid("threshold")
    return line


def _unit(label: str) -> str:
    """The unit in an axis label's trailing parentheses (``TTFT p99 (s)`` -> `` s``), else ''."""
    m = re.search(r"\(([^()]*)\)\s*$", label)
    return f" {m.group(1)}" if m and m.group(1) not in ("share",) else ""


def slo_of(key: str, metrics: Sequence[Mapping]) -> list[float]:
    """The distinct SLO targets (seconds, from each metrics.json's ``slo``) of the latency a dotted metrics key
    summarises: ``ttft_s.p99`` and ``groups.prompt_len.x.ttft_s.p50`` -> ``slo.ttft_s``; [] for other keys."""
    parts = key.split(".")
    base = parts[-2] if len(parts) > 1 else parts[0]
    out: list[float] = []
    for m in metrics:
        v = ((m or {}).get("slo") or {}).get(base)
        if v is not None and float(v) not in out:
            out.append(float(v))
    return out


def reference_lines(ax, key: str, label: str, scale: float, metrics: Sequence[Mapping],
                    targets: Mapping[str, tuple[float, str]] | None = None) -> None:
    """The SLO target lines of a latency panel (``slo_of``, in the panel's ``scale``) and the ``targets`` line of
    ``key`` (metrics key -> (value as drawn, label)), e.g. the attainment a capacity must keep."""
    for v in slo_of(key, metrics):
        threshold_line(ax, v * scale, f"SLO {v * scale:g}{_unit(label)}")
    if targets and key in targets:
        threshold_line(ax, *targets[key])


def interval_key(ax) -> None:
    """The legend entry of the shaded 95% intervals: one neutral patch, whatever the series' colours."""
    ax.fill_between([], [], color="0.5", alpha=0.3, lw=0, label="95% interval over seeds").set_gid("interval")


def metric_ci(metrics: Mapping, key: str, scale: float = 1.0) -> tuple[float, float] | None:
    """The 95% interval of a dotted metrics key over repeated seeds (``repeats.ci95``, written by
    experiments.studies.common.aggregate), times ``scale``; None without repeats."""
    ci = ((metrics or {}).get("repeats") or {}).get("ci95", {}).get(key)
    if not ci or ci[0] is None:
        return None
    return float(ci[0]) * scale, float(ci[1]) * scale


def drawn_ci(value: float, ci: tuple[float, float] | None) -> tuple[float, float] | None:
    """An interval as drawn: cut at 0 where the value is not negative (a latency, a count, a share cannot go
    below 0; the t interval of a few widely spread repeats can). Tables print the interval uncut."""
    if ci is None:
        return None
    return (max(ci[0], 0.0), ci[1]) if np.isfinite(value) and value >= 0 else ci


@dataclass
class RunData:
    requests: dict[str, np.ndarray]
    tokens: dict[str, np.ndarray]
    steps: dict[str, np.ndarray]
    metrics: dict

    def _measured(self) -> np.ndarray:
        r = self.requests
        return (r["status"] == "FINISHED") & ~r.get("warmup", np.zeros(len(r["status"]), bool))

    def completed(self, column: str) -> np.ndarray:
        """A latency column over finished, non-warmup requests, NaNs dropped."""
        v = self.requests[column][self._measured()].astype(float)
        return v[~np.isnan(v)]

    def itl(self) -> np.ndarray:
        """Inter-token latencies of finished, non-warmup requests, by core.metrics' definition."""
        t = self.tokens
        if not len(t.get("request_id", [])):  # no tokens file (output.tokens=none): metrics.json has the ITL stats
            return np.empty(0)
        rid, order = t["request_id"], _event_order(t["request_id"], t["index"])
        rid, time, k = rid[order], t["time_s"][order].astype(float), t["num_tokens"][order]
        later = (rid[1:] == rid[:-1]) & np.isin(rid[1:], self.requests["id"][self._measured()])
        k = k[1:][later]  # each later event: its gap to the previous event / its k tokens, k times
        return np.repeat((time[1:] - time[:-1])[later] / k, k)


def _event_order(rid: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The rows of a tokens table sorted by (request id, event index), without a per-token Python loop. A file
    as written (each request's events together, in index order) only has its request blocks sorted."""
    n = len(rid)
    if n < 2:
        return np.arange(n)
    start = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    blocks = rid[start]
    inside = np.ones(max(n - 1, 0), dtype=bool)
    inside[start[1:] - 1] = False  # row pairs within one block
    if np.all(np.diff(index)[inside] > 0) and len(np.unique(blocks)) == len(blocks):
        ends = np.r_[start[1:], n]
        return np.concatenate([np.arange(start[j], ends[j]) for j in np.argsort(blocks, kind="stable")])
    return np.lexsort((index, rid))


def load_run(run_dir: str | Path) -> RunData:
    """A run directory's files; a black-box measurement (loadgen, vLLM) has no steps.csv: its steps are empty."""
    d = Path(run_dir)  # CSV or Parquet (core.output.read_table); no tokens file with output.tokens=none
    steps = read_steps(d) if has_table(d, "steps") else {}
    return RunData(read_requests(d), read_tokens(d) if has_table(d, "tokens") else {}, steps,
                   read_metrics(d / "metrics.json"))


MAX_POINTS = 2000  # a CDF line drawn through at most this many of its points (quantiles): cheap for any run size


def thin(n: int, limit: int) -> np.ndarray:
    """Indices of at most ``limit`` evenly spread points of ``n`` (first and last kept): all when n <= limit."""
    return np.arange(n) if n <= limit else np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))


def cdf(ax, values: np.ndarray, label: str, color=None, linestyle="-") -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if len(v):
        keep = thin(len(v), MAX_POINTS)
        ax.step(v[keep], (keep + 1) / len(v), where="post", label=f"{label} (n={len(v)})", color=color,
                linestyle=linestyle)


LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl", "ITL"), ("e2e_s", "E2E latency"),
             ("max_stall_s", "max stall per request"), ("queue_s", "queue delay"))


def plain_log_ticks(axis) -> None:
    """Plain numbers at 1-2-5 steps on a log axis, not 10^k labels."""
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


# Latencies drawn on a log x axis (values > 0 only): they span orders of magnitude, with a long tail
LOG_LATENCIES = {"ttft_s", "itl", "e2e_s", "max_stall_s"}


def _latency_values(run: RunData, col: str) -> np.ndarray:
    if col == "itl":
        return run.itl()
    if col == "queue_s":
        return run.completed("first_scheduled_s") - run.completed("arrival_s")
    return run.completed(col)


def slo_targets(runs: Mapping[str, RunData]) -> dict[str, float]:
    """The SLO targets set in the runs' metrics.json (``slo``: metric -> seconds or null); the first run's value
    of a metric wins."""
    out: dict[str, float] = {}
    for run in runs.values():
        for key, target in ((run.metrics or {}).get("slo") or {}).items():
            if target is not None and key not in out:
                out[key] = float(target)
    return out


def draw_latency_cdfs(runs: Mapping[str, RunData]):
    """The figure of ``latency_cdfs``, not saved: (fig, axes) so its scales and lines can be checked."""
    slo = slo_targets(runs)
    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    for ax, (col, name) in zip(axes.flat, LATENCIES, strict=True):
        for i, (label, run) in enumerate(runs.items()):
            values = _latency_values(run, col)
            if col in LOG_LATENCIES:
                values = values[values > 0]
            cdf(ax, values, label, COLORS[i % 10], "-" if i == 0 else "--")
        if col in slo:
            threshold_line(ax, slo[col], f"SLO {slo[col]:g} s", axis="x")
        if col in LOG_LATENCIES:
            ax.set_xscale("log")
            plain_log_ticks(ax.xaxis)
        ax.set_xlabel(f"{name} (s{', log scale' if col in LOG_LATENCIES else ''})")
        ax.set_ylabel("fraction of requests" if col != "itl" else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        legend_outside(ax)
    return fig, axes


def latency_cdfs(runs: Mapping[str, RunData], path: str | Path, title: str = "") -> Path:
    """CDFs of TTFT, TPOT, ITL, E2E, max stall and queue delay, one line per run; TTFT, ITL, E2E and max stall
    on log x axes, dashed vertical lines at the runs' SLO targets (metrics.json ``slo``)."""
    with plt.rc_context(STYLE):
        fig, _ = draw_latency_cdfs(runs)
        return _save(fig, path, title)


def kv_timeline(steps: Mapping[str, np.ndarray], gap_factor: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """(time, KV blocks used) of the steps given, with a NaN point inserted in each idle gap (the next step
    starts more than ``gap_factor`` median step durations after a step ends), so a line breaks there instead
    of drawing a ramp across time when nothing ran."""
    t = np.asarray(steps["start_s"], float)
    d = np.asarray(steps["duration_s"], float)
    kv = np.asarray(steps["kv_blocks_used"], float)
    order = np.argsort(t, kind="stable")
    t, d, kv = t[order], d[order], kv[order]
    if len(t) < 2:
        return t, kv
    med = float(np.median(d[d > 0])) if np.any(d > 0) else 0.0
    gaps = np.flatnonzero(t[1:] - (t[:-1] + d[:-1]) > gap_factor * med) + 1
    if not len(gaps):
        return t, kv
    return np.insert(t, gaps, t[gaps - 1] + d[gaps - 1]), np.insert(kv, gaps, np.nan)


MAX_STEP_POINTS = 20000  # step_timeline draws at most about this many steps per run (every k-th of a long run)


def step_timeline(runs: Mapping[str, RunData], path: str | Path) -> Path:
    """Per-step duration, batch composition and KV use over time (first replica of each run); the KV line
    breaks across idle gaps (``kv_timeline``)."""
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
        for i, (label, run) in enumerate(runs.items()):
            s = run.steps
            if not len(s.get("start_s", [])):
                continue
            first = s["replica"] == s["replica"].min()
            kt, kv = kv_timeline({k: s[k][first] for k in ("start_s", "duration_s", "kv_blocks_used")})
            first = np.flatnonzero(first)
            first = first[np.arange(0, len(first), max(1, len(first) // MAX_STEP_POINTS))]  # long runs: thinned
            t = s["start_s"][first]
            c = COLORS[i % 10]
            axes[0].plot(t, s["duration_s"][first] * 1e3, ".", ms=2, color=c, label=label)
            axes[1].plot(t, s["num_prefill_tokens"][first], ".", ms=2, color=c, label=f"{label} prefill tokens")
            axes[1].plot(t, s["num_decode_seqs"][first], "x", ms=2, color=c, alpha=0.5,
                         label=f"{label} decode seqs")
            if len(kt) > MAX_STEP_POINTS:  # every idle-gap break (NaN) and its neighbours kept
                gap = np.flatnonzero(np.isnan(kv))
                keep = np.union1d(np.arange(0, len(kt), len(kt) // MAX_STEP_POINTS),
                                  np.concatenate([gap - 1, gap, gap + 1, [len(kt) - 1]]).clip(0, len(kt) - 1))
                kt, kv = kt[keep], kv[keep]
            axes[2].plot(kt, kv, "-", lw=0.8, color=c, label=label)
        axes[0].set_ylabel("step time (ms)")
        axes[1].set_ylabel("tokens or sequences per step")
        axes[2].set_ylabel("KV blocks used (blocks)")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            legend_outside(ax)
        return _save(fig, path)


# Axis labels with units for the config keys that sweeps and studies put on an axis; any other key is shown as is.
AXIS_LABELS = {
    "scheduler.max_num_batched_tokens": "token budget per step (tokens)",
    "scheduler.max_num_seqs": "max sequences per step",
    "workload.arrival.rate_rps": "offered load (req/s)",
    "workload.num_requests": "requests",
    "workload.num_clients": "closed-loop clients",
    "workload.think_time_s": "think time (s)",
    "replicas": "replicas",
    "kv.num_blocks": "KV blocks",
    "kv.block_size": "KV block size (tokens)",
    "kv.memory_bytes": "KV memory (bytes)",
}


# Unit suffixes of config keys, for keys not in AXIS_LABELS
_KEY_UNITS = (("_rps", "req/s"), ("_ms", "ms"), ("_s", "s"), ("_bytes", "bytes"), ("_tokens", "tokens"))


def axis_label(key: str) -> str:
    """An axis label with its unit for a config key (``AXIS_LABELS``); any other key by its last part with the
    unit its suffix names (``workload.think_time_s`` -> ``think time (s)``), else that last part as is."""
    if key in AXIS_LABELS:
        return AXIS_LABELS[key]
    name = key.rsplit(".", 1)[-1]
    for suffix, unit in _KEY_UNITS:
        if name.endswith(suffix) and len(name) > len(suffix):
            return f"{name[:-len(suffix)].replace('_', ' ')} ({unit})"
    return name.replace("_", " ")


def lines(ax, x: Sequence[float], ys: Mapping[str, Sequence[float]], xlabel: str, ylabel: str,
          markers: bool = True, bands: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
          legend: bool = True) -> None:
    """Curves sharing an x axis (e.g. latency vs request rate), one per label, with consistent colours; ``bands``
    (label -> (low, high) per x, NaN where unknown) shades an interval around a curve (a 95% interval over
    repeats). ``legend=False`` leaves the legend to the caller (one per figure: ``legend_outside(fig)``)."""
    first_band = True
    for i, (label, y) in enumerate(ys.items()):
        ax.plot(x, y, "-o" if markers else "-", ms=3, color=COLORS[i % 10], label=label)
        if bands and label in bands:
            lo, hi = (np.asarray(v, float) for v in bands[label])
            ax.fill_between(x, lo, hi, color=COLORS[i % 10], alpha=0.2, lw=0, label="_band")
            if first_band:
                interval_key(ax)
            first_band = False
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend:
        legend_outside(ax)


def figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] | None = None):
    """A figure in the house style (use as ``with figure(...) as (fig, axes):``)."""
    return _Figure(nrows, ncols, size or (4.2 * ncols, 3.2 * nrows))


class _Figure:
    def __init__(self, nrows, ncols, size):
        self.args = (nrows, ncols, size)

    def __enter__(self):
        self._ctx = plt.rc_context(STYLE)
        self._ctx.__enter__()
        nrows, ncols, size = self.args
        self.fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False)
        return self.fig, axes

    def __exit__(self, *exc):
        plt.close(self.fig)
        self._ctx.__exit__(*exc)


def _save(fig, path: str | Path, title: str = "") -> Path:
    """Title, tight layout, write the PNG, close the figure."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")  # keeps the legends placed outside the axes
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path) -> list[Path]:
    """The standard figures of one run, written next to its files."""
    d = Path(run_dir)
    run = {d.name: load_run(d)}
    return [latency_cdfs(run, d / "latency_cdfs.png"), step_timeline(run, d / "step_timeline.png")]


def fit_stats(measured: np.ndarray, predicted: np.ndarray) -> tuple[float, float]:
    """(R\u00b2 of predicted against measured, median |predicted - measured| / measured) of one group; R\u00b2 is
    NaN with fewer than 2 points or no spread in measured, the error NaN with no measured value > 0."""
    m, p = np.asarray(measured, float), np.asarray(predicted, float)
    ss_tot = float(np.sum((m - m.mean()) ** 2)) if len(m) else 0.0
    r2 = 1.0 - float(np.sum((m - p) ** 2)) / ss_tot if len(m) >= 2 and ss_tot > 0 else np.nan
    pos = m > 0
    rel = float(np.median(np.abs(p[pos] - m[pos]) / m[pos])) if np.any(pos) else np.nan
    return r2, rel


def _fmt(v: float, spec: str) -> str:
    return "n/a" if not np.isfinite(v) else format(v, spec)


def predicted_vs_measured(panels: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]], path: str | Path,
                          title: str = "") -> Path:
    """Step time predicted by a cost model against measured, one panel per model, one colour per group
    (e.g. prefill / decode / mixed) with its own R\u00b2 and median relative error in the legend (one R\u00b2 over all
    steps is dominated by the few long prefill steps); log axes with the y = x line."""
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
        for ax, (name, groups) in zip(axes.flat, panels.items(), strict=True):
            lo, hi = np.inf, 0.0
            for i, (group, (measured, predicted)) in enumerate(groups.items()):
                m, p = np.asarray(measured, float) * 1e3, np.asarray(predicted, float) * 1e3
                if not len(m):
                    continue
                r2, rel = fit_stats(m, p)
                label = f"{group} (n={len(m)}, R\u00b2={_fmt(r2, '.3f')}, median |err| {_fmt(rel * 100, '.1f')}%)"
                ax.plot(m, p, "o", ms=3, alpha=0.6, color=COLORS[i % 10], label=label)
                lo, hi = min(lo, m.min(), p.min()), max(hi, m.max(), p.max())
            if hi > 0:
                ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
                ax.set_xscale("log")
                ax.set_yscale("log")
                for axis in (ax.xaxis, ax.yaxis):
                    plain_log_ticks(axis)
            ax.set_xlabel("measured step time (ms)")
            ax.set_ylabel("predicted step time (ms)")
            ax.set_title(name)
            legend_outside(ax, below=True)
        return _save(fig, path, title)


def rate_curves(curves: Mapping[str, Mapping[float, Mapping]], path: str | Path,
                panels: Sequence[tuple[str, str | None, str]] = (
                    ("ttft_s", "p50", "TTFT p50 (s)"), ("ttft_s", "p90", "TTFT p90 (s)"),
                    ("tpot_s", "p50", "TPOT p50 (s)"), ("tpot_s", "p90", "TPOT p90 (s)"),
                    ("goodput_rps", None, "goodput (req/s)"), ("throughput_tok_s", None, "throughput (tok/s)")),
                xlabel: str = "request rate (req/s)") -> Path:
    """Metrics against offered load, one line per run family (e.g. sim vs engine). ``curves`` maps a label to
    {rate: metrics.json dict}; a panel is (metric key, percentile key or None for a scalar, axis label). Latency
    panels get the runs' SLO target as a dashed line; linear y axes start at 0; one legend, outside the panels."""
    ncols = 3 if len(panels) > 4 else len(panels)
    nrows = -(-len(panels) // ncols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.0 * ncols, 3.1 * nrows), squeeze=False)
        for ax, (key, pct, label) in zip(axes.flat, panels, strict=False):
            for i, (name, by_rate) in enumerate(curves.items()):
                rates = sorted(by_rate)
                ys = [by_rate[r].get(key) for r in rates]
                ys = [(y or {}).get(pct) if pct else y for y in ys]
                ys = [np.nan if y is None else y for y in ys]
                ax.plot(rates, ys, "-o" if i == 0 else "--s", ms=3, color=COLORS[i % 10], label=name)
            reference_lines(ax, f"{key}.{pct}" if pct else key, label, 1.0,
                            [m for by_rate in curves.values() for m in by_rate.values()])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            y_from_zero(ax)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        legend_outside(fig)
        return _save(fig, path)


# ---- study figures (experiments/studies): metrics of many runs side by side ---------------------------------
# A panel: (dotted metrics key, axis label with unit, scale), e.g. ("itl_s.p99", "p99 ITL (ms)", 1e3)
Panel = tuple[str, str, float]


def metric_value(metrics: Mapping, key: str, scale: float = 1.0) -> float:
    """A dotted key of a metrics.json dict (``ttft_s.p99``), times ``scale``; NaN when absent or null."""
    v = metrics
    for part in key.split("."):
        v = v.get(part) if isinstance(v, Mapping) else None
    return np.nan if v is None else float(v) * scale


def _line_style(label: str, i: int) -> dict:
    """Same colour per series index across a study's panels; engine runs dashed with square markers."""
    engine = "engine" in label
    return dict(color=COLORS[i % 10], linestyle="--" if engine else "-", marker="s" if engine else "o", ms=3)


def _grid(n: int, ncols: int = 3, size: tuple[float, float] = (4.0, 3.1)):
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)[:n]


def draw_metric_curves(curves: Mapping[str, Mapping[float, Mapping]], panels: Sequence[Panel], xlabel: str,
                       x_key: Panel | None = None, logx: bool = False,
                       targets: Mapping[str, tuple[float, str]] | None = None):
    """The figure of ``metric_curves``, not saved: (fig, axes)."""
    fig, axes = _grid(len(panels))
    runs_all = [m for runs in curves.values() for m in runs.values()]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        first_band = True
        for i, (name, runs) in enumerate(curves.items()):
            xs = sorted(runs)
            x = np.array([metric_value(runs[v], x_key[0], x_key[2]) for v in xs] if x_key else xs, float)
            style = _line_style(name, i)
            ax.plot(x, [metric_value(runs[v], key, scale) for v in xs], label=name, **style)
            cis = [drawn_ci(metric_value(runs[v], key, scale), metric_ci(runs[v], key, scale)) for v in xs]
            if any(c is not None for c in cis):
                order = np.argsort(x, kind="stable")
                lo = np.array([c[0] if c else np.nan for c in cis])[order]
                hi = np.array([c[1] if c else np.nan for c in cis])[order]
                ax.fill_between(x[order], lo, hi, color=style["color"], alpha=0.2, lw=0, label="_band")
                if first_band:
                    interval_key(ax)
                first_band = False
        reference_lines(ax, key, label, scale, runs_all, targets)
        if logx:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(x_key[1] if x_key else xlabel)
        ax.set_ylabel(label)
        y_from_zero(ax)
    legend_outside(fig)
    return fig, axes


def metric_curves(curves: Mapping[str, Mapping[float, Mapping]], panels: Sequence[Panel], path: str | Path,
                  xlabel: str, x_key: Panel | None = None, logx: bool = False, title: str = "",
                  targets: Mapping[str, tuple[float, str]] | None = None) -> Path:
    """One panel per metric, one line per series over a numeric x; ``curves`` maps a series label to
    {x: metrics.json dict}. With ``x_key`` the x coordinate is that metric of each run instead (e.g. throughput for
    latency-vs-throughput curves), and ``xlabel`` is ignored. Repeated seeds (``repeats.ci95`` in the metrics) shade
    a 95% band around each line; a latency panel gets its SLO target as a dashed line (the runs' ``slo``), a key in
    ``targets`` (key -> (value as drawn, label)) its target; linear y axes start at 0; one legend, outside."""
    with plt.rc_context(STYLE):
        fig, _ = draw_metric_curves(curves, panels, xlabel, x_key, logx, targets)
        return _save(fig, path, title)


def draw_grouped_bars(groups: Mapping[str, Mapping[str, Mapping]], panels: Sequence[Panel], log: bool = False,
                      targets: Mapping[str, tuple[float, str]] | None = None):
    """The figure of ``grouped_bars``, not saved: (fig, axes)."""
    variants = list(dict.fromkeys(v for g in groups.values() for v in g))
    n, width = len(variants), 0.8 / max(1, len(variants))
    single = list(groups) == [""]  # one unnamed group: the bars are named on the x axis, no legend
    fig, axes = _grid(len(panels), size=(max(3.4, 0.5 * n * len(groups) + 1.6), 3.1))
    runs_all = [m for g in groups.values() for m in g.values()]
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        for j, v in enumerate(variants):
            names = [g for g in groups if v in groups[g]]
            xs = [list(groups).index(g) + (j - (n - 1) / 2) * width for g in names]
            vals = np.array([metric_value(groups[g][v], key, scale) for g in names])
            cis = [drawn_ci(y, metric_ci(groups[g][v], key, scale)) for y, g in zip(vals, names, strict=True)]
            yerr = None
            if any(c is not None for c in cis):
                yerr = np.array([[y - c[0], c[1] - y] if c else [0.0, 0.0] for y, c in zip(vals, cis, strict=True)]).T
            bars = ax.bar(xs, vals, width * 0.92, yerr=yerr, capsize=2, color=COLORS[j % 10], label=v,
                          error_kw={"lw": 0.8})
            ax.bar_label(bars, labels=[f"{y:.3g}" if np.isfinite(y) else "n/a" for y in vals], fontsize=6,
                         padding=1)
        if single:
            ax.set_xticks([(j - (n - 1) / 2) * width for j in range(n)], variants, rotation=30, ha="right",
                          fontsize=7)
        else:
            ax.set_xticks(range(len(groups)), list(groups), fontsize=7)
        ax.grid(False, axis="x")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        reference_lines(ax, key, label, scale, runs_all, targets)
        y_from_zero(ax)
    if single:  # only the reference lines need a legend
        for ax in axes:
            for c in ax.containers:
                c.set_label("_bars")
    legend_outside(fig)
    return fig, axes


def grouped_bars(groups: Mapping[str, Mapping[str, Mapping]], panels: Sequence[Panel], path: str | Path,
                 title: str = "", log: bool = False, targets: Mapping[str, tuple[float, str]] | None = None) -> Path:
    """Categorical comparisons: one panel per metric, one cluster per group (a workload, a replica count, a
    backend), one bar per variant in it (same colour per variant everywhere), its value printed on it; 95% error
    bars where the metrics carry repeats (``repeats.ci95``); SLO / target lines as in ``metric_curves``; linear y
    axes from 0; one legend (the variants), outside the panels. ``groups``: {group: {variant: metrics.json dict}}."""
    with plt.rc_context(STYLE):
        fig, _ = draw_grouped_bars(groups, panels, log, targets)
        return _save(fig, path, title)


def metric_bars(runs: Mapping[str, Mapping], panels: Sequence[Panel], path: str | Path, title: str = "",
                log: bool = False) -> Path:
    """One panel per metric, one bar per run named on the x axis: ``grouped_bars`` with a single group."""
    return grouped_bars({"": runs}, panels, path, title, log)


def token_gaps(runs: Mapping[str, RunData], request_ids: Sequence[str], path: str | Path,
               threshold_s: float | None = None) -> Path:
    """The gap before each output event of a few requests (ms, drawn over the interval it spans), one panel per
    run: a single long pause shows as one plateau that a mean or a token percentile averages away."""
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(runs), ncols=2, size=(5.5, 3.2))
        for ax, (label, run) in zip(axes, runs.items(), strict=True):
            t = run.tokens
            for i, rid in enumerate(request_ids):
                keep = t["request_id"] == rid
                times = np.unique(t["time_s"][keep].astype(float))  # one point per output event
                if len(times) > 1:  # each gap drawn as a level over the interval it spans
                    ax.step(times[1:], np.diff(times) * 1e3, where="pre", lw=0.8, color=COLORS[i % 10], label=rid)
            if threshold_s is not None:
                threshold_line(ax, threshold_s * 1e3, f"stall threshold {threshold_s * 1e3:g} ms")
            ax.set_yscale("log")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("gap before output event (ms)")
            ax.set_title(label)
        legend_outside(fig)
        return _save(fig, path)


KIND_STYLES = {"measured": ("-", "o", "measured"), "predicted_fit": ("--", "", "predicted (fitted)"),
               "predicted_conf": (":", "", "predicted (conf)")}


def measured_and_predicted_curves(panels: Sequence[Mapping], path: str | Path, title: str = "",
                                  hline: float | None = None, ncols: int | None = None) -> Path:
    """Curves over a shared x per panel: one colour per series, one line style per kind (measured solid,
    predictions dashed / dotted). A panel is {"title", "xlabel", "ylabel", "x": [...], "series": {name: {kind: ys}},
    "logx": bool}; ``hline`` draws a reference level (e.g. 1 for speed-ups)."""
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    with figure(nrows, ncols, (4.4 * ncols, 3.4 * nrows)) as (fig, axes):
        for ax, p in zip(axes.flat, panels, strict=False):
            for i, (name, kinds) in enumerate(p["series"].items()):
                for kind, ys in kinds.items():
                    ls, marker, label = KIND_STYLES.get(kind, ("-.", "", kind))
                    ax.plot(p["x"], ys, linestyle=ls, marker=marker or None, ms=3, color=COLORS[i % 10],
                            label=f"{name}, {label}")
            if hline is not None:
                threshold_line(ax, hline, f"{hline:g} (no change)")
            if p.get("logx"):
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_xlabel(p["xlabel"])
            ax.set_ylabel(p["ylabel"])
            ax.set_title(p["title"], fontsize=9)
            y_from_zero(ax)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        legend_outside(fig)
        return _save(fig, path, title)


def decode_roofline(tables: Mapping[str, Mapping[str, np.ndarray]], path: str | Path, title: str = "") -> Path:
    """Decode step time, throughput and the weight-read vs KV-read time split against batch size, one colour per
    context length and one line style per table (e.g. roofline solid, measured dashed). A table holds columns
    ``context``, ``batch``, ``step_s`` and optionally ``weights_s`` and ``kv_s`` (the roofline's op-group times)."""
    styles = ("-", "--", ":", "-.")
    with plt.rc_context(STYLE):
        fig, axes = _grid(3)
        for j, (name, t) in enumerate(tables.items()):
            for i, ctx in enumerate(int(c) for c in np.unique(t["context"])):
                sel = t["context"] == ctx
                b, kw = t["batch"][sel], dict(color=COLORS[i % 10], linestyle=styles[j % 4], marker=".", ms=3)
                axes[0].plot(b, t["step_s"][sel] * 1e3, label=f"{name}, ctx {ctx}", **kw)
                axes[1].plot(b, b / t["step_s"][sel], label=f"{name}, ctx {ctx}", **kw)
                if "kv_s" in t:
                    axes[2].plot(b, t["kv_s"][sel] * 1e3, label=f"{name} KV reads, ctx {ctx}", **kw)
            if "weights_s" in t:  # the same for every context
                first = t["context"] == t["context"][0]
                axes[2].plot(t["batch"][first], t["weights_s"][first] * 1e3, color="k", linestyle=styles[j % 4],
                             label=f"{name} weight reads")
        for ax, ylabel in zip(axes, ("decode step time (ms)", "decode throughput (tok/s)",
                                     "time per step (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_yscale("log")
            plain_log_ticks(ax.yaxis)
            ax.set_xlabel("batch size (sequences)")
            ax.set_ylabel(ylabel)
        legend_outside(fig)
        return _save(fig, path, title)
