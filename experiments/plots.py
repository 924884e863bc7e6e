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
        for rid, idx, time, k in sorted(zip(t["request_id"].tolist(), t["index"].tolist(), t["time_s"].tolist(),
                                            t["num_tokens"].tolist(), strict=True)):
            if rid in keep:
                events.setdefault(rid, []).append((time, k))
        return np.array([x for ev in events.values() for x in itl_samples(ev)])


def load_run(run_dir: str | Path) -> RunData:
    d = Path(run_dir)
    return RunData(read_requests_csv(d / "requests.csv"), read_tokens_csv(d / "tokens.csv"),
                   read_steps_csv(d / "steps.csv"), read_metrics(d / "metrics.json"))


def cdf(ax, values: np.ndarray, label: str, color=None, linestyle="-") -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if len(v):
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{label} (n={len(v)})", color=color,
                linestyle=linestyle)


LATENCIES = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl", "ITL"), ("e2e_s", "E2E latency"),
             ("max_stall_s", "max stall per request"), ("queue_s", "queue delay"))


def latency_cdfs(runs: Mapping[str, RunData], path: str | Path, title: str = "") -> Path:
    """CDFs of TTFT, TPOT, ITL, E2E, max stall and queue delay, one line per run."""
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(11, 6))
        for ax, (col, name) in zip(axes.flat, LATENCIES, strict=True):
            for i, (label, run) in enumerate(runs.items()):
                if col == "itl":
                    values = run.itl()
                elif col == "queue_s":
                    values = run.completed("first_scheduled_s") - run.completed("arrival_s")
                else:
                    values = run.completed(col)
                cdf(ax, values, label, COLORS[i % 10], "-" if i == 0 else "--")
            ax.set_xlabel(f"{name} (s)")
            ax.set_ylabel("fraction of requests" if col != "itl" else "fraction of tokens")
            ax.legend(fontsize=7)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return _save(fig, path)


def step_timeline(runs: Mapping[str, RunData], path: str | Path) -> Path:
    """Per-step duration, batch composition and KV use over time (first replica of each run)."""
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
            axes[2].plot(t, s["kv_blocks_used"][first], "-", lw=0.8, color=c, label=label)
        axes[0].set_ylabel("step time (ms)")
        axes[1].set_ylabel("per step")
        axes[2].set_ylabel("KV blocks used")
        axes[2].set_xlabel("time (s)")
        for ax in axes:
            ax.legend(fontsize=7)
        fig.tight_layout()
        return _save(fig, path)


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


def _save(fig, path: str | Path) -> Path:
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
