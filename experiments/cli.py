"""The command line: every entry point's Hydra app (``hydra_app``) and the ``twinserve <command>`` console script.

``@hydra_app("config")`` makes a task function a Hydra app on ``conf/<name>.yaml`` with what every entry point
shares: ``model=DIR`` (or ``model.path=DIR``) naming a checkpoint directory, and user errors as one line. A config
or input error raised while the task runs (``ValueError``, which ``core.checks`` raises naming the key; an OmegaConf
error on a missing or unresolvable key; a missing file) is printed as ``error: <message>`` on stderr and the process
exits with ``EXIT_USER_ERROR``, with no traceback. ``HYDRA_FULL_ERROR=1`` keeps Hydra's own handling (the full
traceback). Hydra already prints its composition errors (an unknown group option, a key that does not exist, a value
of the wrong type) in a few lines without a traceback.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from experiments.config import CONF_DIR

EXIT_USER_ERROR = 2
USER_ERRORS = (ValueError, OmegaConfBaseException, FileNotFoundError)

# ``twinserve <command>`` -> the module whose main() runs it (each is also ``python -m experiments.<command>``)
COMMANDS = {
    "run": "experiments.run", "estimate": "experiments.estimate",
    "serve": "experiments.serving.serve", "loadgen": "experiments.serving.loadgen.run",
    "recover": "experiments.serving.recover",
    "gateway": "experiments.serving.gateway.main",
    "calibrate": "experiments.calibration.calibrate", "compare": "experiments.calibration.compare",
    "pipeline": "experiments.calibration.pipeline", "published": "experiments.calibration.published",
    "op_errors": "experiments.calibration.op_errors", "step_breakdown": "experiments.calibration.breakdown",
    "fidelity": "experiments.calibration.fidelity",
    "study": "experiments.studies.study", "capacity": "experiments.studies.capacity",
    "quant_study": "experiments.studies.quant_study", "quant_quality": "experiments.studies.quant_quality",
    "sweep_report": "experiments.studies.sweep_report",
    "bench_sim": "experiments.benchmarks.sim", "bench_engine": "experiments.benchmarks.engine",
    "bench_moe": "experiments.benchmarks.moe", "bench_tp": "experiments.benchmarks.tp",
    "bench_gpu": "experiments.benchmarks.gpu", "bench_serve": "experiments.benchmarks.serve",
    "bench_loadgen": "experiments.benchmarks.loadgen", "bench_soak": "experiments.benchmarks.soak",
    "gpu_check": "experiments.benchmarks.gpu_check",
    "bench_gateway": "experiments.benchmarks.gateway",
    "tiny_checkpoint": "experiments.benchmarks.tiny_checkpoint", "fake_openai": "experiments.serving.fake_openai",
}


def full_error() -> bool:
    """``HYDRA_FULL_ERROR=1``: show the full traceback instead of one line."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message with newlines folded (an OmegaConf message adds ``full_key: ...``)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


class JobFailed(Exception):
    """A multirun job's user error, re-raised as one line for Hydra's report at the end of the sweep."""


def user_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task function: a user error becomes one line on stderr and exit code 2 (see the module)."""

    @functools.wraps(task)  # Hydra unwraps __wrapped__ to find the calling module and its config path
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except USER_ERRORS as e:
            if full_error():
                raise
            if multirun_job_failed(e):  # the launcher records the job as failed and runs the others
                raise JobFailed(one_line(e)) from None
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None

    return wrapper


def multirun_job_failed(error: BaseException) -> bool:
    """In a job of a Hydra multirun: log ``error`` as one line (console and the job's run.log) and leave a
    metrics.json with ``run_status: failed`` and the error in the job's directory unless the run wrote one, so the
    sweep report names the job and why; True. A ``SystemExit`` there would end the whole sweep and lose the other
    jobs. False outside a multirun."""
    import json
    import logging

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return False
    hc = HydraConfig.get()
    message = one_line(error)
    logging.getLogger(__name__).error(f"job {hc.job.num} failed ({' '.join(hc.overrides.task)}): {message}")
    metrics = Path(hc.runtime.output_dir) / "metrics.json"
    if not metrics.is_file():
        metrics.write_text(json.dumps({"run_status": "failed", "error": message}, sort_keys=True) + "\n")
    return True


def checkpoint_paths_to_overrides(argv: list[str]) -> list[str]:
    """``model=DIR`` and ``model.path=DIR`` naming a Hugging Face checkpoint directory both become ``model=checkpoint
    model.path=DIR`` (``conf/model/checkpoint.yaml``: shapes and dtype from DIR/config.json), since a Hydra group
    option cannot be a path. ``model.path=DIR`` beside another ``model=`` option keeps that option."""
    keys = [arg.partition("=")[0] for arg in argv]
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in ("model", "model.path") and (Path(value) / "config.json").is_file():
            if key == "model" or "model" not in keys:
                out.append("model=checkpoint")
            arg = f"model.path={Path(value).resolve()}"
        elif key == "model" and ("/" in value or Path(value).exists()):
            raise SystemExit(f"model={value}: not a checkpoint directory (no config.json there); "
                             f"a model option is one of conf/model/*.yaml or a directory holding config.json")
        out.append(arg)
    return out


def hydra_app(config_name: str) -> Callable[[Callable[[DictConfig], Any]], Callable[..., Any]]:
    """Decorate ``task(cfg)`` into the entry point ``main()``: a Hydra app on ``conf/<config_name>.yaml`` (an
    absolute config path, so it runs as ``python -m``, as ``twinserve <command>`` and from any directory) with
    checkpoint directories and one-line user errors. ``main(cfg)`` runs the task on a composed config."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable[..., Any]:
        import hydra

        app = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(user_errors(task))

        @functools.wraps(task)
        def main(cfg: DictConfig | None = None) -> Any:
            if cfg is not None:
                return task(cfg)
            sys.argv[1:] = checkpoint_paths_to_overrides(sys.argv[1:])
            return app()

        return main

    return decorate


def twinserve(argv: list[str] | None = None) -> Any:
    """``twinserve <command> [args]``: the commands of ``COMMANDS``, each with its own arguments (``--help``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = ", ".join(COMMANDS)
        print(f"usage: twinserve <command> [args]; commands: {known}", file=sys.stderr if argv else sys.stdout)
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) and not argv[1:] else EXIT_USER_ERROR
    command, rest = argv[0], argv[1:]
    sys.argv = [f"twinserve {command}", *rest]
    result = importlib.import_module(COMMANDS[command]).main()
    return result if isinstance(result, int) else None  # an exit status (gpu_check); other results are printed
