"""The one run path: a config through its backend into a run directory; and `python -m experiments.run`.

``run(cfg, out_dir)`` is what every entry point (the CLI below, calibrate, compare, studies, the pipeline) runs a
config through, so every run directory holds the files of docs/outputs.md plus the resolved ``config.yaml``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from core.disagg import PDServingLoop
from core.host_tier import HostTierStats
from core.loop import RunResult, ServingLoop
from core.output import COMPLETE, INTERRUPTED, table_path, write_run
from experiments.build import MakeExecutors, build_loop, run_summary_options
from experiments.cli import hydra_app
from experiments.config import RunConfig
from experiments.overrides import with_backend
from sim.clock import run_virtual

log = logging.getLogger(__name__)

COMPARED_FILES = ("requests.csv", "tokens.csv")
# output.plots=auto draws the figures of runs with at most this many requests: drawing costs about 2 s whatever the
# run's size (matplotlib's import, layout and PNG encoding; long series are thinned), a lot next to a large run
PLOTS_AUTO_MAX_REQUESTS = 1000


def run(cfg: DictConfig | RunConfig, out_dir: str | Path, make_executors: MakeExecutors | None = None,
        backend_label: str | None = None) -> dict[str, Any]:
    """Run a config (parsed here unless it already is a ``RunConfig``; with executors from
    ``make_executors(replicas)`` when given) and write its run directory; returns the metrics. Engine steps are
    timed on the engine's stopwatch, sim steps by the cost model.

    A run stopped early (Ctrl-C, an error while it runs) still writes what it has: the requests that ended, as
    ``.partial`` files beside a metrics.json whose ``run_status`` is ``interrupted`` (``core.output.write_run``);
    then the exception propagates."""
    rc = cfg if isinstance(cfg, RunConfig) else RunConfig.from_config(cfg)
    loop = build_loop(rc, make_executors)
    t0 = time.perf_counter()
    try:
        result = run_virtual(loop, progress=rc.output.show_progress)
    except BaseException as e:
        partial = loop.result(time.perf_counter() - t0)
        ended = [st for st in partial.states if st.status.terminal]
        notes = "".join(f" ({n})" for n in getattr(e, "__notes__", ()))  # e.g. which plugin raised it
        note = {"error": f"{type(e).__name__}: {e}{notes}",  # num_unfinished: arrived but not ended
                "num_unfinished": len(partial.states) - len(ended)}
        with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
            write_run_dir(rc, RunResult(ended, partial.steps, partial.end_s, partial.wall_s,
                                        itl_pool=partial.itl_pool), out_dir,
                          backend_label, note, run_status=INTERRUPTED, plots=False, pd=pd_loop(loop))
        raise
    finally:
        for ex in loop.executors:  # the engine's tensor-parallel ranks
            getattr(ex, "close", lambda: None)()
    return finish_run(rc, loop, result, out_dir, backend_label)


def finish_run(run: RunConfig, loop: ServingLoop, result: RunResult, out_dir: str | Path,
               backend_label: str | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """How every finished run ends, whether it ran alone, interleaved with others or served over HTTP: refuse one
    that measured nothing, add the host-tier and PD sections, write the run directory; returns the metrics."""
    check_measured(run, result)
    sections = {**host_tier_metrics(run, loop), **cost_model_metrics(loop), **pipeline_metrics(loop, result),
                **(extra or {})}
    return write_run_dir(run, result, out_dir, backend_label, sections, pd=pd_loop(loop))


def cost_model_metrics(loop: ServingLoop) -> dict[str, Any]:
    """metrics.json's ``cost_model`` section: what a cost model with a ``coverage()`` reports (``sim.cost.profiled``:
    steps priced outside its tables; the replicas share one model); no key for the others. Logged when a step left
    a table's grid."""
    models = {id(cm): cm for ex in loop.executors if hasattr(cm := getattr(ex, "cost_model", None), "coverage")}
    if not models:
        return {}
    seen = [cm.coverage() for cm in models.values()]
    for c in seen:
        if c.get("beyond_grid"):
            log.info(f"{c['priced_steps']} steps priced, some beyond the profiled grid (scaled by the roofline "
                     f"from its edge): {c['beyond_grid']}")
    return {"cost_model": seen[0] if len(seen) == 1 else seen}


def pipeline_metrics(loop: ServingLoop, result: RunResult) -> dict[str, Any]:
    """metrics.json's ``pipeline`` section for pipeline-parallel replicas (``sim.pipeline``): per replica, each
    stage's busy and idle seconds over the run (the idle time is the bubble, with the idle gaps of a quiet
    replica) and the micro-batches' time waiting for a busy stage; no key without pipelines."""
    pipelines = list({id(p): p for ex in loop.executors if (p := getattr(ex, "pipeline", None)) is not None}.values())
    if not pipelines:
        return {}
    span = float(result.end_s)
    return {"pipeline": [{"stages": p.num_stages, "busy_s": p.busy_s, "idle_s": p.idle_s(span),
                          "bubble_fraction": [i / span if span else 0.0 for i in p.idle_s(span)],
                          "wait_s": p.wait_s} for p in pipelines]}


def pd_loop(loop: ServingLoop) -> PDServingLoop | None:
    """The loop of a ``cluster=pd`` run (its transfers go into the run files), else None."""
    return loop if isinstance(loop, PDServingLoop) else None


def host_tier_metrics(run: RunConfig, loop: ServingLoop) -> dict[str, Any]:
    """metrics.json's ``host_tier`` section, summed over replicas (``core.host_tier.HostTierStats.summary``);
    no key when the host tier is off, so runs without one keep their metrics.json."""
    tiers = [r.kv.host for r in loop.replicas if r.kv.host is not None]
    if not tiers:
        return {}
    total = HostTierStats()
    for tier in tiers:
        for f in fields(HostTierStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(tier.stats, f.name))
    per_block = run.kv_bytes_per_block
    # the steps' copy time, inside their durations: the engine measures it, the simulator prices it on the host link
    return {"host_tier": {"blocks_per_replica": tiers[0].num_blocks, "bytes_per_block": per_block,
                          **total.summary(per_block), "copy_s": sum(ex.copy_s for ex in loop.executors),
                          "copy_time": "measured" if run.measured else "priced"}}


def check_measured(run: RunConfig, result: RunResult) -> None:
    """Refuse a run whose requests were all warmup: every metric would be null. (Workloads that know their
    request count refuse it when built; this catches the ones bounded by time or by a trace.)"""
    if result.states and all(st.request.warmup for st in result.states):
        workload = run.config.workload
        key = next((k for k in ("warmup_requests", "warmup_sessions", "warmup_waves") if k in workload),
                   "warmup_requests")
        raise ValueError(f"workload.{key}={workload.get(key)!r}: all {len(result.states)} requests of the run are "
                         f"warmup, so nothing is measured; lower it below the number of requests")


def write_run_dir(run: RunConfig, result: RunResult, out_dir: str | Path, backend_label: str | None = None,
                  extra: Mapping[str, Any] | None = None, run_status: str = COMPLETE,
                  plots: bool | None = None, pd: PDServingLoop | None = None) -> dict[str, Any]:
    """Metrics, the run files of docs/outputs.md (plus outputs.jsonl for the engine), config.yaml and timing.json
    through ``core.output.write_run`` (atomic, metrics.json last, stale run files removed), then plots if enabled
    (``plots`` overrides ``output.plots``). metrics.json holds no wall-clock fact: timing.json has ``wall_s`` and
    ``sim_s_per_wall_s``. ``run_status``: ``complete``, or ``running`` / ``interrupted`` for partial results.
    ``pd``: a PD cluster's loop: metrics.json gets its ``pd`` section and requests.csv its transfer columns (a
    colocated run's files have neither)."""
    from core.metrics import summarize

    label = backend_label or run.backend
    options = run_summary_options(run)
    metrics = summarize(result.states, **options, itl_pool=result.itl_pool)
    metrics.update(backend=label, num_steps=len(result.steps), **(extra or {}))
    metrics["deployment"] = deployment_metrics(run, metrics.get("goodput_rps"))
    if pd is not None:
        metrics["pd"] = pd_metrics(run, pd)
    if label == "engine":
        metrics["engine_clock"] = run.engine_clock
    if parallel_columns(run):
        metrics["parallel"] = asdict(run.parallel)
    timing = {"wall_s": result.wall_s,
              "sim_s_per_wall_s": result.end_s / result.wall_s if result.wall_s > 0 else None}
    files: dict[str, str] = {"config.yaml": config_yaml(run.config)}
    if run.engine is not None:
        from engine.outputs import outputs_jsonl

        files["outputs.jsonl"] = outputs_jsonl(result.states, run.model, run.seed)
    out = Path(out_dir)
    write_run(out, result.states, result.steps, metrics, files, timing=timing, run_status=run_status,
              file_format=run.output.format, tokens=run.output.tokens,
              extra_request_columns=pd.request_columns() if pd is not None else None,
              extra_step_columns=parallel_columns(run))
    draw = run.output.plots if plots is None else plots
    if draw == "auto":
        draw = len(result.states) <= PLOTS_AUTO_MAX_REQUESTS
    if draw and run_status == COMPLETE:
        from experiments import plots as plotting

        plotting.plot_run(out)
    return metrics


def parallel_columns(run: RunConfig) -> dict[str, int] | None:
    """steps.csv's ``tp`` and ``ep`` columns (and metrics.json's ``parallel`` section) of a run over several
    tensor- or expert-parallel ranks; none for one device, whose files stay as they were."""
    p = run.parallel
    return {"tp": p.tp, "ep": p.ep} if p.tp * p.ep > 1 else None


def deployment_metrics(run: RunConfig, goodput_rps: float | None) -> dict[str, Any]:
    """metrics.json's ``deployment`` section: the devices the run's replicas take (tp x pp x dp each), the price of
    one device-hour (``hardware.price_per_hour``; 0: unknown), goodput per device and requests within the SLO per
    dollar (goodput x 3600 / (devices x price); null without a price): what the deployment search ranks."""
    devices = run.parallel.devices * run.cluster.num_replicas
    price = run.hardware.price_per_hour
    good = goodput_rps or 0.0
    return {"parallel": asdict(run.parallel), "replicas": run.cluster.num_replicas, "devices": devices,
            "price_per_hour": price, "goodput_rps_per_device": good / devices,
            "goodput_per_dollar": good * 3600 / (devices * price) if price > 0 else None}


def pd_metrics(run: RunConfig, loop: PDServingLoop) -> dict[str, Any]:
    """metrics.json's ``pd`` section: transfer time, KV wait and link wait percentiles, what moved, and how transfer
    times were obtained (the simulator's link, or the engine's measured copies)."""
    out = loop.metrics(run.metrics.percentile_method, kv_bytes_per_token=run.kv_bytes_per_token)
    out["transfer_timing"] = "measured" if run.measured else "link"
    out["link"] = None if run.measured else {"name": run.cluster.link_name, **asdict(run.cluster.link)}
    out["placement"] = run.config.placement.get("_target_")
    return out


def config_yaml(cfg: DictConfig) -> str:
    try:
        return OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # an unresolvable key (e.g. ``???``) still leaves a readable record
        return OmegaConf.to_yaml(cfg)


def save_config(cfg: DictConfig, out_dir: Path) -> None:
    (out_dir / "config.yaml").write_text(config_yaml(cfg))


def replay(cfg: DictConfig, recording: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Simulate ``cfg`` with the step durations recorded in ``recording`` (a run directory); raises
    ``ReplayDivergence`` at the first step whose batch differs from the recording."""
    from sim.replay import replay_executors

    return run(with_backend(cfg, "sim"), out_dir, lambda reps: replay_executors(recording, len(reps)), "replay")


def same_files(a: str | Path, b: str | Path, names: Sequence[str] = COMPARED_FILES) -> dict[str, bool]:
    """Byte equality of two runs' files; a .csv name compares the .parquet files of runs written as Parquet."""
    return {n: table_path(Path(a) / n).read_bytes() == table_path(Path(b) / n).read_bytes() for n in names}


@hydra_app("config")
def main(cfg: DictConfig) -> float | None:
    out_dir = HydraConfig.get().runtime.output_dir
    if cfg.get("gpus") is not None:  # a deployment search trial (conf/sweep/deployment.yaml)
        cfg = fill_replicas(cfg)
        skipped = off_budget(cfg)
        if skipped:  # its directory says why, so a report does not take it for a job that died
            log.info(f"deployment search: {skipped}; objective 0")
            (Path(out_dir) / "metrics.json").write_text(json.dumps(
                {"run_status": "failed", "error": f"deployment search trial not run ({skipped}); objective 0"},
                sort_keys=True) + "\n")
            return 0.0
    metrics = run(cfg, out_dir)
    keys = ("backend", "num_requests", "num_completed", "num_rejected", "num_timed_out", "goodput_rps",
            "slo_attainment", "throughput_tok_s", "request_hit_rate")
    log.info(json.dumps({k: metrics.get(k) for k in keys}))
    ttft = metrics["ttft_s"]
    log.info(f"ttft p50/p90/p99 s: {ttft['p50']} / {ttft['p90']} / {ttft['p99']}")
    log.info(f"wrote {out_dir}")
    return objective(cfg, metrics)


def fill_replicas(cfg: DictConfig) -> DictConfig:
    """``replicas=auto`` in a deployment search: as many replicas as ``gpus`` holds (gpus / (tp x pp x dp)); left
    as is when that does not divide (``off_budget`` then refuses the trial)."""
    if str(cfg.get("replicas")) != "auto":
        return cfg
    par = cfg.parallel
    per = int(par.tp) * int(par.pp) * int(par.dp)
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.replicas = int(cfg.gpus) // per if int(cfg.gpus) % per == 0 else 0
    return cfg


def off_budget(cfg: DictConfig) -> str | None:
    """Why a deployment-search trial is not a deployment of exactly ``gpus`` devices (replicas x tp x pp x dp), or
    cannot be built (heads, experts, memory): the trial then scores 0 without running. None: run it."""
    try:
        rc = RunConfig.from_config(cfg)
    except ValueError as e:
        return str(e)
    devices = rc.parallel.devices * rc.cluster.num_replicas
    if devices != int(cfg.gpus):
        return f"{devices} devices, not gpus={cfg.gpus}"
    return "parallel.pp > 1 with parallel.dp > 1 is not simulated" if rc.parallel.pp > 1 < rc.parallel.dp else None


def objective(cfg: DictConfig, metrics: Mapping[str, Any]) -> float | None:
    """The task function's return value, which a Hydra sweeper optimises (the Optuna search, conf/sweep/search.yaml):
    the metric the ``objective`` key names, a dotted metrics.json key (``slo_attainment``, ``ttft_s.p90``); without
    the key, goodput under the SLO (``goodput_rps``). None where the run has no value for it (an Optuna trial
    that returns None fails)."""
    key = str(cfg.get("objective") or "goodput_rps")
    v: Any = metrics
    for part in key.split("."):
        if not isinstance(v, Mapping) or part not in v:
            raise ValueError(f"objective={key}: not a key of metrics.json (e.g. goodput_rps, slo_attainment, "
                             f"throughput_tok_s, ttft_s.p90)")
        v = v[part]
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
        raise ValueError(f"objective={key}: not a number in metrics.json ({type(v).__name__}); name one value, "
                         f"e.g. ttft_s.p90")
    return None if v is None else float(v)


if __name__ == "__main__":
    main()
