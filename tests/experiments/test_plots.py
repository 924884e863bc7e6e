"""Figure behaviours checked on the data and Axes the plotting helpers build (issue 14, figures)."""

import matplotlib.pyplot as plt
import numpy as np

from experiments import plots
from experiments.runs import run
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
