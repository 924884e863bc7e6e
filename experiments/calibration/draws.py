"""A calibrated simulation as the measured run's counterpart: with step noise (``sim.noise``) one simulation is one
draw of the machine's variability, so its metrics are the median over several draws, and the spread of the draws is
a prediction band: the interval a measured run of the same machine should fall in (``compare.band``, 5-95% of the
draws by default), reported beside each error with whether the measured value is inside it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from core.checks import check_int
from experiments.build import step_noise
from experiments.config import RunConfig
from experiments.run import run


def median_metrics(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The median of each number across runs' metrics (nested mappings, as metrics.json); where a value is not a
    number in every run (None, text), the first run's. A median, not a mean: a tail percentile that sits at a gap of
    its distribution (ITL p99 between the last decodes and the first mixed steps) jumps across it in some draws."""
    first = runs[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        vals = [r.get(k) for r in runs]
        if isinstance(v, Mapping) and all(isinstance(x, Mapping) for x in vals):
            out[k] = median_metrics(vals)
        elif all(isinstance(x, int | float) and not isinstance(x, bool) for x in vals):
            out[k] = float(np.median(vals))
        else:
            out[k] = v
    return out


BAND_METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def band_percentiles(band: Sequence[float]) -> tuple[float, float]:
    """``compare.band`` checked: two percentiles, low below high, in [0, 100]."""
    try:
        lo, hi = (float(p) for p in band)
    except (TypeError, ValueError):
        raise ValueError(f"compare.band={band!r}: two percentiles [low, high]") from None
    if not 0.0 <= lo < hi <= 100.0:
        raise ValueError(f"compare.band={list(band)}: two percentiles 0 <= low < high <= 100")
    return lo, hi


def draw_band(runs: Sequence[Mapping[str, Any]], percentiles: Sequence[float] = (5.0, 95.0),
              metrics: Sequence[str] = BAND_METRICS) -> dict[str, dict[str, list[float]]]:
    """{metric: {stat: [low, high]}}: the ``percentiles`` (numpy's linear interpolation) of each statistic of each
    latency metric across the draws' metrics; a statistic that is not a number in every draw has no band."""
    lo, hi = band_percentiles(percentiles)
    out: dict[str, dict[str, list[float]]] = {}
    for m in metrics:
        stats = runs[0].get(m)
        if not isinstance(stats, Mapping):
            continue
        for stat in stats:
            vals = [(r.get(m) or {}).get(stat) for r in runs]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
                a, b = np.percentile(np.asarray(vals, dtype=float), [lo, hi])
                out.setdefault(m, {})[stat] = [float(a), float(b)]
    return out


def with_band(rows: Sequence[Mapping[str, Any]], band: Mapping[str, Mapping[str, Sequence[float]]] | None,
              reference: str = "engine") -> list[dict[str, Any]]:
    """Error rows (metric, percentile, ``reference`` value, ...) with ``band_low`` / ``band_high`` and ``in_band``
    (the reference value inside the band, ends included) where the band has the row's statistic; None elsewhere."""
    out = []
    for r in rows:
        b = ((band or {}).get(r["metric"]) or {}).get(r["percentile"])
        ref = r.get(reference)
        inside = None if b is None or ref is None else bool(b[0] <= ref <= b[1])
        out.append({**r, "band_low": None if b is None else b[0], "band_high": None if b is None else b[1],
                    "in_band": inside})
    return out


def band_cells(r: Mapping[str, Any]) -> str:
    """Two markdown cells of an error row: its prediction band and whether the measured value is in it."""
    if r.get("band_low") is None:
        return " n/a | |"
    return f" {r['band_low']:.4g}-{r['band_high']:.4g} | {'yes' if r['in_band'] else 'NO'} |"


def band_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line: how many of the rows with a band hold the measured value."""
    banded = [r for r in rows if r.get("in_band") is not None]
    if not banded:
        return "no prediction band (the simulation has no step noise: one draw)"
    inside = sum(bool(r["in_band"]) for r in banded)
    return f"measured inside the prediction band: {inside} of {len(banded)} statistics"


def simulate_draws(sim_cfg: DictConfig, out_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The calibrated simulation into ``out_dir``, and its metrics to compare. With step noise (``sim.noise``) a
    simulation is one draw of the machine's variability, as the measured run is one: a percentile predicted from
    one draw scatters by several percent around the simulator's expectation (a TPOT p90 over 80 requests by
    +-15%), so the metrics are the median over ``compare.noise_draws`` noise seeds (``backend.noise_seed`` + 0,
    1, ...; the first is ``out_dir``'s run), and the second value gives each draw's headline numbers and the
    prediction band (``draw_band`` at ``compare.band``) (None: no noise)."""
    import tempfile
    from dataclasses import replace

    draws = check_int(sim_cfg.compare.get("noise_draws", 1), "compare.noise_draws", 1)
    band = list(band_percentiles(sim_cfg.compare.get("band") or (5.0, 95.0)))
    sim = RunConfig.from_config(sim_cfg)
    metrics = run(sim, out_dir)
    if step_noise(sim) is None or draws <= 1:
        return metrics, None
    seed = sim.sim.noise_seed
    runs = [metrics]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(1, draws):
            draw = replace(sim, sim=replace(sim.sim, noise_seed=seed + k), output=replace(sim.output, plots=False))
            runs.append(run(draw, Path(tmp) / str(k)))
    return median_metrics(runs), {"noise_seeds": list(range(seed, seed + draws)),
                                "headline": [headline(m) for m in runs],
                                "band_percentiles": band, "band": draw_band(runs, band)}


def headline(m: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers a comparison reports of a run's metrics."""
    return {"ttft_p50": m["ttft_s"]["p50"], "ttft_p90": m["ttft_s"]["p90"], "tpot_p50": m["tpot_s"]["p50"],
            "tpot_p90": m["tpot_s"]["p90"], "goodput_rps": m["goodput_rps"], "slo_attainment": m["slo_attainment"],
            "throughput_tok_s": m["throughput_tok_s"]}
