"""stall_metrics: mean ITL vs p99 ITL vs per-request max stall vs share of requests over a stall threshold.

One run with whole prefills (each long prompt pauses every running decode once), the same workload with chunked
prefill as the contrast. A pause is one gap in a few hundred per response, so token-weighted ITL statistics
average it away; the per-request max stall, and the share of requests over a threshold, do not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from experiments import plots
from experiments.studies.common import (
    Report,
    backends,
    ci_text,
    fmt,
    fmt_ci,
    get,
    option_name,
    run_dir,
    run_variants,
    seeds_of,
    slug,
)

COLUMNS = [("itl_s.mean", "mean ITL (ms)", 1e3), ("itl_s.p99", "p99 ITL (ms)", 1e3),
           ("max_stall_s.p50", "median max stall (ms)", 1e3), ("max_stall_s.p99", "p99 max stall (ms)", 1e3),
           ("stall_share_over_threshold", "share of requests over threshold", 1.0)]


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Stall metrics: which one catches a single long pause")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}; stall threshold {cfg.slo.max_stall_s} s "
             "(slo.max_stall_s). ITL statistics pool every inter-token gap (token-weighted); the max stall is each "
             "request's largest gap between output events, and its statistics are over requests.")
    groups = {}
    for backend, c in backends(cfg).items():
        main = option_name(c, "scheduler")
        contrast = next(o.split("=")[1] for o in c.study.contrast if o.startswith("scheduler="))
        d = out / slug(backend)
        runs = run_variants(c, {main: [], contrast: list(c.study.contrast)}, d)
        m = runs[main]
        src = f"{slug(backend)}/{slug(main)}/metrics.json"
        share = rep.number(f"{backend}.stall_share_over_threshold", m["stall_share_over_threshold"],
                           src + ":stall_share_over_threshold") + ci_text(m, "stall_share_over_threshold")
        rep.text(f"## {backend}",
                 f"With `{main}`: mean ITL {fmt_ci(m, 'itl_s.mean', 1e3)} ms and p99 ITL "
                 f"{fmt_ci(m, 'itl_s.p99', 1e3)} ms look healthy, yet **{share} of requests stalled longer than "
                 f"{fmt(m['stall_threshold_s'])} s** (largest stall {fmt(get(m, 'max_stall_s.max'), 1e3)} ms, "
                 "p99 of max stall "
                 f"{fmt(get(m, 'max_stall_s.p99'), 1e3)} ms). With `{contrast}` the share is "
                 f"{fmt_ci(runs[contrast], 'stall_share_over_threshold')}.")
        rep.metric_table(runs, COLUMNS, first="scheduler")
        groups[backend] = runs
        seeds = seeds_of(c)
        data = {k: plots.load_run(run_dir(d, k, seeds[0], seeds)) for k in runs}
        req = data[main].requests
        stalls = np.nan_to_num(req["max_stall_s"].astype(float), nan=-1.0)
        order = np.argsort(stalls, kind="stable")
        ids = [str(req["id"][order[-1]]), str(req["id"][order[len(order) // 2]])]
        fig = plots.token_gaps(data, ids, out / f"token_gaps_{slug(backend)}.png", m["stall_threshold_s"])
        rep.figure(fig, f"{backend}: gap before each output event of the request with the longest max stall under "
                        f"{main} ({ids[0]}) and of a median one ({ids[1]}); the same requests under {contrast}"
                        + (f" (seed {seeds[0]})" if len(seeds) > 1 else ""))
    fig = plots.grouped_bars(groups, COLUMNS, out / "stall_metrics.png")
    rep.figure(fig, "The four stall metrics on the same runs, per scheduler (bars); dashed: the stall threshold")
    return rep
