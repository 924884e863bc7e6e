"""load_test_modes: closed-loop (N clients) against open-loop (fixed arrival rate) load on the same service.

The open-loop rates are multiples of the highest rate the closed loop completed, so both sweeps cover the same
range. ``offered`` = requests sent / their arrival span (from requests.csv); ``failed`` = (timed out + rejected)
/ requests sent; ``completed`` = finished requests / test duration (first arrival to last terminal event).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from core.output import read_requests_csv
from experiments import plots
from experiments.studies.common import Report, backends, fmt, get, option_name, run_variants, slug

COLUMNS = [("offered_rps", "offered (req/s)", 1.0), ("throughput_rps", "completed (req/s)", 1.0),
           ("failed_share", "timed out + rejected (share)", 1.0), ("ttft_s.p50", "TTFT p50 (s)", 1.0),
           ("ttft_s.p99", "TTFT p99 (s)", 1.0), ("e2e_s.p99", "E2E p99 (s)", 1.0),
           ("slo_attainment", "SLO attainment", 1.0), ("goodput_rps", "goodput (req/s)", 1.0)]


def with_load_fields(m: dict, run_dir: Path) -> dict:
    """Adds ``offered_rps`` and ``failed_share``, from the run's own files (errors stay in the denominator)."""
    r = read_requests_csv(run_dir / "requests.csv")
    arrivals = r["arrival_s"][~r["warmup"].astype(bool)] if "warmup" in r else r["arrival_s"]
    n, span = m["num_requests"], float(arrivals.max() - arrivals.min()) if len(arrivals) else 0.0
    m["offered_rps"] = (n - 1) / span if span > 0 else None
    m["failed_share"] = (m["num_timed_out"] + m["num_rejected"]) / n if n else None
    return m


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Closed-loop vs open-loop load tests")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}, scheduler `{option_name(cfg, 'scheduler')}`;"
             f" requests time out {cfg.request_timeout_s} s after arrival; SLO TTFT <= {cfg.slo.ttft_s} s, max stall"
             f" <= {cfg.slo.max_stall_s} s. Closed loop: N clients with no think time. Open loop: Poisson arrivals at"
             " multiples of the closed loop's highest completed rate. Every rate counts timed-out and rejected "
             "requests in its denominator.")
    curves = {}
    for backend, c in backends(cfg).items():
        d = out / slug(backend)
        load_fields = lambda _label, m, run_dir: with_load_fields(m, run_dir)  # noqa: E731
        closed = run_variants(c, {f"closed N={n}": [f"study.closed.num_clients={n}"] for n in c.study.clients}, d,
                              derive=load_fields)
        peak_label = max(closed, key=lambda k: closed[k]["throughput_rps"] or 0.0)
        peak = closed[peak_label]["throughput_rps"]
        rates = {f"open {f:g}x": round(f * peak, 4) for f in c.study.rate_factors}
        opened = run_variants(c, {k: ["workload=${study.open}", f"study.open.arrival.rate_rps={r}"]
                                  for k, r in rates.items()}, d, derive=load_fields)
        curves[f"closed loop ({backend})"] = {m["offered_rps"]: m for m in closed.values()}
        curves[f"open loop ({backend})"] = {m["offered_rps"]: m for m in opened.values()}
        worst_closed = closed[f"closed N={c.study.clients[-1]}"]
        worst_open = opened[list(rates)[-1]]
        src = f"{slug(backend)}/{slug(list(rates)[-1])}/metrics.json"
        timed_out = rep.number(f"{backend}.open_timed_out", worst_open["num_timed_out"], src + ":num_timed_out")
        attained = rep.number(f"{backend}.open_slo_attainment", worst_open["slo_attainment"], src + ":slo_attainment")
        rep.text(f"## {backend}",
                 f"The closed loop's highest completed rate is {fmt(peak)} req/s ({peak_label}). With "
                 f"{c.study.clients[-1]} clients it still reports {fmt(worst_closed['failed_share'])} failed and TTFT "
                 f"p99 {fmt(get(worst_closed, 'ttft_s.p99'))} s, because it only sends "
                 f"{fmt(worst_closed['offered_rps'])} req/s. **Open loop at {list(rates)[-1].split()[-1]} that rate "
                 f"({fmt(rates[list(rates)[-1]])} req/s): "
                 f"{timed_out} of "
                 f"{worst_open['num_requests']} requests timed out, SLO attainment "
                 f"{attained}"
                 f"**, TTFT p99 {fmt(get(worst_open, 'ttft_s.p99'))} s.")
        rep.metric_table({**closed, **opened}, COLUMNS, first="load")
    fig = plots.metric_curves(curves, COLUMNS[1:], out / "load_test_modes.png", "", x_key=COLUMNS[0])
    rep.figure(fig, "Completed rate, failures, latency and goodput against the offered rate: the closed loop "
                    "never offers more than it completes (dashed: the TTFT SLO)")
    return rep
