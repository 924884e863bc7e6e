"""Calibrate on a loaded run by simulation: choose the cost model's scales and the server terms so that simulating a
measured *training* run reproduces its per-request TTFT / TPOT / ITL distributions.

A fit on isolated steps (a profile, request-level samples of profiling runs) leaves out what only load shows: the
scheduling and output work that grows with the running requests, the front end competing for the cores, queueing.
Here the simulator runs the training run's own request list (arrivals, lengths; the server's KV pool from its
``/metrics`` when recorded, ``experiments.serving.loadgen.scrape``) under candidate parameters; the loss is the mean
squared log ratio of simulated to measured quantiles (``QUANTILES``) of each metric. Parameters (``PARAMS``, any
subset may be fitted, the rest stay at their start):

- ``prefill_scale`` / ``decode_scale`` / ``context_scale``: multiply the base linear model's prefill terms (per
  prefill token, attention pair, prefill context token) / per decode sequence / per KV token a decode reads (a
  workload of short contexts cannot tell the last two apart, a base fit on noisy profiles often mixes them); start 1;
- ``per_prefill_token_s``: added to the base's per-prefill-token cost (a request-level base fit on noisy profiles
  can put a prefill's cost into the intercept, which a scale cannot move into mixed steps); start 0;
- ``per_step_s``, ``per_running_seq_s``, ``per_output_token_s``, ``overlap`` (``sim.cost.server.ServerTerms``); start 0;
- ``frontend_delay_s``: the per-request front-end time; start at the base file's;
- ``noise_sigma``: the machine's step-time variability (``sim.noise``) for a server whose steps are not seen: a
  seeded standard-normal z (``NOISE_STEPS`` values, blocks of ``block_steps`` = ``NOISE_BLOCK_STEPS`` steps by
  default), each step's time times exp(sigma z) / mean (its mean stays the model's). A deterministic simulation
  gives narrow latency distributions; a loaded shared box spreads them (slow stretches), which this term carries.
  Start 0; the calibration file records it as its ``step_noise`` section, which a simulation with it replays.

Optimiser: scipy's bounded Powell on the parameters scaled to [0, 1] (deterministic: the simulation has no noise
here, the same parameters give the same loss), at most ``max_evals`` simulations; a minute-long run simulates in
~0.1-0.3 s. The result is a calibration file (``calibrated.yaml``, ``sim.cost.calibrated``) usable as
``cost_model=calibrated cost_model.path=...`` anywhere, and ``simfit.json`` (the loss before / after, parameters,
per-quantile errors on the training run).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core.output import read_requests, read_tokens
from experiments.overrides import apply_overrides, with_calibration
from experiments.serving.loadgen.scrape import read_summary
from sim.cost.calibrated import calibrated_frontend_delay, load_calibration, write_calibration
from sim.cost.linear import LinearCostModel
from sim.cost.server import ServerTerms, with_server_terms

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
METRICS = ("ttft", "tpot", "itl")
PREFILL_TERMS = ("per_prefill_token_s", "per_attention_pair_s", "per_prefill_context_token_s")
DECODE_TERMS = ("per_decode_seq_s",)
CONTEXT_TERMS = ("per_kv_token_read_s",)
# (low, high) of each parameter
PARAMS = {"prefill_scale": (0.3, 3.0), "decode_scale": (0.3, 3.0), "context_scale": (0.1, 3.0),
          "per_prefill_token_s": (0.0, 1e-3),
          "per_step_s": (0.0, 0.05),
          "per_running_seq_s": (0.0, 0.004), "per_output_token_s": (0.0, 0.004), "overlap": (0.0, 1.0),
          "frontend_delay_s": (0.0, 0.3), "noise_sigma": (0.0, 0.8)}
NOISE_STEPS = 4096  # synthetic standard-normal z of the fitted step noise (seeded by fidelity.fit.seed)
NOISE_BLOCK_STEPS = 16  # consecutive steps sharing a slow stretch (a second or so of a loaded CPU server)


# ---- the measured run ---------------------------------------------------------------------------------------------
def telemetry_overrides(run_dir: str | Path) -> list[str]:
    """The simulator's KV pool as the server reported it (``cache_config_info``): block size and block count."""
    s = read_summary(run_dir) or {}
    if not s.get("num_gpu_blocks") or not s.get("block_size"):
        return []
    return [f"kv.block_size={s['block_size']}", f"kv.num_blocks={s['num_gpu_blocks']}", "kv.memory_bytes=null"]


def server_queue(run_dirs: Sequence[str | Path]) -> list[float | None]:
    """The server's own mean queue time per request (``request_queue_time_seconds``) of each run, when it has one."""
    return [(read_summary(d) or {}).get("queue_mean_s") for d in run_dirs]


def measured_cfg(cfg: DictConfig, run_dir: str | Path) -> DictConfig:
    """``cfg`` with the workload a loadgen run recorded (same requests) and the server's KV pool."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir}: no config.yaml (a loadgen run directory records its workload there)")
    recorded = OmegaConf.load(run_dir / "config.yaml")
    out = apply_overrides(cfg, telemetry_overrides(run_dir))
    out.workload = OmegaConf.create(OmegaConf.to_container(recorded.workload, resolve=True))
    return out


def measured_arrays(run_dir: str | Path) -> dict[str, np.ndarray]:
    """Per finished request its TTFT and TPOT, and every inter-token gap (between output events), in seconds."""
    r = read_requests(run_dir)
    ok = (r["status"] == "FINISHED") & (r["warmup"].astype(int) == 0 if "warmup" in r else True)
    t = read_tokens(run_dir)
    keep = set(r["id"][ok].tolist())
    ids, times = t["request_id"], t["time_s"].astype(float)
    gaps = []
    order = np.lexsort((times, ids))
    ids, times = ids[order], times[order]
    same = ids[1:] == ids[:-1]
    mask = same & np.array([i in keep for i in ids[1:]], dtype=bool)
    gaps = np.diff(times)[mask]
    tpot = r["tpot_s"][ok].astype(float)
    return {"ttft": r["ttft_s"][ok].astype(float), "tpot": tpot[np.isfinite(tpot)], "itl": gaps}


def state_arrays(states: Sequence[Any]) -> dict[str, np.ndarray]:
    """``measured_arrays`` of a simulation's request states."""
    ttft, tpot, itl = [], [], []
    for s in states:
        if s.finish_s is None or s.first_token_s is None or getattr(s.request, "warmup", False):
            continue
        ttft.append(s.first_token_s - s.request.arrival_s)
        times = np.unique(np.asarray(s.token_times, dtype=float))
        n = len(s.token_times)
        if n > 1:
            tpot.append((s.finish_s - s.first_token_s) / (n - 1))
            itl.extend(np.diff(times).tolist())
    return {"ttft": np.array(ttft), "tpot": np.array(tpot), "itl": np.array(itl)}


def quantiles(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {m: np.quantile(a[m], QUANTILES) if len(a[m]) else np.full(len(QUANTILES), np.nan) for m in METRICS}


def loss(sim_q: Mapping[str, np.ndarray], meas_q: Mapping[str, np.ndarray],
         meas_sd: Mapping[str, np.ndarray] | None = None, sd_floor: float = 0.1) -> float:
    """Mean squared log(simulated / measured) over metrics and quantiles (a missing value costs 1).

    ``meas_sd``: the measured log quantiles' standard deviation over repeated runs; each term is then weighted by
    sd_floor² / (sd_floor² + sd²), so a quantile the server itself does not repeat (a profile's TTFT that moved 7x
    across rounds) steers the fit less than one it repeats within ``sd_floor``; one run (sd 0) weighs 1."""
    terms = []
    for m in METRICS:
        s, y = sim_q[m], meas_q[m]
        r = np.log(np.maximum(s, 1e-9) / np.maximum(y, 1e-9))
        w = np.ones_like(r) if meas_sd is None else sd_floor ** 2 / (sd_floor ** 2 + np.asarray(meas_sd[m]) ** 2)
        terms += [1.0 if not math.isfinite(v) else wi * v * v for v, wi in zip(r.tolist(), w.tolist(), strict=True)]
    return float(np.mean(terms))


# ---- candidate models --------------------------------------------------------------------------------------------
def scaled(base: LinearCostModel, prefill_scale: float, decode_scale: float,
           context_scale: float = 1.0) -> LinearCostModel:
    kw = {k: getattr(base, k) * prefill_scale for k in PREFILL_TERMS}
    kw.update({k: getattr(base, k) * decode_scale for k in DECODE_TERMS})
    kw.update({k: getattr(base, k) * context_scale for k in CONTEXT_TERMS})
    return replace(base, **kw)


def candidate(base: LinearCostModel, p: Mapping[str, float]) -> tuple[Any, ServerTerms]:
    terms = ServerTerms(**{k: p[k] for k in ("per_step_s", "per_running_seq_s", "per_output_token_s", "overlap")})
    model = scaled(base, p["prefill_scale"], p["decode_scale"], p["context_scale"])
    return replace(model, per_prefill_token_s=model.per_prefill_token_s + p["per_prefill_token_s"]), terms


class Simulator:
    """The training run's workload in the simulator, rerun per candidate (config parsed once)."""

    def __init__(self, cfg: DictConfig, base_path: str | Path) -> None:
        from experiments.config import RunConfig

        self.run = RunConfig.from_config(with_calibration(cfg, base_path))

    def states(self, model: Any, frontend_delay_s: float, noise: Mapping[str, Any] | None = None) -> list[Any]:
        from experiments.build import build_loop
        from sim.clock import run_virtual
        from sim.executor import CostModelExecutor
        from sim.noise import StepNoise

        run = replace(self.run, frontend_delay_s=frontend_delay_s)

        def executors(replicas: Sequence[Any]) -> list[CostModelExecutor]:
            return [CostModelExecutor(model, noise=None if noise is None else StepNoise.from_mapping(
                noise, [run.sim.noise_seed, r.index])) for r in replicas]

        return run_virtual(build_loop(run, executors)).states


def noise_record(sigma: float, block_steps: int = NOISE_BLOCK_STEPS, seed: int = 0) -> dict[str, Any] | None:
    """A ``step_noise`` section (``sim.noise``) of standard-normal z scaled by ``sigma`` (None when 0)."""
    if sigma <= 0:
        return None
    z = np.random.default_rng([seed, 0x2015E]).standard_normal(NOISE_STEPS)
    z = (z - z.mean()) / z.std()
    return {"block_steps": int(block_steps), "num_steps": NOISE_STEPS, "sigma_all": float(sigma), "sigma": {},
            "source": f"simfit: seeded N(0, 1) (seed {seed}), sigma fitted", "z": np.round(z, 4).tolist()}


def base_model(base_path: str | Path) -> LinearCostModel:
    m = load_calibration(base_path, allow_mismatch=True)
    if not isinstance(m, LinearCostModel):
        raise ValueError(f"{base_path}: the simulation fit scales a linear cost model (experiments.calibrate "
                         f"fits=[linear]); got {type(m).__name__}")
    return m


def measured_quantiles(run_dirs: Sequence[str | Path]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each metric's quantiles, the median over runs of the same request list (one run: its own): repeated
    measurements of a noisy server are fitted at their middle, not at one draw; and the standard deviation of their
    logs over the runs (0 for one run), ``loss``'s weights."""
    per_run = [quantiles(measured_arrays(d)) for d in run_dirs]
    stacked = {m: np.stack([q[m] for q in per_run]) for m in METRICS}
    return ({m: np.median(v, axis=0) for m, v in stacked.items()},
            {m: np.log(np.maximum(v, 1e-9)).std(axis=0) for m, v in stacked.items()})


def fit(cfg: DictConfig, train_dir: str | Path | Sequence[str | Path], base_path: str | Path, out_dir: str | Path,
        options: Mapping[str, Any], anchors: Sequence[Sequence[str | Path]] = ()) -> dict[str, Any]:
    """Fit on ``train_dir`` (a loadgen run, or several of the same request list: their median quantiles) starting
    from ``base_path`` (a linear calibration); writes ``out_dir/calibrated.yaml`` and ``simfit.json``; returns
    simfit.json's dict (``path``: the calibration). ``options``: ``params`` (names of ``PARAMS``), ``max_evals``
    (simulations per Powell pass), ``passes`` (Powell restarts from the best point), ``seed`` and
    ``noise_block_steps`` (the fitted step noise), ``spread_weights`` (``loss``'s weights from the repeats' spread,
    default on). ``anchors``: more groups of runs (each one request list, e.g.
    the profiling runs) simulated and fitted alongside, the loss the mean over groups: a loaded workload alone
    (short prompts, long answers) cannot tell a prefill's cost, which its extrapolation to other prompts needs."""
    from scipy.optimize import minimize

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(options.get("params") or PARAMS)
    unknown = sorted(set(names) - set(PARAMS))
    if unknown:
        raise ValueError(f"fidelity.fit.params: unknown {unknown}; allowed: {list(PARAMS)}")
    max_evals, passes = int(options.get("max_evals", 250)), int(options.get("passes", 1))
    seed, block = int(options.get("seed", 0)), int(options.get("noise_block_steps") or NOISE_BLOCK_STEPS)
    weighted = bool(options.get("spread_weights", True))  # loss terms weighed by the measured repeat spread
    base = base_model(base_path)
    start = {"prefill_scale": 1.0, "decode_scale": 1.0, "context_scale": 1.0, "per_prefill_token_s": 0.0,
             "per_step_s": 0.0, "per_running_seq_s": 0.0, "per_output_token_s": 0.0, "overlap": 0.0,
             "frontend_delay_s": calibrated_frontend_delay(base_path), "noise_sigma": 0.0}
    train = [train_dir] if isinstance(train_dir, str | Path) else list(train_dir)
    groups = [train, *(list(g) for g in anchors)]
    targets = [(Simulator(measured_cfg(cfg, g[0]), base_path), *measured_quantiles(g)) for g in groups]
    evals: list[float] = []
    best_seen: list[tuple[float, np.ndarray]] = []  # Powell's returned x is not always the best point it evaluated

    def group_losses(model: Any, p: Mapping[str, float]) -> list[tuple[float, dict[str, np.ndarray]]]:
        noise = noise_record(p["noise_sigma"], block, seed)
        out = []
        for sim, meas_q, meas_sd in targets:
            q = quantiles(state_arrays(sim.states(model, p["frontend_delay_s"], noise)))
            out.append((loss(q, meas_q, meas_sd if weighted else None), q))
        return out

    def params_of(x: np.ndarray) -> dict[str, float]:
        p = dict(start)
        for k, v in zip(names, np.clip(x, 0.0, 1.0).tolist(), strict=True):
            lo, hi = PARAMS[k]
            p[k] = lo + v * (hi - lo)
        return p

    def objective(x: np.ndarray) -> float:
        p = params_of(x)
        model, terms = candidate(base, p)
        evals.append(float(np.mean([g[0] for g in group_losses(with_server_terms(model, terms), p)])))
        if not best_seen or evals[-1] < best_seen[0][0]:
            best_seen[:] = [(evals[-1], np.clip(x, 0.0, 1.0).copy())]
        return evals[-1]

    x0 = np.array([(min(max(start[k], PARAMS[k][0]), PARAMS[k][1]) - PARAMS[k][0]) / (PARAMS[k][1] - PARAMS[k][0])
                   for k in names])
    before = objective(x0)
    x = x0
    for _ in range(max(passes, 1)):
        x = minimize(objective, x, method="Powell", bounds=[(0.0, 1.0)] * len(names),
                     options={"maxfev": max_evals, "xtol": 1e-3, "ftol": 1e-4}).x
        x = best_seen[0][1]  # a pass cut off by maxfev returns its current point, which may be worse
    best = params_of(x)
    model, terms = candidate(base, best)
    noise = noise_record(best["noise_sigma"], block, seed)
    final = group_losses(with_server_terms(model, terms), best)
    after = float(np.mean([g[0] for g in final]))
    note = (f"simulation fit (experiments.calibration.simfit) on {[str(t) for t in train]}"
            + (f" with {len(anchors)} anchor group(s)" if anchors else "")
            + f": {len(evals)} simulations, loss {before:.4f} -> {after:.4f}; base {base_path}")
    path = write_calibration(out / "calibrated.yaml", model, note=note, fitted_for=_fitted_for(base_path),
                             frontend_delay_s=best["frontend_delay_s"], server_terms=terms, step_noise=noise)
    report = {"path": str(path), "train": [str(t) for t in train], "base": str(base_path), "params": best,
              "anchors": [[str(d) for d in g] for g in anchors],
              "fitted": names, "num_simulations": len(evals), "loss_before": before, "loss_after": after,
              "group_loss_after": [g[0] for g in final], "quantiles": list(QUANTILES),
              "train_error": {m: ((final[0][1][m] - targets[0][1][m]) / targets[0][1][m]).tolist()
                              for m in METRICS}}
    (out / "simfit.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _fitted_for(path: str | Path) -> tuple[str, str] | None:
    import yaml

    ff = (yaml.safe_load(Path(path).read_text()) or {}).get("fitted_for") or {}
    return (ff["model"], ff["hardware"]) if ff.get("model") and ff.get("hardware") else None


def simulate_measured(cfg: DictConfig, run_dir: str | Path, calibration: str | Path, out_dir: str | Path
                      ) -> dict[str, Any]:
    """The simulator with ``calibration`` on a measured run's workload and the server's KV pool: a run directory in
    ``out_dir``; returns its metrics (with the file's step noise: the median over ``compare.noise_draws`` draws,
    ``experiments.calibration.draws``)."""
    from experiments.calibration.draws import simulate_draws

    sim_cfg = with_calibration(measured_cfg(cfg, run_dir), calibration)
    return simulate_draws(apply_overrides(sim_cfg, ["output.plots=false"]), Path(out_dir))[0]
