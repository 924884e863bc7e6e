"""A calibrated simulation as the measured run's counterpart: with step noise (``sim.noise``) one simulation is one
draw of the machine's variability, so its metrics are the median over several draws."""

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


def simulate_draws(sim_cfg: DictConfig, out_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The calibrated simulation into ``out_dir``, and its metrics to compare. With step noise (``sim.noise``) a
    simulation is one draw of the machine's variability, as the measured run is one: a percentile predicted from
    one draw scatters by several percent around the simulator's expectation (a TPOT p90 over 80 requests by
    +-15%), so the metrics are the median over ``compare.noise_draws`` noise seeds (``backend.noise_seed`` + 0,
    1, ...; the first is ``out_dir``'s run), and the second value gives each draw's headline numbers (None: no
    noise)."""
    import tempfile
    from dataclasses import replace

    draws = check_int(sim_cfg.compare.get("noise_draws", 1), "compare.noise_draws", 1)
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
                                "headline": [headline(m) for m in runs]}


def headline(m: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers a comparison reports of a run's metrics."""
    return {"ttft_p50": m["ttft_s"]["p50"], "ttft_p90": m["ttft_s"]["p90"], "tpot_p50": m["tpot_s"]["p50"],
            "tpot_p90": m["tpot_s"]["p90"], "goodput_rps": m["goodput_rps"], "slo_attainment": m["slo_attainment"],
            "throughput_tok_s": m["throughput_tok_s"]}
