"""parallelism: one node of ``study.gpus`` devices, several ways to spread a model over it, at an SLO.

Each part (``study.parts``: a model, request rates, deployments as [replicas, tp, pp, dp, ep]) runs every deployment
at every Poisson rate on the simulator (roofline, collectives from the hardware's measured NCCL tables) and reads
back goodput per device under the SLO and the TTFT / TPOT p90 from each run's metrics.json. Per deployment, its
capacity: the highest rate at which at least ``study.target`` of the requests meet the SLO; the headline per part is
the deployment with the highest capacity (ties: more goodput per device there). Figures: goodput per device, TTFT
p90 and TPOT p90 against the rate, one row per part.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from experiments import plots
from experiments.studies.common import Report, fmt, get, run_variants, slug
from experiments.studies.deployments import Deployment

PANELS = (("deployment.goodput_rps_per_device", "goodput per GPU (req/s)", 1.0),
          ("ttft_s.p90", "TTFT p90 (s)", 1.0), ("tpot_s.p90", "TPOT p90 (ms)", 1e3))


def deployments_of(part: DictConfig) -> dict[str, Deployment]:
    out = {}
    for label, spec in part.deployments.items():
        replicas, tp, pp, dp, ep = (int(v) for v in spec)
        out[str(label)] = Deployment(replicas, tp, pp, dp, ep)
    return out


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report(f"Parallelism on {cfg.study.gpus} x {cfg.hardware.name}: goodput per GPU under the SLO")
    slo = OmegaConf.to_container(cfg.slo, resolve=True)
    rep.text(f"SLO: {', '.join(f'{k} {v}' for k, v in slo.items() if v is not None)}; workload "
             f"{cfg.workload.num_requests} requests per run; scheduler budget {cfg.scheduler.max_num_batched_tokens} "
             f"tokens. Collectives: the hardware's measured NCCL tables ({cfg.hardware.get('network_profile')}) where "
             "they have the worker count, else the peer link (sim/cost/comm.py).")
    results: dict[str, dict[str, dict[float, dict]]] = {}
    for name, part in cfg.study.parts.items():
        deps = deployments_of(part)
        for label, d in deps.items():
            if d.devices != int(cfg.study.gpus):
                raise ValueError(f"study.parts.{name}.deployments.{label}: {d.devices} devices, not study.gpus="
                                 f"{cfg.study.gpus}")
        variants = {f"{name}/{label}/rate={r:g}": [f"model={part.model}", *d.overrides(),
                                                    f"workload.arrival.rate_rps={r}"]
                    for label, d in deps.items() for r in part.rates}
        runs = run_variants(cfg, {slug(k): v for k, v in variants.items()}, out)
        by = results[str(name)] = {}
        for key in variants:
            _, label, rate = key.split("/")
            by.setdefault(label, {})[float(rate.removeprefix("rate="))] = runs[slug(key)]
        target = float(cfg.study.target)
        rows, cap = [], {}
        for label, per_rate in by.items():
            ok = [r for r in sorted(per_rate) if (get(per_rate[r], "slo_attainment") or 0.0) >= target]
            cap[label] = ok[-1] if ok else None
            m = per_rate[ok[-1]] if ok else {}
            rows.append([label, fmt(cap[label]), *(fmt(get(m, k), s) for k, _, s in PANELS),
                         fmt(get(m, "deployment.goodput_per_dollar"))])
        held = [lb for lb in by if cap[lb] is not None]
        if held:
            best = max(held, key=lambda lb: (cap[lb], get(by[lb][cap[lb]], "deployment.goodput_rps_per_device")))
            src = f"{slug(f'{name}/{best}/rate={cap[best]:g}')}/metrics.json:deployment.goodput_rps_per_device"
            value = get(by[best][cap[best]], "deployment.goodput_rps_per_device")
            rep.text(f"**{part.model}**: the most load within the SLO for {target:g} of the requests: **{best}**, "
                     f"{fmt(cap[best])} req/s, {rep.number(f'{name}.best_goodput_per_gpu', value, src)} req/s per "
                     "GPU under the SLO there.")
        else:
            rep.text(f"**{part.model}**: no deployment keeps {target:g} of the requests within the SLO at any rate.")
        rep.table(["deployment", "highest rate within SLO (req/s)", *(f"{t} there" for _, t, _ in PANELS),
                   "req per $ there"], rows)
    path = figure(results, out / "parallelism.png")
    rep.figure(path, "Goodput per GPU, TTFT p90 and TPOT p90 against the request rate, per deployment (rows: "
                     "models)")
    return rep


def figure(results: dict[str, dict[str, dict[float, dict]]], path: Path) -> Path:
    with plots.figure(len(results), len(PANELS)) as (fig, axes):
        for row, (name, by) in enumerate(results.items()):
            for col, (key, title, scale) in enumerate(PANELS):
                ax = axes[row][col]
                for i, (label, per_rate) in enumerate(by.items()):
                    rates = sorted(per_rate)
                    ys = [(get(per_rate[r], key) or 0.0) * scale for r in rates]
                    ax.plot(rates, ys, marker="o", color=plots.COLORS[i % len(plots.COLORS)], label=label)
                ax.set_xlabel("request rate (req/s)")
                ax.set_title(f"{name}: {title}", fontsize=8)
            plots.legend_outside(axes[row][-1])
        return plots._save(fig, path)
