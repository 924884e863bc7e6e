"""`python -m experiments.pipeline` (`make run`): calibrate the simulator against the engine, check it on held-out
workloads, and write plots and a summary into one directory (outputs/pipeline/<time>/, printed at the end).

1. ``heldout/`` = ``experiments.compare`` on the root config's workload: the engine profiles the step-shape grid and
   runs a *training* workload (``compare.train``) step by step in turn with the held-out one; the cost models are
   fitted on the profile and the training steps only; the engine run is replayed through the simulator (logic
   error must be 0) and simulated with the calibration; CDFs, step scatter, percentile errors, latency and
   goodput vs request rate.
2. ``<name>/`` for each ``pipeline.evals`` entry: another held-out workload / scheduler, calibrated the same way
   (the same profile.csv and training workload; the training run again measured alongside this engine run).
3. ``summary.md`` (the numbers) and ``pipeline.json``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.calibration.compare import compare, errors_markdown
from experiments.cli import hydra_app
from experiments.overrides import apply_overrides

log = logging.getLogger(__name__)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1%}"


def _fit_lines(cal: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, rep in (cal.get("fit") or {}).items():
        groups = ", ".join(f"{g} {s['median_rel_error']:.1%}" for g, s in rep["groups"].items())
        lines.append(f"- {name}: R² {rep['r2']:.4f}, median |rel. error| {rep['median_rel_error']:.1%}, "
                     f"p90 {rep['p90_rel_error']:.1%} over {rep['num_rows']} measurements (median per group: {groups})")
    return lines


def _ms(m: Mapping[str, Any], key: str) -> str:
    return "n/a" if m.get(key) is None else f"{m[key] * 1e3:.1f}"


def _rates_table(rates: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[str]:
    labels = list(rates)
    keys = sorted({float(r) for v in rates.values() for r in v})
    head = "| rate (req/s) | " + " | ".join(f"{lab} TTFT p50 / p90 (ms) | {lab} TPOT p50 (ms) | {lab} goodput"
                                            for lab in labels) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(labels))]
    for r in keys:
        cells = []
        for lab in labels:
            m = rates[lab].get(str(r)) or {}
            cells += [f"{_ms(m, 'ttft_p50')} / {_ms(m, 'ttft_p90')}", _ms(m, "tpot_p50"),
                      "n/a" if m.get("goodput_rps") is None else f"{m['goodput_rps']:.2f}"]
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    return lines


def _within(rows: list[Mapping[str, Any]], tol: float) -> str:
    keys = [(r["metric"], r["percentile"]) for r in rows if r["metric"] in ("ttft_s", "tpot_s")
            and r["percentile"] in ("p50", "p90")]
    errs = {k: r["rel_error"] for r in rows for k in keys if (r["metric"], r["percentile"]) == k}
    bad = [f"{m} {p} {_pct(e)}" for (m, p), e in errs.items() if e is None or abs(e) > tol]
    return f"all within ±{tol:.0%}" if not bad else f"outside ±{tol:.0%}: {', '.join(bad)}"


def summary_markdown(cfg: DictConfig, main: Mapping[str, Any], extra: Mapping[str, Mapping[str, Any]],
                     wall_s: float, out: Path) -> str:
    cal = main["calibration"]
    lines = ["# twinserve pipeline: simulator calibrated against the engine", "",
             f"Model `{cfg.model.name}` on hardware `{cfg.hardware.name}`, engine clock `{main.get('engine_clock')}`, "
             f"scheduler `{cfg.scheduler._target_}`; total wall time {wall_s:.0f} s.", "",
             "## Calibration", "",
             *([f"Fitted on the profile grid and the training workload `{list(cal.get('train') or [])}`, measured "
                "alongside each held-out engine run; never on held-out runs.", "", *_fit_lines(cal)]
               if cal.get("fitted_here") else [f"Given: `{cal['path']}` (compare.calibration)."])]
    cv = main.get("linear_cv")
    if cv:
        lines.append(f"- linear, 5-fold cross-validated on the calibration data: median |rel. error| "
                     f"{cv['median_rel_error']:.1%}, p90 {cv['p90_rel_error']:.1%}")
    noise = (main.get("step_noise") or {}).get(Path(cal["path"]).stem)
    if noise:
        lines.append(f"- step noise (`sim/noise.py`): the training steps' log(measured / predicted) has sd "
                     f"{noise['sigma_all']:.3f} ({', '.join(f'{k} {v:.3f}' for k, v in noise['sigma'].items())}), "
                     f"replayed in blocks of {noise['block_steps']} steps")
    lines += [f"- cost model file: `{cal['path']}` (use: `python -m experiments.run cost_model=calibrated "
              f"cost_model.path={cal['path']}`)", ""]
    logic = main.get("logic") or {}
    lines += ["## Logic check", "",
              "Replaying the engine's measured step times through the simulator reproduces the engine run "
              + ("byte for byte (requests.csv, tokens.csv): logic error 0." if logic.get("identical")
                 else f"NOT identically: {logic.get('divergence') or logic.get('files')}"), ""]
    evals = {"heldout": main, **extra}
    for name, s in evals.items():
        steps = s["held_out_steps"]
        lines += [f"## Held-out `{name}`: {s['held_out']['workload']} with {s['held_out']['scheduler']}", "",
                  f"Per step, the calibrated model on this engine run's own steps: R² {steps['r2']:.3f}, median "
                  f"|rel. error| {steps['median_rel_error']:.1%}, p90 {steps['p90_rel_error']:.1%} "
                  f"({steps['num_rows']} steps). TTFT/TPOT p50/p90: {_within(s['errors'], 0.15)}.", "",
                  errors_markdown(s["errors"], f"{name}: sim vs engine (percentiles: nearest rank)")]
        draws = s.get("sim_draws")
        if draws:
            p90 = [h["tpot_p90"] for h in draws["headline"] if h["tpot_p90"] is not None]
            lines += [f"The sim column is the median of {len(draws['headline'])} step-noise draws; one draw's TPOT p90 "
                      + (f"ranged {min(p90) * 1e3:.3g}-{max(p90) * 1e3:.3g} ms." if p90 else "was not defined."), ""]
        bias = s.get("step_bias")
        if bias:
            lines += ["Median signed step error per engine run (the training run's is the fit's own; the held-out "
                      "run's shows how far the model is off there): "
                      + ", ".join(f"{k} {_pct(v)}" for k, v in bias.items()), ""]
    if main.get("rates"):
        lines += ["## Latency and goodput vs request rate (held-out workload)", "", *_rates_table(main["rates"]), ""]
    lines += ["## Files", "", *[f"- `{Path(p).relative_to(out)}`" for s in evals.values()
                                for p in s.get("plots", {}).values()], "- `*/errors.md`, `*/compare.json`: the numbers",
              "- `heldout/calibration/`: linear.yaml, roofline.yaml, fit reports, profile.csv, calibration_scatter.png",
              "- `*/engine`, `*/sim`, `*/replay`, `heldout/train`, `heldout/rates/*`: run directories (requests.csv, "
              "tokens.csv, steps.csv, metrics.json)", ""]
    return "\n".join(lines)


def pipeline(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    main = compare(cfg, out / "heldout")
    cal_dir = Path(main["calibration"]["path"]).parent
    fit = json.loads((cal_dir / "fit_report.json").read_text()) if main["calibration"]["fitted_here"] else {}
    main["linear_cv"], main["step_noise"] = fit.get("linear_cv"), fit.get("step_noise")
    # more held-out workloads: the same profile and training workload; with compare.calibration set, that file
    reuse = [f"calibrate.profile_from={cal_dir / 'profile.csv'}"] if (cal_dir / "profile.csv").is_file() else []
    extra = {}
    for name, overrides in (cfg.pipeline.evals or {}).items():
        extra[name] = compare(apply_overrides(cfg, [*overrides, *reuse, "compare.rates=[]"]), out / name)
    wall = time.perf_counter() - t0
    (out / "summary.md").write_text(summary_markdown(cfg, main, extra, wall, out))
    result = {"heldout": main, **extra, "wall_s": wall}
    (out / "pipeline.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str) + "\n")
    return result


@hydra_app("pipeline")
def main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    if not OmegaConf.select(cfg, "pipeline"):
        raise ValueError("pipeline: missing the `pipeline` section (conf/pipeline.yaml)")
    result = pipeline(cfg, out)
    log.info((out / "summary.md").read_text())
    log.info(f"pipeline finished in {result['wall_s']:.0f} s; results in {out.resolve()}")


if __name__ == "__main__":
    main()
