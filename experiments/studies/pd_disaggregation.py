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

from omegaconf import DictConfig, OmegaConf

from core.metrics import SLO
from core.output import read_requests
from experiments import plots
from experiments.studies.common import Report, backends, fmt, get, option_name, run_variants, slug


def slos_of(targets: Mapping[str, Any]) -> dict[str, SLO]:
    """Named SLOs (``study.slos``, or a workload's own ``slos``): name -> targets (``core.metrics.SLO`` keys),
    checked."""
    return {str(name): SLO.from_mapping(OmegaConf.to_container(t, resolve=True) if OmegaConf.is_config(t) else t)
            for name, t in targets.items()}


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


def workloads_of(cfg: DictConfig) -> dict[str, tuple[list[str], dict[str, SLO]]]:
    """``study.workloads``: name -> (its overrides, its SLOs: its own ``slos`` or the study's). One unnamed workload,
    the config's own, when absent."""
    out = {}
    for name, w in (cfg.study.get("workloads") or {"": {}}).items():
        slos = slos_of(w["slos"] if w.get("slos") else cfg.study.slos)
        out[str(name)] = (list(w.get("overrides") or []), slos)
    return out


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("PD disaggregation: goodput against request rate")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name} (DistServe's OPT-13B / A100 profile fits as the cost "
             f"model, conf/study/pd_disaggregation.yaml); {cfg.workload.duration_s} s of Poisson arrivals per rate; "
             f"scheduler sarathi with a {cfg.scheduler.max_num_batched_tokens}-token budget on every replica unless a "
             f"split says otherwise; router {option_name(cfg, 'router')}, placement {option_name(cfg, 'placement')}. "
             "Goodput: requests per second that finished within the "
             "SLO's TTFT and TPOT targets.")
    for backend, c in backends(cfg).items():
        for workload, (workload_overrides, slos) in workloads_of(c).items():
            where = f"{backend}, {workload}" if workload else backend
            curves = _section(rep, c, out / slug(backend) / slug(workload or "default"), where, workload_overrides,
                              slos)
            panels = [*((f"slo_goodput.{n}", f"goodput, {n} (req/s)", 1.0) for n in slos),
                      ("ttft_s.p90", "TTFT p90 (s)", 1.0), ("tpot_s.p90", "TPOT p90 (ms)", 1e3)]
            tightest = min(s.tpot_s for s in slos.values() if s.tpot_s)
            fig = plots.metric_curves(curves, panels, out / f"pd_disaggregation_{slug(where)}.png",
                                      "request rate (req/s)", targets={"tpot_s.p90": (tightest * 1e3,
                                                                                      "tightest TPOT target")})
            rep.figure(fig, f"{where}: goodput under each SLO, TTFT p90 and TPOT p90 against the offered rate, per "
                            "split of the same GPUs (colocated replicas vs x prefill + y decode replicas)")
    return rep


def _section(rep: Report, c: DictConfig, d: Path, where: str, workload_overrides: list[str],
             slos: Mapping[str, SLO]) -> dict[str, dict]:
    """One backend and workload: every split at every rate; the goodput and latency tables. Returns the curves."""
    rates = [float(x) for x in c.study.rates]
    runs: dict[str, dict[float, dict]] = {}
    for split, overrides in c.study.splits.items():
        variants = {f"rate={x:g}": [*workload_overrides, *overrides, f"{c.study.rate_key}={x!r}"] for x in rates}
        res = run_variants(c, variants, d / slug(split), derive=lambda k, m, run_dir, s=slos: slo_fields(m, run_dir, s))
        runs[split] = {x: res[f"rate={x:g}"] for x in rates}
    rep.text(f"## {where}", (f"Workload overrides: `{' '.join(workload_overrides)}`. " if workload_overrides else "")
             + "SLOs: " + "; ".join(f"**{n}**: TTFT <= {s.ttft_s} s, TPOT <= {s.tpot_s} s" for n, s in slos.items())
             + ".")
    for name in slos:
        key = f"slo_goodput.{name}"
        wins = []
        for x in rates:
            best, value = best_split(runs, x, key)
            src = f"{d.relative_to(d.parents[1])}/{slug(best)}/rate={x:g}/requests.csv"
            wins.append(f"{x:g} req/s: {best} ({rep.number(f'{where}.{name}.rate={x:g}.best', value, src)})")
        rep.text(f"### Goodput (req/s), {name}", "Best per rate: " + "; ".join(wins) + ".")
        rep.table(["split", *(f"{x:g} req/s" for x in rates)],
                  [[s, *(fmt(get(by_rate[x], key)) for x in rates)] for s, by_rate in runs.items()])
    rep.text(f"### Latency and transfers ({where})")
    rep.table(["split", "rate (req/s)", "TTFT p50 (s)", "TTFT p90 (s)", "TPOT p50 (ms)", "TPOT p90 (ms)",
               "transfer p99 (ms)", "decode-KV wait p99 (ms)", "completed"],
              [[s, f"{x:g}", fmt(get(m, "ttft_s.p50")), fmt(get(m, "ttft_s.p90")), fmt(get(m, "tpot_s.p50"), 1e3),
                fmt(get(m, "tpot_s.p90"), 1e3), fmt(get(m, "pd.transfer_s.p99"), 1e3),
                fmt(get(m, "pd.transfer_kv_wait_s.p99"), 1e3), f"{m['num_completed']}/{m['num_requests']}"]
               for s, by_rate in runs.items() for x, m in by_rate.items()])
    return runs
