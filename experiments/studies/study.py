"""`python -m experiments.study study=NAME`: one ready-made serving study, end to end (docs/studies.md).

``conf/study/NAME.yaml`` sets the run config (model, workload, ...) and a ``study:`` section; the module
``experiments.studies.NAME`` runs its variants into subdirectories and writes figures and ``summary.md``
into the output directory. ``study.scale=tiny`` runs a seconds-long version; ``study.engine=true`` adds
CPU-scale runs on the real engine (and the simulator at the same scale) where the study supports it.
``study.seeds=[0,1,2]`` repeats every run once per seed: tables print the mean and its 95% interval, figures draw
bands or error bars (experiments.studies.common; default: the run's ``seed`` alone).
"""

from __future__ import annotations

import importlib
import logging
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.checks import check_choice
from experiments.build import CONF_DIR
from experiments.cli import hydra_app
from experiments.run import save_config
from experiments.studies.common import scaled

log = logging.getLogger(__name__)


def studies() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "study").glob("*.yaml"))


def run_study(cfg: DictConfig, out_dir: str | Path) -> Path:
    """Run the study ``cfg.study.name`` into ``out_dir``; returns the path of its summary.md."""
    node = cfg.get("study")
    if node is None:
        raise ValueError(f"study=NAME is required; allowed: {studies()}")
    name = node.get("name")
    check_choice(name, "study.name", studies())
    given = {o.partition("=")[0].lstrip("+~") for o in HydraConfig.get().overrides.task} \
        if HydraConfig.initialized() else set()
    cfg = scaled(cfg, given)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out)
    t0 = time.perf_counter()
    report = importlib.import_module(f"experiments.studies.{name}").run(cfg, out)
    wall = time.perf_counter() - t0
    seeds = ",".join(str(s) for s in cfg.study.get("seeds") or [])
    header = [f"`python -m experiments.study study={name} study.scale={cfg.study.scale}"
              f"{' study.engine=true' if cfg.study.get('engine') else ''}"
              f"{f' study.seeds=[{seeds}]' if len(cfg.study.get('seeds') or []) > 1 else ''}` "
              f"(full config: `config.yaml`; every run in its subdirectory; wall time {wall:.1f} s). "
              f"Percentiles: {cfg.metrics.percentile_method}.", ""]
    return report.write(out, header)


@hydra_app("study")
def main(cfg: DictConfig) -> None:
    path = run_study(cfg, HydraConfig.get().runtime.output_dir)
    log.info(path.read_text())
    log.info(f"wrote {path}")


if __name__ == "__main__":
    main()
