"""cache_aware_routing: round robin vs least-loaded vs prefix-aware vs cost-based routing over several replicas.

Per router: TTFT, goodput, cache reuse and load imbalance (max / mean requests per replica). "Cache chase losses":
requests that the router placed where more of their prompt was cached than under the baseline (least outstanding,
which ignores the cache) yet got their first token later: a hit on a busy replica lost to a miss on an idle one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from experiments import plots
from experiments.studies.common import Report, backends, ci_text, fmt_ci, run_variants, same_seed, slug

COLUMNS = [("ttft_s.p50", "TTFT p50 (s)", 1.0), ("ttft_s.p99", "TTFT p99 (s)", 1.0),
           ("goodput_rps", "goodput (req/s)", 1.0), ("token_reuse_rate", "token reuse", 1.0),
           ("prefill_work_saved", "prefill work saved", 1.0), ("imbalance", "max/mean requests per replica", 1.0),
           ("chase_losses", "cache chase losses (share)", 1.0)]


def routing_fields(m: dict, run: plots.RunData, base: plots.RunData, replicas: int) -> dict:
    """Adds load imbalance and the cache-chase-loss share (against the baseline run) from the requests.csv files."""
    r, b = run.requests, base.requests
    measured = ~r["warmup"] if "warmup" in r else np.ones(len(r["id"]), bool)
    counts = np.bincount(r["replica"][measured & (r["replica"] >= 0)].astype(int), minlength=replicas)
    m["imbalance"] = float(counts.max() / counts.mean()) if counts.sum() else None
    fin = lambda d: {i: (c, t) for i, c, t, s in zip(d["id"].tolist(), d["cached_tokens"].tolist(),
                                                     d["ttft_s"].astype(float).tolist(), d["status"].tolist(),
                                                     strict=True) if s == "FINISHED"}
    mine, theirs = fin(r), fin(b)
    both = [i for i in mine if i in theirs]
    losses = sum(mine[i][0] > theirs[i][0] and mine[i][1] > theirs[i][1] for i in both)
    m["chase_losses"] = losses / len(both) if both else None
    return m


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Cache-aware routing")
    base_name = cfg.study.baseline
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name} per replica; workload `{cfg.workload._target_}` "
             f"(first {cfg.workload.get('limit')} requests); arrival times scaled so every replica count sees the "
             f"same load per replica. Cache chase losses: requests with a longer cached prefix than under "
             f"`{base_name}` but a later first token.")
    groups = {}
    for backend, c in backends(cfg).items():
        if base_name not in c.study.routers:
            raise ValueError(f"study.baseline={base_name!r} is not one of study.routers {list(c.study.routers)}")
        for n in c.study.replicas:
            scale = float(c.workload.time_scale) * 4 / int(n)
            d = out / slug(backend) / f"replicas={n}"
            runs = run_variants(c, {k: [f"replicas={n}", f"workload.time_scale={scale}", *v]
                                    for k, v in c.study.routers.items()}, d,
                                derive=lambda k, m, run_dir, n=int(n): routing_fields(
                                    m, plots.load_run(run_dir), plots.load_run(same_seed(run_dir, base_name)), n))
            best = max(runs, key=lambda k: runs[k]["goodput_rps"] or 0.0)
            src = f"{slug(backend)}/replicas={n}/{slug(best)}/metrics.json:goodput_rps"
            goodput = runs[best]["goodput_rps"]
            shown = rep.number(f"{backend}.replicas={n}.best_goodput_rps", goodput, src)
            rep.text(f"## {n} replicas ({backend})",
                     f"**Best goodput: {best}, {shown}{ci_text(runs[best], 'goodput_rps')} req/s** "
                     f"(TTFT p50 {fmt_ci(runs[best], 'ttft_s.p50')} s). Cache chase losses: "
                     + ", ".join(f"{k} {fmt_ci(m, 'chase_losses')}" for k, m in runs.items() if k != base_name) + ".")
            rep.metric_table(runs, COLUMNS, first="router")
            groups[f"{n} replicas" + (f" ({backend})" if backend != "sim" else "")] = runs
    fig = plots.grouped_bars(groups, COLUMNS, out / "cache_aware_routing.png")
    rep.figure(fig, "Latency, goodput, reuse, imbalance and cache chase losses per router (bars), per replica count "
                    "(groups); dashed: the TTFT SLO")
    return rep
