"""capacity_under_slo: the highest request rate meeting the SLO for at least ``study.capacity.target`` of requests.

Each variant's capacity comes from ``experiments.studies.capacity.find_capacity`` (bracket by doubling / halving, then
bisection); every probe is a full run in ``<variant>/probe_<k>_rate=<r>/`` offering load for
``study.capacity.duration_s``, and the search trace goes to ``<variant>/capacity.csv`` / ``capacity.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from experiments import plots
from experiments.studies.capacity import CapacityResult, find_capacity, write_trace
from experiments.studies.common import Report, backends, fmt, run_variants, slug

PANELS = [("slo_attainment", "SLO attainment", 1.0), ("goodput_rps", "goodput (req/s)", 1.0),
          ("ttft_s.p99", "TTFT p99 (s)", 1.0), ("max_stall_s.p99", "p99 max stall (ms)", 1e3)]


def search(cfg: DictConfig, overrides: Sequence[str], out: Path) -> tuple[CapacityResult, dict[float, dict]]:
    """One variant's capacity search; returns the result and {probed rate: metrics}."""
    c = cfg.study.capacity
    probes: dict[float, dict] = {}

    def measure(rate: float) -> dict:
        label = f"probe_{len(probes):02d}_rate={rate:.4g}"
        window = [f"workload.duration_s={float(c.duration_s)!r}", "workload.num_requests=null"]
        probes[rate] = run_variants(cfg, {label: [*overrides, f"{c.rate_key}={rate!r}", *window]}, out)[label]
        return probes[rate]

    result = find_capacity(measure, float(c.target), c.low, c.high, int(c.max_expansions), int(c.iterations),
                           c.rel_tol)
    write_trace(result, out)
    return result, probes


def shown(r: CapacityResult) -> str:
    """The capacity as a table cell: a bound where the search did not bracket it."""
    if r.capacity_rps is None:
        return f"< {fmt(min(p.rate for p in r.probes))} (no probe met the target)"
    return fmt(r.capacity_rps) + ("" if r.bracketed else " (lower bound: never missed)")


def capacity_report(rep: Report, cfg: DictConfig, out: Path, what: str, title: str = "Capacity",
                    bars: dict | None = None) -> dict:
    """Searches every variant (``study.variants``) on every backend, one table per backend (capacity also as a ratio
    to the first variant that has one); returns {variant: {probed rate: metrics}} for the figure, and fills ``bars``
    with {backend: {variant: {"capacity_rps": ...}}} for the capacity bar chart (``capacity_bars``)."""
    curves = {}
    for backend, c in backends(cfg).items():
        results = {}
        for name, overrides in c.study.variants.items():
            results[name], curves[name if backend == "sim" else f"{name} ({backend})"] = search(
                c, list(overrides), out / slug(backend) / slug(name))
        if bars is not None:
            bars[backend] = {k: {"capacity_rps": r.capacity_rps} for k, r in results.items()}
        found = {k: r for k, r in results.items() if r.capacity_rps is not None}
        if found:
            best = max(found, key=lambda k: found[k].capacity_rps)
            src = f"{slug(backend)}/{slug(best)}/capacity.json:capacity_rps"
            value = rep.number(f"{backend}.{best}.capacity_rps", found[best].capacity_rps, src)
            rep.text(f"## {title} ({backend})", f"**Highest capacity: {best}, {value} req/s** at "
                                                f"{c.study.capacity.target:.0%} SLO attainment.")
        else:
            rep.text(f"## {title} ({backend})", "No variant met the target at any probed rate.")
        first = next(iter(found or results))  # the ratio's reference: the first variant with a capacity
        ref = results[first].capacity_rps
        rep.table([what, "capacity (req/s)", f"vs {first}", "bracketed", "probes", "attainment at capacity"],
                  [[k, shown(r), fmt(r.capacity_rps / ref) + "x" if ref and r.capacity_rps else "n/a", r.bracketed,
                    len(r.probes),
                    fmt(next((p.attainment for p in r.probes if p.rate == r.capacity_rps), None))]
                   for k, r in results.items()])
    return curves


def attainment_target(cfg: DictConfig) -> dict[str, tuple[float, str]]:
    """The attainment line of the probe figures: the target the capacity must keep."""
    t = float(cfg.study.capacity.target)
    return {"slo_attainment": (t, f"attainment target {t:g}")}


def capacity_bars(rep: Report, bars: dict, path: Path, what: str) -> None:
    """The capacities side by side: one bar per variant, one group per backend (n/a where no probe met the
    target)."""
    fig = plots.grouped_bars(bars, [("capacity_rps", "capacity under the SLO (req/s)", 1.0)], path)
    rep.figure(fig, f"Capacity per {what}: the highest probed rate meeting the attainment target (n/a: none did)")


def describe_search(cfg: DictConfig) -> str:
    c = cfg.study.capacity
    return (f"SLO: TTFT <= {cfg.slo.ttft_s} s and max stall <= {cfg.slo.max_stall_s} s; capacity = highest probed "
            f"rate ({c.rate_key}) with attainment >= {c.target} (rejected and timed-out requests count as misses), "
            f"searched by experiments.capacity from [{c.low}, {c.high}] req/s to a relative tolerance of {c.rel_tol}; "
            f"each probe offers load for {c.duration_s} s.")


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Capacity under SLO per scheduler")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}. " + describe_search(cfg))
    bars: dict = {}
    curves = capacity_report(rep, cfg, out, "scheduler", bars=bars)
    capacity_bars(rep, bars, out / "capacity.png", "scheduler")
    fig = plots.metric_curves(curves, PANELS, out / "capacity_under_slo.png", "request rate (req/s)",
                              targets=attainment_target(cfg))
    rep.figure(fig, f"Every probe of the searches: SLO attainment (capacity where it crosses "
                    f"{cfg.study.capacity.target}), goodput and tail latency against the request rate")
    return rep
