"""The one run path: a config through its backend (or given executors, e.g. a replay), written as a run directory.

Every entry point (``experiments.run``, calibrate, compare, studies, the pipeline) runs configs through ``run``,
so every run directory holds the DESIGN section 8 files plus the resolved ``config.yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.loop import RunResult
from experiments.build import MakeExecutors, build_loop, engine_clock, metrics_options, model_spec, progress_bar
from experiments.overrides import with_backend
from sim.clock import simulate

COMPARED_FILES = ("requests.csv", "tokens.csv")


def run(cfg: DictConfig, out_dir: str | Path, make_executors: MakeExecutors | None = None,
        backend_label: str | None = None) -> dict[str, Any]:
    """Run ``cfg`` (with executors from ``make_executors(replicas)`` when given) and write its run directory;
    returns the metrics. Engine steps are timed on the ``engine_clock`` stopwatch, sim steps by the cost model."""
    loop = build_loop(cfg, make_executors)
    result = simulate(loop, progress=progress_bar(cfg.output.progress))
    return write_run_dir(cfg, result, out_dir, backend_label)


def write_run_dir(cfg: DictConfig, result: RunResult, out_dir: str | Path, backend_label: str | None = None,
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Metrics, the DESIGN section 8 files (plus outputs.jsonl for the engine, plots if enabled) and config.yaml."""
    from core.metrics import summarize
    from core.output import write_run

    spec = model_spec(cfg)
    label = backend_label or cfg.backend.name
    metrics = summarize(result.states, **metrics_options(cfg, spec))
    metrics.update(backend=label, wall_s=result.wall_s, num_steps=len(result.steps),
                   sim_s_per_wall_s=result.end_s / result.wall_s if result.wall_s > 0 else None, **(extra or {}))
    if label == "engine":
        metrics["engine_clock"] = engine_clock(cfg)
    out = Path(out_dir)
    write_run(out, result.states, result.steps, metrics)
    if cfg.backend.name == "engine":
        from engine.outputs import write_outputs

        write_outputs(out / "outputs.jsonl", result.states, spec, int(cfg.seed))
    if cfg.output.plots:
        from experiments import plots

        plots.plot_run(out)
    save_config(cfg, out)
    return metrics


def save_config(cfg: DictConfig, out_dir: Path) -> None:
    try:
        text = OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # an unresolvable key (e.g. ``???``) still leaves a readable record
        text = OmegaConf.to_yaml(cfg)
    (out_dir / "config.yaml").write_text(text)


def replay(cfg: DictConfig, recording: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Simulate ``cfg`` with the step durations recorded in ``recording`` (a run directory); raises
    ``ReplayDivergence`` at the first step whose batch differs from the recording."""
    from sim.replay import replay_executors

    return run(with_backend(cfg, "sim"), out_dir, lambda reps: replay_executors(recording, len(reps)), "replay")


def same_files(a: str | Path, b: str | Path, names: Sequence[str] = COMPARED_FILES) -> dict[str, bool]:
    return {n: (Path(a) / n).read_bytes() == (Path(b) / n).read_bytes() for n in names}
