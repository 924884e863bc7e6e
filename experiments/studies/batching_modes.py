"""batching_modes: static vs Orca-style vs chunked continuous batching; throughput against latency at rising load."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from experiments import plots
from experiments.studies.common import Report, backends, ci_text, fmt, fmt_ci, run_variants, slug

PANELS = [("throughput_tok_s", "output throughput (tok/s)", 1.0), ("goodput_rps", "goodput (req/s)", 1.0),
          ("ttft_s.p50", "TTFT p50 (s)", 1.0), ("ttft_s.p99", "TTFT p99 (s)", 1.0),
          ("tpot_s.p50", "TPOT p50 (ms)", 1e3), ("e2e_s.p50", "E2E p50 (s)", 1.0)]
TRADEOFF = [("e2e_s.p50", "E2E p50 (s)", 1.0), ("ttft_s.p99", "TTFT p99 (s)", 1.0),
            ("tpot_s.p50", "TPOT p50 (ms)", 1e3)]


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Batching modes: static vs iteration-level vs chunked continuous batching")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}; Poisson arrivals for {cfg.workload.duration_s} s per "
             f"rate; requests time out {cfg.request_timeout_s} s after arrival (counted, kept in every denominator); "
             f"SLO TTFT <= {cfg.slo.ttft_s} s, max stall <= {cfg.slo.max_stall_s} s.")
    curves = {}
    for backend, c in backends(cfg).items():
        rates = [float(r) for r in c.study.rates]
        rows = {}
        for name, overrides in c.study.schedulers.items():
            runs = run_variants(c, {f"{name} rate={r:g}": [*overrides, f"workload.arrival.rate_rps={r}"]
                                    for r in rates}, out / slug(backend) / name)
            label = name if backend == "sim" else f"{name} ({backend})"
            curves[label] = {r: runs[f"{name} rate={r:g}"] for r in rates}
            best = max(rates, key=lambda r: curves[label][r]["goodput_rps"] or 0.0)
            src = f"{slug(backend)}/{name}/{slug(f'{name} rate={best:g}')}/metrics.json:goodput_rps"
            rows[name] = [name, fmt(best), rep.number(f"{backend}.{name}.peak_goodput_rps",
                                                      curves[label][best]["goodput_rps"], src)
                          + ci_text(curves[label][best], "goodput_rps"),
                          fmt_ci(curves[label][rates[-1]], "throughput_tok_s"),
                          fmt_ci(curves[label][rates[-1]], "num_timed_out")]
        rep.text(f"## {backend}", "**Peak goodput: " + ", ".join(f"{r[0]} {r[2]} req/s" for r in rows.values())
                 + f"**. Per scheduler, with throughput and timeouts at the highest rate ({fmt(rates[-1])} req/s):")
        rep.table(["scheduler", "rate at peak goodput (req/s)", "peak goodput (req/s)",
                   f"throughput at {fmt(rates[-1])} req/s (tok/s)", f"timed out at {fmt(rates[-1])} req/s"],
                  list(rows.values()))
    fig = plots.metric_curves(curves, PANELS, out / "batching_vs_rate.png", "request rate (req/s)")
    rep.figure(fig, "Throughput, goodput and latency against the offered request rate (dashed: the TTFT SLO)")
    fig = plots.metric_curves(curves, TRADEOFF, out / "batching_tradeoff.png", "",
                              x_key=("throughput_tok_s", "output throughput (tok/s)", 1.0))
    rep.figure(fig, "Latency against achieved throughput (one point per rate)")
    return rep
