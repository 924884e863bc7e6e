"""`python -m experiments.run`: one workload through one backend (sim or engine); writes the run directory."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.build import CONF_DIR
from experiments.cli import user_errors
from experiments.runs import run

log = logging.getLogger(__name__)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def _main(cfg: DictConfig) -> float | None:
    out_dir = HydraConfig.get().runtime.output_dir
    metrics = run(cfg, out_dir)
    keys = ("backend", "num_requests", "num_completed", "num_rejected", "num_timed_out", "goodput_rps",
            "slo_attainment", "throughput_tok_s", "request_hit_rate")
    log.info(json.dumps({k: metrics.get(k) for k in keys}))
    ttft = metrics["ttft_s"]
    log.info(f"ttft p50/p90/p99 s: {ttft['p50']} / {ttft['p90']} / {ttft['p99']}")
    log.info(f"wrote {out_dir}")
    return objective(cfg, metrics)


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


def checkpoint_paths_to_overrides(argv: list[str]) -> list[str]:
    """Let ``model=DIR`` name a Hugging Face checkpoint directory: it becomes ``model.path=DIR`` (the shapes
    then come from DIR/config.json), since a Hydra group option cannot be a path."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "model" and (Path(value) / "config.json").is_file():
            arg = f"model.path={Path(value).resolve()}"
        elif key == "model" and ("/" in value or Path(value).exists()):
            raise SystemExit(f"model={value}: not a checkpoint directory (no config.json there); "
                             f"a model option is one of conf/model/*.yaml or a directory holding config.json")
        out.append(arg)
    return out


def main() -> None:
    sys.argv[1:] = checkpoint_paths_to_overrides(sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
