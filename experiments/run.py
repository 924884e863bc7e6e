"""`python -m experiments.run`: one workload through one backend (sim or engine); writes the run directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from experiments.build import CONF_DIR
from experiments.cli import user_errors
from experiments.runs import run


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
@user_errors
def _main(cfg: DictConfig) -> float | None:
    out_dir = HydraConfig.get().runtime.output_dir
    metrics = run(cfg, out_dir)
    keys = ("backend", "num_requests", "num_completed", "num_rejected", "num_timed_out", "goodput_rps",
            "slo_attainment", "throughput_tok_s", "request_hit_rate")
    print(json.dumps({k: metrics.get(k) for k in keys}))
    print(f"ttft p50/p90/p99 s: {metrics['ttft_s']['p50']} / {metrics['ttft_s']['p90']} / {metrics['ttft_s']['p99']}")
    print(f"wrote {out_dir}")
    return metrics.get("goodput_rps")  # the value a Hydra sweeper optimises


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
