"""Figure behaviours checked on the data and Axes the plotting helpers build (issue 14, figures)."""

import matplotlib.collections
import matplotlib.container
import matplotlib.pyplot as plt
import numpy as np

from experiments import plots
from experiments.run import run
from tests.experiments.test_run import cfg_with


def test_kv_timeline_breaks_at_idle_gaps():
    steps = {"start_s": np.array([0.0, 0.01, 0.02, 5.0, 5.01]), "duration_s": np.full(5, 0.01),
             "kv_blocks_used": np.array([1.0, 2.0, 3.0, 4.0, 5.0])}
    t, kv = plots.kv_timeline(steps)
    assert len(t) == 6 and np.isnan(kv[3]) and np.isnan(kv).sum() == 1
    assert t[3] == 0.03 and list(kv[4:]) == [4.0, 5.0]
    busy = {k: v[:3] for k, v in steps.items()}
    assert not np.isnan(plots.kv_timeline(busy)[1]).any()


def test_latency_cdfs_log_axes_and_slo_lines(tmp_path):
    run(cfg_with("workload.num_requests=8", "slo.ttft_s=2.0", "slo.max_stall_s=0.5", "output.plots=false"),
        tmp_path)
    fig, axes = plots.draw_latency_cdfs({"run": plots.load_run(tmp_path)})
    try:
        by_name = {ax.get_xlabel().split(" (")[0]: ax for ax in axes.flat}
        for name in ("TTFT", "ITL", "E2E latency", "max stall per request"):
            assert by_name[name].get_xscale() == "log", name
        assert by_name["queue delay"].get_xscale() == "linear"
        slo = {name: [ln.get_xdata()[0] for ln in by_name[name].get_lines() if ln.get_label().startswith("SLO")]
               for name in ("TTFT", "max stall per request", "TPOT")}
        assert slo == {"TTFT": [2.0], "max stall per request": [0.5], "TPOT": []}
    finally:
        plt.close(fig)


def test_fit_stats_per_group():
    m = np.array([1.0, 2.0, 4.0])
    assert plots.fit_stats(m, m) == (1.0, 0.0)
    r2, rel = plots.fit_stats(m, m * 1.1)
    assert r2 < 1.0 and np.isclose(rel, 0.1)
    assert np.isnan(plots.fit_stats(np.array([1.0]), np.array([1.0]))[0])


def test_axis_label_units_for_unlisted_keys():
    assert plots.axis_label("workload.arrival.rate_rps") == "offered load (req/s)"
    assert plots.axis_label("foo.bar_time_s") == "bar time (s)"
    assert plots.axis_label("foo.num_things") == "num things"


# ---- categorical comparisons, thresholds, y from 0, legends off the data ----------------------------------------
SLO = {"ttft_s": 2.0, "max_stall_s": 0.2, "tpot_s": None, "e2e_s": None}


def fake_metrics(goodput, ttft_p99, attainment=0.95, ci=None):
    m = {"goodput_rps": goodput, "ttft_s": {"p99": ttft_p99}, "slo_attainment": attainment, "slo": SLO}
    if ci:
        m["repeats"] = {"seeds": [0, 1], "n": 2, "ci95": ci}
    return m


PANELS = [("goodput_rps", "goodput (req/s)", 1.0), ("ttft_s.p99", "TTFT p99 (ms)", 1e3),
          ("slo_attainment", "SLO attainment", 1.0)]


def _outside(fig, legend) -> bool:
    """The legend's box lies right of every panel's plotting area (no overlap with the data)."""
    fig.canvas.draw()
    box = legend.get_window_extent()
    return all(box.x0 >= ax.get_window_extent().x1 - 1 for ax in fig.axes if ax.get_visible())


def _thresholds(ax):
    return {ln.get_label(): ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_gid() == "threshold"}


def test_categorical_comparison_is_grouped_bars_with_error_bars_slo_line_and_zero_based_axes():
    groups = {"2 replicas": {"rr": fake_metrics(100.0, 1.5, ci={"goodput_rps": [99.0, 101.0]}),
                             "lo": fake_metrics(101.0, 1.2)},
              "4 replicas": {"rr": fake_metrics(200.0, 1.0), "lo": fake_metrics(202.0, 0.9)}}
    fig, axes = plots.draw_grouped_bars(groups, PANELS, targets={"slo_attainment": (0.9, "target 0.9")})
    try:
        goodput, ttft, attain = axes
        bars = [c for c in goodput.containers if isinstance(c, matplotlib.container.BarContainer)]
        assert [c.get_label() for c in bars] == ["rr", "lo"] and all(len(c) == 2 for c in bars)
        assert [t.get_text() for t in goodput.get_xticklabels()] == ["2 replicas", "4 replicas"]
        errs = [c for c in goodput.containers if isinstance(c, matplotlib.container.ErrorbarContainer)]
        assert len(errs) == 1  # only "rr" has repeats
        assert goodput.get_ylim()[0] == 0 and attain.get_ylim()[0] == 0  # 100 vs 101 is not a cliff
        assert _thresholds(ttft) == {"SLO 2000 ms": 2000.0}  # slo.ttft_s in the panel's unit
        assert _thresholds(attain) == {"target 0.9": 0.9} and _thresholds(goodput) == {}
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == ["rr", "lo"]  # thresholds are labelled in place
        assert _outside(fig, legend)
    finally:
        plt.close(fig)


def test_one_unnamed_group_names_each_bar_and_needs_no_legend():
    fig, axes = plots.draw_grouped_bars({"": {"a": fake_metrics(1.0, 1.0), "b": fake_metrics(2.0, 3.0)}},
                                        PANELS[:1])
    try:
        assert [t.get_text() for t in axes[0].get_xticklabels()] == ["a", "b"] and not fig.legends
    finally:
        plt.close(fig)


def test_metric_curves_band_over_repeats_slo_line_zero_base_and_legend_outside():
    curves = {"sarathi": {1.0: fake_metrics(10.0, 0.5, ci={"goodput_rps": [9.0, 11.0], "ttft_s.p99": [0.4, 0.6]}),
                          2.0: fake_metrics(10.2, 0.7, ci={"goodput_rps": [9.5, 10.9], "ttft_s.p99": [0.5, 0.9]})},
              "orca": {1.0: fake_metrics(10.1, 0.6), 2.0: fake_metrics(10.3, 2.5)}}
    fig, axes = plots.draw_metric_curves(curves, PANELS, "request rate (req/s)")
    try:
        goodput, ttft, _ = axes
        bands = [c for c in goodput.collections if isinstance(c, matplotlib.collections.PolyCollection)
                 and len(c.get_paths()) and c.get_paths()[0].vertices.size]
        assert len(bands) == 1  # sarathi's, orca has no repeats
        ys = bands[0].get_paths()[0].vertices[:, 1]
        assert ys.min() == 9.0 and ys.max() == 11.0
        assert goodput.get_ylim()[0] == 0 and ttft.get_ylim()[0] == 0
        assert _thresholds(ttft) == {"SLO 2000 ms": 2000.0}
        legend = fig.legends[0]
        assert [t.get_text() for t in legend.get_texts()] == ["sarathi", "orca", "95% interval over seeds"]
        assert _outside(fig, legend)
    finally:
        plt.close(fig)


def test_drawn_interval_is_cut_at_zero_for_non_negative_values():
    assert plots.drawn_ci(0.5, (-0.2, 1.2)) == (0.0, 1.2)
    assert plots.drawn_ci(-0.5, (-0.9, 0.1)) == (-0.9, 0.1)
    assert plots.drawn_ci(1.0, None) is None


def test_y_from_zero_leaves_log_and_negative_axes_alone():
    fig, (a, b, c) = plt.subplots(1, 3)
    try:
        a.plot([0, 1], [100.0, 101.0])
        b.plot([0, 1], [100.0, 101.0])
        b.set_yscale("log")
        c.plot([0, 1], [-1.0, 1.0])
        for ax in (a, b, c):
            plots.y_from_zero(ax)
        assert a.get_ylim()[0] == 0 and b.get_ylim()[0] > 0 and c.get_ylim()[0] < -1
    finally:
        plt.close(fig)


def test_axes_legend_is_outside_the_plotting_area(tmp_path):
    run(cfg_with("workload.num_requests=8", "slo.ttft_s=2.0", "output.plots=false"), tmp_path)
    fig, axes = plots.draw_latency_cdfs({"run": plots.load_run(tmp_path)})
    try:
        fig.canvas.draw()
        for ax in axes.flat:
            legend = ax.get_legend()
            assert legend is not None
            assert legend.get_window_extent().x0 >= ax.get_window_extent().x1 - 1
            assert not any(t.get_text().startswith("SLO") for t in legend.get_texts())  # written by the line
    finally:
        plt.close(fig)
