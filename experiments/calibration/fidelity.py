"""`python -m experiments.fidelity`: how close the simulator comes to a server it did not write, next to how close
the server comes to itself.

0. **Capacity** (``capacity/<name>``, ``capacity/capacity.json``; ``fidelity.capacity.probe``): each workload's
   request mix in a closed loop of ``fidelity.capacity.clients`` clients (default ``scheduler.max_num_seqs``), all
   queued at once: its completed requests per second is the server's capacity for that mix. A workload named in
   ``fidelity.load`` then arrives at that fraction of its capacity (its ``workload.arrival.rate_rps``), so "30-80%
   of capacity" is measured, not guessed.
1. **Measure** (``measure/rep<r>/<name>``, loadgen run directories with the server's ``/metrics`` around each):
   ``fidelity.repeats`` rounds, each the profiling runs (``fidelity.profiles``) then every workload
   (``fidelity.workloads``). A workload's request list is the same in every round (its ``workload.seed`` is fixed);
   the prompt *content* is drawn from ``seed`` = ``content_seed(round, position)``, different for every run, so a
   prefix cache serves neither a repeat nor another workload's prompts. The profiles' medians per round (isolated
   TTFT, decode ITL) are the machine's drift across the measurement.
2. **Base model**: ``experiments.calibrate`` on the profiling runs (request-level, ``calibrate.runs``) of round 0.
3. **Fit by simulation** (``experiments.calibration.simfit``) on each pair's training workload (the median
   quantiles of all its rounds, or round ``fidelity.train_repeat``): the base model's prefill / decode scales and
   the server terms (``sim.cost.server``), with the profiling runs simulated and fitted alongside
   (``fidelity.profile_anchors``: they pin the prefill and decode costs a single workload cannot separate). The
   held-out workloads' measurements take no part.
4. **Predict** each pair's held-out workload with that calibration (and with the base model, for contrast), the
   simulator given the server's KV pool from its telemetry; compare with every round's measurement.

``fidelity.json`` / ``fidelity.md``: per held-out workload, metric and percentile the measured median over rounds,
the **spread** (max - min over rounds, relative to the median), the simulated value, its error against the median,
and whether it passes: |error| <= max(``fidelity.tolerance``, spread); beside each workload its offered load (share
of the probed capacity) and the server's prefix-cache hit share next to the simulator's.
``fidelity.measured_from=<dir>`` reruns 2-4 on an earlier measurement, no server needed.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.checks import check_int
from core.output import read_metrics
from experiments.cli import hydra_app
from experiments.config import plain
from experiments.overrides import apply_overrides
from experiments.serving.loadgen.scrape import read_summary

log = logging.getLogger(__name__)
MEASURED = "measure"
CAPACITY = "capacity"
CAPACITY_SEED = 10**6  # the probes' content seeds: apart from every measured run's (content_seed below)


def content_seed(rep: int, index: int) -> int:
    """The prompt-content seed of run ``index`` (its position in profiles + workloads) of round ``rep``.

    Prompt tokens are drawn from (``seed``, request id). Two workloads of one round with one seed would share the
    first tokens of their i-th prompts, and a server's prefix cache would serve them (vLLM served 41% of one
    workload's prompt tokens that way before this was per run): every run gets its own content."""
    return 1000 * rep + index


def _names(f: DictConfig) -> tuple[list[str], list[str]]:
    profiles, workloads = list(f.profiles or {}), list(f.workloads or {})
    for pair in f.pairs:
        if len(pair) != 2 or any(p not in workloads for p in pair):
            raise ValueError(f"fidelity.pairs: {list(pair)} must be [training, held-out], both in fidelity.workloads "
                             f"({workloads})")
    if not profiles:
        raise ValueError("fidelity.profiles: at least one profiling run is needed (the base cost model's data)")
    return profiles, workloads


def run_config(cfg: DictConfig, overrides: Sequence[str], seed: int) -> DictConfig:
    """One measurement's config: the workload overrides, ``seed`` (prompt content), the workload's own seed kept
    as the overrides fix it (the request list); no plots or progress bar."""
    out = apply_overrides(cfg, [*overrides, "output.plots=false", "output.progress=false"])
    if "max_model_len" in out.workload and OmegaConf.select(out, "model.max_model_len") is None:
        from core.specs import ModelSpec  # a checkpoint's length is in its config.json, not in the model section

        out.workload.max_model_len = ModelSpec.from_config(plain(out.model)).max_model_len
    out.workload.seed = OmegaConf.select(out, "workload.seed")  # resolved now: `seed` below leaves the list alone
    out.seed = seed
    return out


def capacity_config(cfg: DictConfig, overrides: Sequence[str], index: int) -> DictConfig:
    """The closed-loop probe of one workload's mix: ``capacity.num_requests`` of its requests, all arriving at once
    (1,000 req/s), at most ``capacity.clients`` in flight (default ``scheduler.max_num_seqs``: the server's batch)."""
    c = cfg.fidelity.capacity
    clients = c.clients if c.clients is not None else OmegaConf.select(cfg, "scheduler.max_num_seqs")
    check_int(clients, "fidelity.capacity.clients (or scheduler.max_num_seqs)", 1)
    n = check_int(c.num_requests, "fidelity.capacity.num_requests", 1)
    at_once = "workload.arrival={kind: fixed, rate_rps: 1000.0}"
    out = run_config(cfg, [*overrides, f"workload.num_requests={n}", at_once], CAPACITY_SEED + index)
    out.target.max_concurrency = int(clients)
    return out


def probe_capacity(cfg: DictConfig, out: Path) -> dict[str, Any]:
    """Every workload's capacity (completed req/s in the closed loop) and the arrival rate ``fidelity.load`` gives
    it; ``out/capacity/capacity.json``."""
    from experiments.serving.loadgen.run import run_loadgen, summary_line

    f = cfg.fidelity
    _, workloads = _names(f)
    load = dict(f.get("load") or {})
    unknown = sorted(set(load) - set(workloads))
    if unknown:
        raise ValueError(f"fidelity.load: {unknown} are not in fidelity.workloads ({workloads})")
    for name, frac in load.items():
        if not isinstance(frac, int | float) or not 0.0 < float(frac) <= 1.5:
            raise ValueError(f"fidelity.load.{name}={frac!r}: a share of the probed capacity in (0, 1.5]")
    capacity, rate = {}, {}
    for i, name in enumerate(workloads):
        log.info(f"capacity probe: {name}")
        m = run_loadgen(capacity_config(cfg, list(f.workloads[name]), i), out / CAPACITY / name)
        log.info(summary_line(m))
        if not m.get("throughput_rps") or m.get("num_completed", 0) < m.get("num_requests", 0):
            raise RuntimeError(f"capacity probe of {name}: {m.get('num_completed')} of {m.get('num_requests')} "
                               f"requests completed ({out / CAPACITY / name}); the server cannot serve this mix")
        capacity[name] = float(m["throughput_rps"])
        if name in load:
            rate[name] = float(load[name]) * capacity[name]
    body = {"capacity_rps": capacity, "load": load, "rate_rps": rate}
    (out / CAPACITY / "capacity.json").write_text(json.dumps(body, indent=2) + "\n")
    return body


def workload_overrides(f: DictConfig, name: str, capacity: Mapping[str, Any] | None) -> list[str]:
    """A workload's overrides, its arrival rate set from the probed capacity when ``fidelity.load`` names it."""
    rate = ((capacity or {}).get("rate_rps") or {}).get(name)
    return [*f.workloads[name], *([] if rate is None else [f"workload.arrival.rate_rps={rate:.4f}"])]


def measure(cfg: DictConfig, out: Path) -> Path:
    """The capacity probes (when on), then every round's profiling runs and workloads against ``cfg.target``, into
    ``out/capacity`` and ``out/measure``."""
    from experiments.build import build_workload
    from experiments.serving.loadgen.run import run_loadgen, summary_line

    f = cfg.fidelity
    profiles, workloads = _names(f)
    reps = check_int(f.repeats, "fidelity.repeats", 1)
    names = [*profiles, *workloads]
    for name in names:  # every workload is built once first: a bad one fails before measuring
        build_workload(run_config(cfg, list((f.profiles if name in profiles else f.workloads)[name]), 0).workload)
    capacity = probe_capacity(cfg, out) if f.capacity.probe else None
    for rep in range(reps):
        for index, name in enumerate(names):
            overrides = f.profiles[name] if name in profiles else workload_overrides(f, name, capacity)
            run_cfg = run_config(cfg, list(overrides), content_seed(rep, index))
            if name in profiles:
                run_cfg.workload.seed = rep  # fresh profile prompts each round (the id prefix fixes the rest)
            d = out / MEASURED / f"rep{rep}" / name
            log.info(f"measure round {rep}: {name}")
            log.info(summary_line(run_loadgen(run_cfg, d)))
    return out / MEASURED


def runs_of(measured: Path, name: str) -> list[Path]:
    dirs = sorted(measured.glob(f"rep*/{name}"), key=lambda p: int(p.parent.name[3:]))
    if not dirs:
        raise ValueError(f"fidelity: no measured run of {name!r} under {measured} (rep*/{name})")
    return dirs


def drift(measured: Path, profiles: Sequence[str]) -> dict[str, list[float | None]]:
    """Per profiling run, per round: the median isolated TTFT (prefill) or ITL (decode), in seconds."""
    out: dict[str, list[float | None]] = {}
    for name in profiles:
        for d in runs_of(measured, name):
            m = read_metrics(d / "metrics.json")
            out.setdefault(f"{name}: ttft p50", []).append((m.get("ttft_s") or {}).get("p50"))
            out.setdefault(f"{name}: itl p50", []).append((m.get("itl_s") or {}).get("p50"))
    return out


def spread_rows(measured: Sequence[Mapping[str, Any]], predicted: Mapping[str, Mapping[str, Any]],
                metrics: Sequence[str], percentiles: Sequence[int], tolerance: float) -> list[dict[str, Any]]:
    """One row per (metric, percentile): the measured rounds' values, their median and spread ((max - min) /
    median), and per predicted model its value, error vs the median and pass (|error| <= max(tolerance, spread))."""
    rows = []
    for m in metrics:
        for p in percentiles:
            vals = [(r.get(m) or {}).get(f"p{p}") for r in measured]
            vals = [float(v) for v in vals if v is not None]
            med = float(np.median(vals)) if vals else None
            spread = (max(vals) - min(vals)) / med if vals and med else None
            row: dict[str, Any] = {"metric": m, "percentile": f"p{p}", "measured": vals, "median": med,
                                   "spread": spread}
            for label, pm in predicted.items():
                v = (pm.get(m) or {}).get(f"p{p}")
                err = None if v is None or not med else (v - med) / med
                row[label] = {"value": v, "error": err,
                              "pass": None if err is None else abs(err) <= max(tolerance, spread or 0.0)}
            rows.append(row)
    return rows


def load_of(measured: Path, name: str) -> dict[str, float | None]:
    """A workload's offered rate (its recorded ``workload.arrival.rate_rps``), the probed capacity of its mix
    (``capacity/capacity.json`` beside ``measured``) and their ratio; None where either is unknown."""
    recorded = OmegaConf.load(runs_of(measured, name)[0] / "config.yaml")
    rate = OmegaConf.select(recorded, "workload.arrival.rate_rps")
    path = measured.parent / CAPACITY / "capacity.json"
    cap = (json.loads(path.read_text())["capacity_rps"].get(name) if path.is_file() else None)
    rate = None if rate is None else float(rate)
    return {"rate_rps": rate, "capacity_rps": cap, "load": rate / cap if rate is not None and cap else None}


def _load_text(load: Mapping[str, Any] | None) -> str:
    if not load or load.get("rate_rps") is None:
        return ""
    cap = f" = {load['load']:.0%} of its capacity {load['capacity_rps']:.2f}" if load.get("load") else ""
    return f" at {load['rate_rps']:.2f} req/s{cap}"


def markdown(results: Mapping[str, Any], labels: Sequence[str]) -> str:
    lines = []
    for held, res in results.items():
        hits = " / ".join(_pct0(h) for h in res.get("server_prefix_hit_rate", []))
        sim_hits = ", ".join(f"{lab} {_pct0(v)}" for lab, v in res.get("sim_prefix_hit_rate", {}).items())
        lines += [f"### held-out {held}{_load_text(res.get('load'))} (calibrated on {res['train']}"
                  f"{_load_text(res.get('train_load'))})", "",
                  f"Prefix-cache hit share of prompt tokens: server {hits or 'n/a'} (rounds); simulated {sim_hits}.",
                  "",
                  "| metric | measured median | rounds | spread | " + " | ".join(f"{lab} | err" for lab in labels)
                  + " | pass |", "|---|---|---|---|" + "---|---|" * len(labels) + "---|"]
        for r in res["rows"]:
            rounds = " / ".join(f"{v * 1e3:.1f}" for v in r["measured"])
            cells = " | ".join(f"{_ms(r[lab]['value'])} | {_pct(r[lab]['error'])}" for lab in labels)
            ok = r[labels[0]]["pass"]
            lines.append(f"| {r['metric']} {r['percentile']} | {_ms(r['median'])} | {rounds} | {_pct(r['spread'])} | "
                         f"{cells} | {'yes' if ok else 'no' if ok is not None else 'n/a'} |")
        lines.append("")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.1f} ms"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _pct0(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def fidelity(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    """Measure (or reuse ``fidelity.measured_from``), fit, predict, report (see the module docstring)."""
    from experiments.calibration.calibrate import calibrate, describe

    f = cfg.fidelity
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profiles, _ = _names(f)
    if f.get("measured_from"):
        measured = Path(f.measured_from) / MEASURED
        if not measured.is_dir():
            raise ValueError(f"fidelity.measured_from={f.measured_from}: no {MEASURED}/ directory (a fidelity output)")
    else:
        measured = measure(cfg, out)
    from experiments.calibration import simfit  # the simulator side, imported after measuring
    base_cfg = apply_overrides(cfg, ["calibrate.runs=[" + ",".join(str(runs_of(measured, p)[0]) for p in profiles)
                                     + "]", "calibrate.fits=[linear]", "calibrate.plot=false"])
    base = calibrate(base_cfg, out / "base")
    base_path = base.path("linear")
    summary: dict[str, Any] = {"measured": str(measured), "base": {"path": str(base_path), "text": describe(base)},
                               "drift": drift(measured, profiles), "results": {}}
    labels = ["sim-fit", "base"]
    for train, held in f.pairs:
        train_runs = runs_of(measured, train)
        if f.train_repeat != "all":
            train_runs = [train_runs[check_int(f.train_repeat, "fidelity.train_repeat", 0)]]
        anchors = [runs_of(measured, p) for p in profiles] if f.get("profile_anchors", True) else []
        fit = simfit.fit(cfg, train_runs, base_path, out / "fits" / train, f.fit, anchors)
        held_runs = runs_of(measured, held)
        predicted = {}
        for label, cal in (("sim-fit", fit["path"]), ("base", base_path)):
            d = out / "predict" / held / label
            if d.exists():
                shutil.rmtree(d)
            predicted[label] = simfit.simulate_measured(cfg, held_runs[0], cal, d)
        rows = spread_rows([read_metrics(d / "metrics.json") for d in held_runs], predicted, list(f.metrics),
                           list(f.percentiles), float(f.tolerance))
        summary["results"][held] = {"train": train, "fit": fit, "rows": rows,
                                    "load": load_of(measured, held), "train_load": load_of(measured, train),
                                    "server_prefix_hit_rate": [(read_summary(d) or {}).get("prefix_hit_rate")
                                                               for d in held_runs],
                                    "sim_prefix_hit_rate": {k: v.get("token_reuse_rate")
                                                            for k, v in predicted.items()},
                                    "server_queue_mean_s": simfit.server_queue(held_runs),
                                    "sim_queue_mean_s": {k: v.get("queue_s", {}).get("mean")
                                                         for k, v in predicted.items()}}
    (out / "fidelity.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    text = markdown(summary["results"], labels)
    drift_lines = [f"- {k}: " + " / ".join("n/a" if v is None else f"{v * 1e3:.1f} ms" for v in vals)
                   for k, vals in summary["drift"].items()]
    (out / "fidelity.md").write_text("## drift across rounds (profiling runs)\n\n" + "\n".join(drift_lines)
                                     + "\n\n" + text)
    summary["markdown"] = text
    return summary


@hydra_app("fidelity")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    fidelity(cfg, out)
    log.info((out / "fidelity.md").read_text())
    log.info(f"wrote {out}")


if __name__ == "__main__":
    main()
