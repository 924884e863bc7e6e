"""pd_disaggregation: goodput against request rate for the same GPUs run as colocated replicas or split into prefill
and decode replicas (xPyD), under a tight and a loose TPOT SLO (conf/study/pd_disaggregation.yaml).

Each (split, rate) runs once, without an SLO; ``slo_fields`` then counts each SLO's goodput from the run's
requests.csv with ``core.metrics``' definition (FINISHED and within every target; TPOT is not checked for one-token
answers; over the run's ``duration_s``), so both SLOs read the same runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core.metrics import SLO
from core.output import read_requests
from experiments import plots
from experiments.studies.common import Report, backends, fmt, get, run_variants, slug


def slos_of(cfg: DictConfig) -> dict[str, SLO]:
    """``study.slos``: name -> targets (``core.metrics.SLO`` keys), checked."""
    return {str(name): SLO.from_mapping(OmegaConf.to_container(t, resolve=True)) for name, t in cfg.study.slos.items()}


def slo_fields(m: dict, run_dir: Path, slos: Mapping[str, SLO]) -> dict:
    """Adds ``slo_goodput`` and ``slo_attainment_by`` (per SLO name) from the run's requests.csv."""
    r = read_requests(run_dir)
    measured = ~r["warmup"]
    finished = measured & (r["status"] == "FINISHED")
    m["slo_goodput"], m["slo_attainment_by"] = {}, {}
    for name, slo in slos.items():
        ok = finished.copy()
        for limit, col in ((slo.ttft_s, "ttft_s"), (slo.tpot_s, "tpot_s"), (slo.e2e_s, "e2e_s"),
                           (slo.max_stall_s, "max_stall_s")):
            if limit is not None:
                ok &= ~(r[col] > limit)  # an empty cell (NaN: a one-token answer's TPOT) is not checked
        n = int(ok.sum())
        m["slo_goodput"][name] = n / m["duration_s"] if m.get("duration_s") else None
        m["slo_attainment_by"][name] = n / int(measured.sum()) if measured.any() else None
    return m


def best_split(runs: Mapping[str, Mapping[float, dict]], rate: float, key: str) -> tuple[str, Any]:
    """The split with the highest ``key`` at ``rate`` (the first listed on ties)."""
    values = {s: get(by_rate[rate], key) or 0.0 for s, by_rate in runs.items()}
    best = max(values, key=lambda s: values[s])
    return best, values[best]


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("PD disaggregation: goodput against request rate")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name} (DistServe's OPT-13B / A100 profile fits as the cost "
             f"model, conf/study/pd_disaggregation.yaml); workload `{cfg.workload._target_}` for "
             f"{cfg.workload.duration_s} s per rate; scheduler sarathi with a "
             f"{cfg.scheduler.max_num_batched_tokens}-token budget on every replica; router "
             f"{cfg.router._target_.rsplit('.', 1)[-1]}, placement {cfg.placement._target_.rsplit('.', 1)[-1]}. "
             "Goodput: requests per second that finished within the SLO's TTFT and TPOT targets.")
    curves: dict[str, dict[float, dict]] = {}
    for backend, c in backends(cfg).items():
        slos = slos_of(c)
        rates = [float(x) for x in c.study.rates]
        runs: dict[str, dict[float, dict]] = {}
        for split, overrides in c.study.splits.items():
            d = out / slug(backend) / slug(split)
            variants = {f"rate={x:g}": [*overrides, f"{c.study.rate_key}={x!r}"] for x in rates}
            res = run_variants(c, variants, d, derive=lambda k, m, run_dir, s=slos: slo_fields(m, run_dir, s))
            runs[split] = {x: res[f"rate={x:g}"] for x in rates}
            curves[split if backend == "sim" else f"{split} ({backend})"] = runs[split]
        rep.text(f"## {backend}", "SLOs: " + "; ".join(
            f"**{n}**: TTFT <= {s.ttft_s} s, TPOT <= {s.tpot_s} s" for n, s in slos.items()) + ".")
        for name in slos:
            key = f"slo_goodput.{name}"
            wins = []
            for x in rates:
                best, value = best_split(runs, x, key)
                src = f"{slug(backend)}/{slug(best)}/rate={x:g}/requests.csv"
                wins.append(f"{x:g} req/s: {best} ({rep.number(f'{backend}.{name}.rate={x:g}.best', value, src)})")
            rep.text(f"### Goodput (req/s), {name}", "Best per rate: " + "; ".join(wins) + ".")
            rep.table(["split", *(f"{x:g} req/s" for x in rates)],
                      [[s, *(fmt(get(by_rate[x], key)) for x in rates)] for s, by_rate in runs.items()])
        rep.text(f"### Latency and transfers ({backend})")
        rep.table(["split", "rate (req/s)", "TTFT p50 (s)", "TTFT p90 (s)", "TPOT p50 (ms)", "TPOT p90 (ms)",
                   "transfer p99 (ms)", "decode-KV wait p99 (ms)", "completed"],
                  [[s, f"{x:g}", fmt(get(m, "ttft_s.p50")), fmt(get(m, "ttft_s.p90")), fmt(get(m, "tpot_s.p50"), 1e3),
                    fmt(get(m, "tpot_s.p90"), 1e3), fmt(get(m, "pd.transfer_s.p99"), 1e3),
                    fmt(get(m, "pd.transfer_kv_wait_s.p99"), 1e3), f"{m['num_completed']}/{m['num_requests']}"]
                   for s, by_rate in runs.items() for x, m in by_rate.items()])
    names = list(slos_of(cfg))
    panels = [*((f"slo_goodput.{n}", f"goodput, {n} (req/s)", 1.0) for n in names),
              ("ttft_s.p90", "TTFT p90 (s)", 1.0), ("tpot_s.p90", "TPOT p90 (ms)", 1e3)]
    targets = {"tpot_s.p90": (float(np.min([s.tpot_s for s in slos_of(cfg).values() if s.tpot_s])) * 1e3,
                              "tightest TPOT target")}
    fig = plots.metric_curves(curves, panels, out / "pd_disaggregation.png", "request rate (req/s)",
                              targets=targets)
    rep.figure(fig, "Goodput under each SLO, TTFT p90 and TPOT p90 against the offered rate, per split of the same "
                    "GPUs (colocated replicas vs x prefill + y decode replicas)")
    return rep
