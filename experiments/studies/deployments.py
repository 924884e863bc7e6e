"""Deployment search: every way to spread a model over a fixed number of devices -- tensor, pipeline and
attention-data-parallel degrees, expert parallelism, replicas -- and scheduler budget, simulated on one workload
and ranked by goodput per device under the SLO (and per dollar, with ``hardware.price_per_hour``).

``candidates`` enumerates the deployments of exactly ``gpus`` devices that the model's shapes allow
(``ParallelConfig.check``); ``search`` runs each (``experiments.studies.common.run_variants``), skipping what memory
refuses, and returns rows best first. The Optuna version of the same search is ``+sweep=deployment``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from core.output import read_metrics
from core.specs import ModelSpec
from experiments.config import ParallelConfig, RunConfig
from experiments.overrides import apply_overrides
from experiments.run import run as run_config
from experiments.studies.common import run_variants

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deployment:
    replicas: int
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    budget: int | None = None  # scheduler.max_num_batched_tokens (None: the config's)

    @property
    def devices(self) -> int:
        return self.replicas * self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        parts = [f"{self.replicas}x", f"tp{self.tp}"] + [f"{k}{v}" for k, v in
                                                        (("pp", self.pp), ("dp", self.dp), ("ep", self.ep)) if v > 1]
        return "_".join(parts) + (f"_b{self.budget}" if self.budget else "")

    def overrides(self) -> list[str]:
        out = [f"replicas={self.replicas}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
               f"parallel.dp={self.dp}", f"parallel.ep={self.ep}"]
        return out + ([f"scheduler.max_num_batched_tokens={self.budget}"] if self.budget else [])


def candidates(model: ModelSpec, gpus: int, tps: Sequence[int] = (1, 2, 4, 8), pps: Sequence[int] = (1, 2, 4),
               dps: Sequence[int] = (1,), budgets: Sequence[int | None] = (None,)) -> list[Deployment]:
    """Deployments of exactly ``gpus`` devices the model's shapes allow. An MoE model gets each data-parallel and
    tensor-parallel split with its experts unsplit (ep=1) and split over all tp x dp ranks (ep = tp x dp, vLLM's
    --enable-expert-parallel); pp and dp are not combined (not simulated)."""
    out = []
    for tp in tps:
        for pp in pps:
            for dp in dps:
                if gpus % (tp * pp * dp) or (pp > 1 and dp > 1):
                    continue
                eps = sorted({1, tp * dp}) if model.moe is not None else [1]
                for ep in eps:
                    try:
                        ParallelConfig(tp, pp, dp, ep).check(model)
                    except ValueError:
                        continue
                    out += [Deployment(gpus // (tp * pp * dp), tp, pp, dp, ep, b) for b in budgets]
    return out


def fits(cfg: DictConfig, d: Deployment) -> str | None:
    """Why ``d`` cannot be built on ``cfg`` (weights beyond a device's memory, ...), or None."""
    try:
        RunConfig.from_config(apply_overrides(cfg, d.overrides()))
    except ValueError as e:
        return str(e)
    return None


def search(cfg: DictConfig, deployments: Sequence[Deployment], out: Path) -> list[dict[str, Any]]:
    """Run every deployment that fits into ``out/<label>``; rows (label, deployment, goodput, per device, per
    dollar, latency percentiles, the run's metrics) best first by goodput per device, then by fewer devices per
    replica (the simpler deployment on a tie)."""
    runnable, rows = {}, []
    for d in deployments:
        why = fits(cfg, d)
        if why is None:
            runnable[d.label] = d
        else:
            log.info(f"[deployments] {d.label}: skipped ({why})")
    variants = {label: d.overrides() for label, d in runnable.items()}
    if "study" in cfg:
        results = run_variants(cfg, variants, out)  # the study's seeds
    else:
        results = {}
        for label, overrides in variants.items():
            run_config(apply_overrides(cfg, ["output.plots=false", *overrides]), out / label)
            results[label] = read_metrics(out / label / "metrics.json")
    for label, m in results.items():
        dep = m["deployment"]
        rows.append({"label": label, "deployment": runnable[label], "goodput_rps": m.get("goodput_rps"),
                     "goodput_rps_per_device": dep["goodput_rps_per_device"],
                     "goodput_per_dollar": dep["goodput_per_dollar"], "slo_attainment": m.get("slo_attainment"),
                     "ttft_p90_s": (m.get("ttft_s") or {}).get("p90"), "tpot_p90_s": (m.get("tpot_s") or {}).get("p90"),
                     "metrics": m})
    rows.sort(key=lambda r: (-r["goodput_rps_per_device"], r["deployment"].devices // r["deployment"].replicas))
    return rows
