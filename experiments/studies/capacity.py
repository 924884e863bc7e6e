"""`python -m experiments.capacity`: the highest request rate whose SLO attainment stays >= a target.

Attainment is assumed to fall as the rate rises. The search brackets the capacity by doubling (or halving) the
rate from ``capacity.low`` / ``capacity.high`` until attainment crosses the target, then bisects until the bracket
is within ``capacity.rel_tol``; both loops are bounded. With ``capacity.duration_s`` set, every probe offers load
for that long (``workload.duration_s``, no request cap): a fixed request count would arrive ever faster as one
burst and hide overload. Every probe is a full run (sim by default; ``backend=engine``
works at small scale) written to ``<out>/probe_<k>_<rate>/``; the trace (rate, attainment, goodput, ... per probe)
goes to ``capacity.csv`` and ``capacity.json``. The answer is the highest probed rate that met the target.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.checks import check_float, check_fraction, check_int
from experiments.cli import hydra_app
from experiments.overrides import apply_overrides
from experiments.run import run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: float
    goodput_rps: float | None
    throughput_rps: float | None
    ttft_p90_s: float | None
    met: bool
    phase: str  # expand | bisect


@dataclass
class CapacityResult:
    capacity_rps: float | None  # highest probed rate meeting the target; None: even the lowest probe missed it
    bracketed: bool  # False: the search hit its expansion bound before attainment crossed the target
    target: float
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"capacity_rps": self.capacity_rps, "bracketed": self.bracketed, "target": self.target,
                "probes": [asdict(p) for p in self.probes]}


def find_capacity(measure: Callable[[float], Mapping[str, Any]], target: float = 0.9, low: float = 1.0,
                  high: float = 2.0, max_expansions: int = 8, iterations: int = 8,
                  rel_tol: float = 0.02) -> CapacityResult:
    """Search with ``measure(rate) -> metrics`` (``slo_attainment``, ``goodput_rps``, ...)."""
    check_fraction(target, "capacity.target")
    low, high, rel_tol = (check_float(v, f"capacity.{k}", 0.0, strict=True)
                          for k, v in (("low", low), ("high", high), ("rel_tol", rel_tol)))
    if not low < high:
        raise ValueError(f"capacity.low={low} must be < capacity.high={high}")
    check_int(max_expansions, "capacity.max_expansions", 0)
    check_int(iterations, "capacity.iterations", 0)
    result = CapacityResult(None, False, target)
    seen: dict[float, bool] = {}

    def probe(rate: float, phase: str) -> bool:
        if rate in seen:
            return seen[rate]
        m = measure(rate)
        att = m.get("slo_attainment")
        att = 0.0 if att is None else float(att)
        met = att >= target
        ttft = (m.get("ttft_s") or {}).get("p90")
        result.probes.append(Probe(rate, att, m.get("goodput_rps"), m.get("throughput_rps"), ttft, met, phase))
        seen[rate] = met
        if met and (result.capacity_rps is None or rate > result.capacity_rps):
            result.capacity_rps = rate
        return met

    ok_low, ok_high = probe(low, "expand"), probe(high, "expand")
    for _ in range(max_expansions):  # monotone expansion until low meets the target and high does not
        if ok_low and not ok_high:
            break
        if ok_high:
            low, ok_low = high, True
            high *= 2
            ok_high = probe(high, "expand")
        else:
            high, ok_high = low, False
            low /= 2
            ok_low = probe(low, "expand")
    result.bracketed = ok_low and not ok_high
    if not result.bracketed:
        return result
    for _ in range(iterations):
        if (high - low) <= rel_tol * low:
            break
        mid = (low + high) / 2
        if probe(mid, "bisect"):
            low = mid
        else:
            high = mid
    return result


def write_trace(result: CapacityResult, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "capacity.csv", "json": out / "capacity.json"}
    with open(paths["csv"], "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["probe", "phase", "rate", "slo_attainment", "goodput_rps", "throughput_rps", "ttft_p90_s", "met"])
        for i, p in enumerate(result.probes):
            w.writerow([i, p.phase, repr(p.rate), repr(p.attainment), p.goodput_rps, p.throughput_rps, p.ttft_p90_s,
                        int(p.met)])
    paths["json"].write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return paths


def capacity(cfg: DictConfig, out_dir: str | Path) -> CapacityResult:
    """Search ``cfg.capacity.rate_key`` (default workload.arrival.rate_rps) on the configured backend."""
    c = cfg.capacity
    out = Path(out_dir)
    counter = iter(range(10**6))

    window = c.get("duration_s")
    if window is not None:
        check_float(window, "capacity.duration_s", 0.0, strict=True)

    def measure(rate: float) -> Mapping[str, Any]:
        extra = [f"{c.rate_key}={rate!r}"]
        if window is not None:  # a fixed arrival window: the request count grows with the rate
            extra += [f"workload.duration_s={float(window)!r}", "workload.num_requests=null"]
        probe_cfg = apply_overrides(cfg, extra)
        return run(probe_cfg, out / f"probe_{next(counter):02d}_{rate:.4g}")

    result = find_capacity(measure, float(c.target), c.low, c.high, int(c.max_expansions), int(c.iterations),
                           c.rel_tol)
    write_trace(result, out)
    return result


def describe(result: CapacityResult) -> str:
    lines = [f"{'probe':>5} {'phase':>7} {'rate':>10} {'attain':>7} {'goodput':>9}"]
    for i, p in enumerate(result.probes):
        good = "n/a" if p.goodput_rps is None else f"{p.goodput_rps:.3f}"
        lines.append(f"{i:>5} {p.phase:>7} {p.rate:>10.4g} {p.attainment:>7.3f} {good:>9}")
    if result.capacity_rps is None:
        lines.append(f"no probed rate reached attainment {result.target}")
    else:
        bound = "" if result.bracketed else " (lower bound: the search stopped expanding before attainment fell)"
        lines.append(f"capacity: {result.capacity_rps:.4g} req/s at attainment >= {result.target}{bound}")
    return "\n".join(lines)


@hydra_app("capacity")
def main(cfg: DictConfig) -> float | None:
    out = Path(HydraConfig.get().runtime.output_dir)
    result = capacity(cfg, out)
    log.info(describe(result))
    log.info(f"wrote {out}")
    return result.capacity_rps


if __name__ == "__main__":
    main()
