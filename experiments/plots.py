"""The one plotting module: every figure of every experiment uses these styles and helpers.

Figures read the run directory files (DESIGN section 8), so they work the same on sim and engine runs and
on runs made earlier. Several runs passed together are overlaid (e.g. sim vs engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from core.metrics import itl_samples  # noqa: E402
from core.output import read_metrics, read_requests_csv, read_steps_csv, read_tokens_csv  # noqa: E402

STYLE = {"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
         "axes.spines.right": False, "legend.frameon": False, "font.size": 9}
COLORS = plt.get_cmap("tab10").colors


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
        keep = set(self.requests["id"][self._measured()].tolist())
        t = self.tokens
        events: dict[str, list[tuple[float, int]]] = {}
        for rid, _idx, time, k in sorted(zip(t["request_id"].tolist(), t["index"].tolist(), t["time_s"].tolist(),
                                            t["num_tokens"].tolist(), strict=True)):
            if rid in keep:
                events.setdefault(rid, []).append((time, k))
        return np.array([x for ev in events.values() for x in itl_samples(ev)])


def load_run(run_dir: str | Path) -> RunData:
    """A run directory's files; a black-box measurement (loadgen, vLLM) has no steps.csv: its steps are empty."""
    d = Path(run_dir)
    steps = read_steps_csv(d / "steps.csv") if (d / "steps.csv").is_file() else {}
    return RunData(read_requests_csv(d / "requests.csv"), read_tokens_csv(d / "tokens.csv"), steps,
                   read_metrics(d / "metrics.json"))


def cdf(ax, values: np.ndarray, label: str, color=None, linestyle="-") -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if len(v):
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})", color=color,
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
            ax.axvline(slo[col], color="0.3", ls="--", lw=0.9, label=f"SLO {slo[col]:g} s")
        if col in LOG_LATENCIES:
            ax.set_xscale("log")
            plain_log_ticks(ax.xaxis)
        ax.set_xlabel(f"{name} (s{', log scale' if col in LOG_LATENCIES else ''})")
        ax.set_ylabel("fraction of requests" if col != "itl" else "fraction of tokens")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7, loc="best")
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
            t = s["start_s"][first]
            c = COLORS[i % 10]
            axes[0].plot(t, s["duration_s"][first] * 1e3, ".", ms=2, color=c, label=label)
            axes[1].plot(t, s["num_prefill_tokens"][first], ".", ms=2, color=c, label=f"{label} prefill tokens")
            axes[1].plot(t, s["num_decode_seqs"][first], "x", ms=2, color=c, alpha=0.5,
                         label=f"{label} decode seqs")
            kt, kv = kv_timeline({k: s[k][first] for k in ("start_s", "duration_s", "kv_blocks_used")})
            axes[2].plot(kt, kv, "-", lw=0.8, color=c, label=label)
        axes[0].set_ylabel("step time (ms)")
        axes[1].set_ylabel("tokens or sequences per step")
        axes[2].set_ylabel("KV blocks used (blocks)")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            ax.legend(fontsize=7, loc="best")
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
          markers: bool = True) -> None:
    """Curves sharing an x axis (e.g. latency vs request rate), one per label, with consistent colours."""
    for i, (label, y) in enumerate(ys.items()):
        ax.plot(x, y, "-o" if markers else "-", ms=3, color=COLORS[i % 10], label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


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
    fig.savefig(path)
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
            ax.legend(fontsize=7)
        return _save(fig, path, title)


def rate_curves(curves: Mapping[str, Mapping[float, Mapping]], path: str | Path,
                panels: Sequence[tuple[str, str | None, str]] = (
                    ("ttft_s", "p50", "TTFT p50 (s)"), ("ttft_s", "p90", "TTFT p90 (s)"),
                    ("tpot_s", "p50", "TPOT p50 (s)"), ("tpot_s", "p90", "TPOT p90 (s)"),
                    ("goodput_rps", None, "goodput (req/s)"), ("throughput_tok_s", None, "throughput (tok/s)")),
                xlabel: str = "request rate (req/s)") -> Path:
    """Metrics against offered load, one line per run family (e.g. sim vs engine). ``curves`` maps a label to
    {rate: metrics.json dict}; a panel is (metric key, percentile key or None for a scalar, axis label)."""
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
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
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


def metric_curves(curves: Mapping[str, Mapping[float, Mapping]], panels: Sequence[Panel], path: str | Path,
                  xlabel: str, x_key: Panel | None = None, logx: bool = False, title: str = "") -> Path:
    """One panel per metric, one line per series; ``curves`` maps a series label to {x: metrics.json dict}.
    With ``x_key`` the x coordinate is that metric of each run instead (e.g. throughput for latency-vs-throughput
    curves), and ``xlabel`` is ignored."""
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(panels))
        for ax, (key, label, scale) in zip(axes, panels, strict=True):
            for i, (name, runs) in enumerate(curves.items()):
                xs = sorted(runs)
                x = [metric_value(runs[v], x_key[0], x_key[2]) for v in xs] if x_key else xs
                ax.plot(x, [metric_value(runs[v], key, scale) for v in xs], label=name, **_line_style(name, i))
            if logx:
                ax.set_xscale("log", base=2)
            ax.set_xlabel(x_key[1] if x_key else xlabel)
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        return _save(fig, path, title)


def metric_bars(runs: Mapping[str, Mapping], panels: Sequence[Panel], path: str | Path, title: str = "",
                log: bool = False) -> Path:
    """One panel per metric, one bar per run (same colour per run across panels), value printed on each bar."""
    with plt.rc_context(STYLE):
        fig, axes = _grid(len(panels), size=(max(3.2, 0.9 * len(runs) + 1.4), 3.1))
        for ax, (key, label, scale) in zip(axes, panels, strict=True):
            vals = [metric_value(m, key, scale) for m in runs.values()]
            bars = ax.bar(range(len(vals)), vals, color=[COLORS[i % 10] for i in range(len(vals))])
            ax.bar_label(bars, labels=[f"{v:.3g}" for v in vals], fontsize=6)
            ax.set_xticks(range(len(vals)), list(runs), rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
        return _save(fig, path, title)


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
                ax.axhline(threshold_s * 1e3, color="k", ls=":", lw=0.8, label="stall threshold")
            ax.set_yscale("log")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("gap before output event (ms)")
            ax.set_title(label)
            ax.legend(fontsize=6)
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
                ax.axhline(hline, color="k", lw=0.7)
            if p.get("logx"):
                ax.set_xscale("log", base=2)
            ax.set_xlabel(p["xlabel"])
            ax.set_ylabel(p["ylabel"])
            ax.set_title(p["title"], fontsize=9)
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
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
            ax.set_yscale("log")
            ax.set_xlabel("batch size (sequences)")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=6)
        return _save(fig, path, title)
