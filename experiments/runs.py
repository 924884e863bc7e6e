"""The one run path: a config through its backend (or given executors, e.g. a replay), written as a run directory.

Every entry point (``experiments.run``, calibrate, compare, studies, the pipeline) runs configs through ``run``,
so every run directory holds the DESIGN section 8 files plus the resolved ``config.yaml``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core import arithmetic
from core.disagg import PDServingLoop
from core.host_tier import HostTierStats
from core.loop import RunResult, ServingLoop
from core.output import COMPLETE, INTERRUPTED, check_output_options, table_path, write_run
from experiments.build import (
    MakeExecutors,
    build_loop,
    engine_clock,
    kv_bits,
    link,
    metrics_options,
    model_spec,
    progress_bar,
    stored_spec,
)
from experiments.overrides import with_backend
from sim.clock import simulate

log = logging.getLogger(__name__)

COMPARED_FILES = ("requests.csv", "tokens.csv")
# output.plots=auto draws the figures of runs with at most this many requests: drawing costs about 2 s whatever the
# run's size (matplotlib's import, layout and PNG encoding; long series are thinned), a lot next to a large run
PLOTS_AUTO_MAX_REQUESTS = 1000


def run(cfg: DictConfig, out_dir: str | Path, make_executors: MakeExecutors | None = None,
        backend_label: str | None = None) -> dict[str, Any]:
    """Run ``cfg`` (with executors from ``make_executors(replicas)`` when given) and write its run directory;
    returns the metrics. Engine steps are timed on the ``engine_clock`` stopwatch, sim steps by the cost model.

    A run stopped early (Ctrl-C, an error while it runs) still writes what it has: the requests that ended, as
    ``.partial`` files beside a metrics.json whose ``run_status`` is ``interrupted`` (``core.output.write_run``);
    then the exception propagates."""
    metrics_options(cfg, model_spec(cfg))  # its checks fail now, not after the run
    output_options(cfg)
    loop = build_loop(cfg, make_executors)
    progress = progress_bar(cfg.output.progress)
    t0 = time.perf_counter()
    try:
        result = simulate(loop, progress=progress)
    except BaseException as e:
        partial = loop.result(time.perf_counter() - t0)
        ended = [st for st in partial.states if st.status.terminal]
        note = {"error": f"{type(e).__name__}: {e}",  # num_unfinished: arrived but not ended
                "num_unfinished": len(partial.states) - len(ended)}
        with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
            write_run_dir(cfg, RunResult(ended, partial.steps, partial.end_s, partial.wall_s,
                                         itl_pool=partial.itl_pool), out_dir,
                          backend_label, note, run_status=INTERRUPTED, plots=False, pd=pd_loop(loop))
        raise
    check_measured(cfg, result)
    return write_run_dir(cfg, result, out_dir, backend_label,
                         {**host_tier_metrics(cfg, loop), **cost_model_metrics(loop)}, pd=pd_loop(loop))


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


def pd_loop(loop: ServingLoop) -> PDServingLoop | None:
    """The loop of a ``cluster=pd`` run (its transfers go into the run files), else None."""
    return loop if isinstance(loop, PDServingLoop) else None


def host_tier_metrics(cfg: DictConfig, loop: ServingLoop) -> dict[str, Any]:
    """metrics.json's ``host_tier`` section, summed over replicas (``core.host_tier.HostTierStats.summary``);
    no key when the host tier is off, so runs without one keep their metrics.json."""
    tiers = [r.kv.host for r in loop.replicas if r.kv.host is not None]
    if not tiers:
        return {}
    total = HostTierStats()
    for tier in tiers:
        for f in fields(HostTierStats):
            setattr(total, f.name, getattr(total, f.name) + getattr(tier.stats, f.name))
    per_block = arithmetic.kv_bytes_per_block(stored_spec(cfg, model_spec(cfg)), tiers[0].block_size, kv_bits(cfg))
    # the steps' copy time, inside their durations: the engine measures it, the simulator prices it on the host link
    copy_s = sum(getattr(ex, "copy_s", 0.0) for ex in loop.executors)
    return {"host_tier": {"blocks_per_replica": tiers[0].num_blocks, "bytes_per_block": per_block,
                          **total.summary(per_block), "copy_s": copy_s,
                          "copy_time": "measured" if cfg.backend.name == "engine" else "priced"}}


def check_measured(cfg: DictConfig, result: RunResult) -> None:
    """Refuse a run whose requests were all warmup: every metric would be null. (Workloads that know their
    request count refuse it when built; this catches the ones bounded by time or by a trace.)"""
    if result.states and all(st.request.warmup for st in result.states):
        key = next((k for k in ("warmup_requests", "warmup_sessions", "warmup_waves") if k in cfg.workload),
                   "warmup_requests")
        raise ValueError(f"workload.{key}={cfg.workload[key]!r}: all {len(result.states)} requests of the run are "
                         f"warmup, so nothing is measured; lower it below the number of requests")


def write_run_dir(cfg: DictConfig, result: RunResult, out_dir: str | Path, backend_label: str | None = None,
                  extra: Mapping[str, Any] | None = None, run_status: str = COMPLETE,
                  plots: bool | None = None, pd: PDServingLoop | None = None) -> dict[str, Any]:
    """Metrics, the DESIGN section 8 files (plus outputs.jsonl for the engine), config.yaml and timing.json
    through ``core.output.write_run`` (atomic, metrics.json last, stale run files removed), then plots if enabled
    (``plots`` overrides ``output.plots``). metrics.json holds no wall-clock fact: timing.json has ``wall_s`` and
    ``sim_s_per_wall_s``. ``run_status``: ``complete``, or ``running`` / ``interrupted`` for partial results.
    ``pd``: a PD cluster's loop: metrics.json gets its ``pd`` section and requests.csv its transfer columns (a
    colocated run's files have neither)."""
    from core.metrics import summarize

    spec = model_spec(cfg)
    label = backend_label or cfg.backend.name
    options = metrics_options(cfg, spec)
    metrics = summarize(result.states, **options, itl_pool=result.itl_pool)
    metrics.update(backend=label, num_steps=len(result.steps), **(extra or {}))
    if pd is not None:
        metrics["pd"] = pd_metrics(cfg, pd, options["percentile_method"])
    if label == "engine":
        metrics["engine_clock"] = engine_clock(cfg)
    timing = {"wall_s": result.wall_s,
              "sim_s_per_wall_s": result.end_s / result.wall_s if result.wall_s > 0 else None}
    files: dict[str, str] = {"config.yaml": config_yaml(cfg)}
    if cfg.backend.name == "engine":
        from engine.outputs import outputs_jsonl

        files["outputs.jsonl"] = outputs_jsonl(result.states, spec, int(cfg.seed))
    out = Path(out_dir)
    opts = output_options(cfg)
    write_run(out, result.states, result.steps, metrics, files, timing=timing, run_status=run_status,
              file_format=opts["format"], tokens=opts["tokens"],
              extra_request_columns=pd.request_columns() if pd is not None else None)
    draw = opts["plots"] if plots is None else plots
    if draw == "auto":
        draw = len(result.states) <= PLOTS_AUTO_MAX_REQUESTS
    if draw and run_status == COMPLETE:
        from experiments import plots as plotting

        plotting.plot_run(out)
    return metrics


def pd_metrics(cfg: DictConfig, loop: PDServingLoop, method: str) -> dict[str, Any]:
    """metrics.json's ``pd`` section: transfer time, KV wait and link wait percentiles, what moved, and how transfer
    times were obtained (the simulator's link, or the engine's measured copies)."""
    spec = stored_spec(cfg, model_spec(cfg))
    out = loop.metrics(method, kv_bytes_per_token=arithmetic.kv_bytes_per_token(spec, kv_bits(cfg)))
    measured = cfg.backend.name == "engine"
    out["transfer_timing"] = "measured" if measured else "link"
    out["link"] = None if measured else {"name": cfg.cluster.get("link"), **asdict(link(cfg))}
    out["placement"] = cfg.placement.get("_target_")
    return out


def output_options(cfg: DictConfig) -> dict[str, Any]:
    """The ``output`` section, checked: ``format`` (csv | parquet), ``tokens`` (all | none), ``plots`` (auto |
    true | false). A config without the newer keys gets their defaults (csv, all, auto)."""
    out = cfg.get("output") or {}
    file_format, tokens = check_output_options(out.get("format", "csv"), out.get("tokens", "all"))
    plots = out.get("plots", "auto")
    if not isinstance(plots, bool) and plots != "auto":
        raise ValueError(f"output.plots={plots!r}; allowed: auto, true or false")
    return {"format": file_format, "tokens": tokens, "plots": plots}


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
