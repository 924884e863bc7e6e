"""`python -m experiments.fidelity`: how close the simulator comes to a server it did not write, next to how close
the server comes to itself.

1. **Measure** (``measure/rep<r>/<name>``, loadgen run directories with the server's ``/metrics`` around each):
   ``fidelity.repeats`` rounds, each the profiling runs (``fidelity.profiles``) then every workload
   (``fidelity.workloads``). A workload's request list is the same in every round (its ``workload.seed`` is fixed);
   the prompt *content* follows the round (``seed`` = round), so a prefix cache never serves a repeat. The profiles'
   medians per round (isolated TTFT, decode ITL) are the machine's drift across the measurement.
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
and whether it passes: |error| <= max(``fidelity.tolerance``, spread). ``fidelity.measured_from=<dir>`` reruns 2-4 on
an earlier measurement, no server needed.
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

log = logging.getLogger(__name__)
MEASURED = "measure"


def _names(f: DictConfig) -> tuple[list[str], list[str]]:
    profiles, workloads = list(f.profiles or {}), list(f.workloads or {})
    for pair in f.pairs:
        if len(pair) != 2 or any(p not in workloads for p in pair):
            raise ValueError(f"fidelity.pairs: {list(pair)} must be [training, held-out], both in fidelity.workloads "
                             f"({workloads})")
    if not profiles:
        raise ValueError("fidelity.profiles: at least one profiling run is needed (the base cost model's data)")
    return profiles, workloads


def run_config(cfg: DictConfig, overrides: Sequence[str], rep: int) -> DictConfig:
    """One measurement's config: the workload overrides, ``seed`` = round (prompt content), the workload's own seed
    kept as the overrides fix it (the request list); no plots or progress bar."""
    out = apply_overrides(cfg, [*overrides, "output.plots=false", "output.progress=false"])
    if "max_model_len" in out.workload and OmegaConf.select(out, "model.max_model_len") is None:
        from core.specs import ModelSpec  # a checkpoint's length is in its config.json, not in the model section

        out.workload.max_model_len = ModelSpec.from_config(plain(out.model)).max_model_len
    out.workload.seed = OmegaConf.select(out, "workload.seed")  # resolved now: `seed` below leaves the list alone
    out.seed = rep
    return out


def measure(cfg: DictConfig, out: Path) -> Path:
    """Every round's profiling runs and workloads against ``cfg.target``, into ``out/measure``."""
    from experiments.serving.loadgen.run import run_loadgen, summary_line

    f = cfg.fidelity
    profiles, workloads = _names(f)
    reps = check_int(f.repeats, "fidelity.repeats", 1)
    from experiments.build import build_workload

    for name in [*profiles, *workloads]:  # every workload is built once first: a bad one fails before measuring
        build_workload(run_config(cfg, list((f.profiles if name in profiles else f.workloads)[name]), 0).workload)
    for rep in range(reps):
        for name in [*profiles, *workloads]:
            overrides = (f.profiles if name in profiles else f.workloads)[name]
            run_cfg = run_config(cfg, list(overrides), rep)
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


def markdown(results: Mapping[str, Any], labels: Sequence[str]) -> str:
    lines = []
    for held, res in results.items():
        lines += [f"### held-out {held} (calibrated on {res['train']})", "",
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
