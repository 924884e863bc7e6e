"""prefix_cache_value: cache off / on from cold / on after warm-up, per workload.

The same measured requests in all three: ``off`` and ``warm`` run the warm-up requests first (flagged warmup,
excluded from metrics); ``cold`` replays only the measured requests, at the same arrival times, on an empty cache.
Groups for the TTFT comparison are fixed by the warm run (did the request hit, which prompt-length bucket) and
compared request by request across the three runs (from each run's requests.csv).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from core.metrics import bucket_labels, percentile
from experiments import plots
from experiments.studies.common import Report, backends, fmt, fmt_ci, run_dir, run_variants, seeds_of, slug

MODES = ("off", "cold", "warm")
PREFIX = [("request_hit_rate", "request hit rate", 1.0), ("token_reuse_rate", "token reuse rate", 1.0),
          ("prefill_work_saved", "prefill work saved", 1.0), ("ttft_s.p50", "TTFT p50 (s)", 1.0),
          ("ttft_s.p99", "TTFT p99 (s)", 1.0), ("goodput_rps", "goodput (req/s)", 1.0)]


def variants(name: str, warmup: int) -> dict[str, list[str]]:
    wl = f"study.workloads.{name}"
    return {"off": [f"workload=${{{wl}}}", f"{wl}.warmup_requests={warmup}", "kv.prefix_caching=false"],
            "cold": ["workload=${study.window}", f"study.window.inner=${{{wl}}}", f"study.window.skip={warmup}",
                     "kv.prefix_caching=true"],
            "warm": [f"workload=${{{wl}}}", f"{wl}.warmup_requests={warmup}", "kv.prefix_caching=true"]}


def group_ttfts(run_dirs: dict[str, Path], edges: list[int], method: str) -> list[list]:
    """Rows: group (hit/miss in the warm run x prompt bucket), count, TTFT p50 per mode, warm vs off change."""
    data = {k: plots.load_run(d) for k, d in run_dirs.items()}
    warm = data["warm"].requests
    keep = (warm["status"] == "FINISHED") & ~warm["warmup"]
    ids, hit = warm["id"][keep], warm["cached_tokens"][keep] > 0
    bucket = np.searchsorted(np.asarray(edges), warm["prompt_tokens"][keep], side="right")
    ttft = {}
    for mode, run in data.items():
        r = run.requests
        ttft[mode] = dict(zip(r["id"][r["status"] == "FINISHED"].tolist(),
                              r["ttft_s"][r["status"] == "FINISHED"].astype(float).tolist(), strict=True))
    rows = []
    for is_hit in (True, False):
        for b, label in enumerate(bucket_labels(edges)):
            members = ids[(hit == is_hit) & (bucket == b)].tolist()
            if not members:
                continue
            p50 = {m: percentile([ttft[m][i] for i in members if i in ttft[m]], 50, method) for m in MODES}
            change = None if not p50["off"] or p50["warm"] is None else p50["warm"] / p50["off"] - 1
            rows.append([f"{'hit' if is_hit else 'miss'} {label}", len(members), *(fmt(p50[m]) for m in MODES),
                         "n/a" if change is None else f"{change:+.1%}"])
    return rows


def run(cfg: DictConfig, out: Path) -> Report:
    edges = [int(e) for e in cfg.metrics.prompt_len_edges]
    rep = Report("Prefix cache value: off / cold / warm")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}, {cfg.replicas} replica(s), KV pool sized from memory. "
             "The same measured requests in every mode; warm-up requests run first and are excluded. Request hit "
             "rate = requests with a cached prefix / requests; token reuse = cached / prompt tokens; prefill work "
             "saved = sum C(h) / sum C(n), C(n) = a n + b n(n+1)/2 with the model's FLOPs.")
    groups = {}
    for backend, c in backends(cfg).items():
        for name in c.study.workloads:
            d = out / slug(backend) / name
            runs = run_variants(c, variants(name, int(c.study.warmup[name])), d)
            warm, src = runs["warm"], f"{slug(backend)}/{name}/warm/metrics.json"
            saved = rep.number(f"{backend}.{name}.warm.prefill_work_saved", warm["prefill_work_saved"],
                               src + ":prefill_work_saved")
            rep.text(f"## {name} ({backend})",
                     f"Warm cache: request hit rate {fmt_ci(warm, 'request_hit_rate')}, token reuse "
                     f"{fmt_ci(warm, 'token_reuse_rate')}, **prefill work saved {saved}**; TTFT p50 "
                     f"{fmt_ci(runs['off'], 'ttft_s.p50')} s off -> {fmt_ci(runs['cold'], 'ttft_s.p50')} s cold -> "
                     f"{fmt_ci(warm, 'ttft_s.p50')} s warm ({fmt(warm['num_requests'])} measured requests, "
                     f"{fmt(warm['num_warmup'])} warm-up).")
            rep.metric_table(runs, PREFIX, first="cache")
            seeds = seeds_of(c)
            rep.text("TTFT p50 (s) per group; groups from the warm run (hit = it reused a cached prefix)"
                     + (f", seed {seeds[0]}:" if len(seeds) > 1 else ":"))
            rep.table(["group", "requests", *(f"{m} p50" for m in MODES), "warm vs off"],
                      group_ttfts({m: run_dir(d, m, seeds[0], seeds) for m in MODES}, edges,
                                  cfg.metrics.percentile_method))
            groups[name if backend == "sim" else f"{name} ({backend})"] = runs
    fig = plots.grouped_bars(groups, PREFIX, out / "prefix_cache_value.png")
    rep.figure(fig, "Hit rate, token reuse and work saved tell different stories; TTFT and goodput per cache mode "
                    "(bars) and workload (groups)")
    return rep
