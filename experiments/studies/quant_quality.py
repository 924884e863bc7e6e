"""`python -m experiments.quant_quality`: the quality gate of W4A16 weights and int8 KV (engine.quality) on one
model; writes ``quality.json`` into the Hydra run directory and prints a table. Config: conf/quant_study.yaml.

    python -m experiments.quant_quality                                   # the tiny random-weight model
    python -m experiments.quant_quality model.path=/ckpt/Qwen2-0.5B quant_group_size=128 \\
        quality.prompts_file=prompts.json quant_settings=[w4a16]            # a real checkpoint, real text
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from core.checks import check_keys
from core.specs import ModelSpec
from engine.executor import resolve_kernels
from engine.quality import QualityReport, QuantSetting, load_prompts, quality_report, synthetic_prompts
from experiments.cli import hydra_app
from experiments.config import RunConfig

log = logging.getLogger(__name__)

GROUP_CANDIDATES = (128, 64, 32, 16)  # multiples of 16: what the Triton W4A16 GEMM accepts
QUALITY_KEYS = ("num_prompts", "prompt_len", "new_tokens", "prompts_file", "seed")
# quick=true: a smoke-test size for every section of conf/quant_study.yaml
QUICK = {"quality": {"num_prompts": 2, "prompt_len": 8, "new_tokens": 4},
         "study": {"batch_sizes": [1, 4], "batch_context": 32, "contexts": [16, 64], "context_batch": 2,
                   "repeats": 2, "warmup": 1, "capacity_contexts": [64]}}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def effective(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the QUICK sizes merged in when ``quick`` is set."""
    return OmegaConf.merge(cfg, QUICK) if cfg.get("quick", False) else cfg


def projection_input_dims(spec: ModelSpec) -> tuple[int, ...]:
    """K of every quantised projection: qkv / gate_up read hidden_size, o_proj H·Dh, down_proj the FFN width."""
    return spec.hidden_size, spec.num_heads * spec.head_dim, spec.intermediate_size


def resolve_group_size(spec: ModelSpec, group_size: Any) -> int:
    """``quant_group_size``, checked against the model; None picks the largest GROUP_CANDIDATES entry that fits."""
    dims = projection_input_dims(spec)
    if group_size is None:
        for g in GROUP_CANDIDATES:
            if all(k % g == 0 for k in dims):
                return g
        raise ValueError(f"quant_group_size=null: none of {list(GROUP_CANDIDATES)} divides the projection input "
                         f"dims {dims} of {spec.name}; set quant_group_size explicitly")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2 \
            or any(k % group_size for k in dims):
        raise ValueError(f"quant_group_size={group_size!r}; allowed: null or an even integer dividing {dims}")
    return group_size


def settings(cfg: DictConfig, group_size: int) -> list[QuantSetting]:
    names = list(cfg.quant_settings or [])
    if not names:
        raise ValueError("quant_settings is empty; allowed: a list of w4a16, kv_int8, w4a16+kv_int8")
    return [QuantSetting.parse(n, group_size) for n in names]


def prompts(cfg: DictConfig, spec: ModelSpec) -> list[list[int]]:
    q = OmegaConf.to_container(cfg.quality, resolve=True)
    check_keys("quality", q, QUALITY_KEYS)
    if q.get("prompts_file"):
        return load_prompts(q["prompts_file"], spec.path)
    return synthetic_prompts(spec.vocab_size, int(q["num_prompts"]), int(q["prompt_len"]), int(q["seed"]))


def run_quality(cfg: DictConfig) -> QualityReport:
    cfg = effective(cfg)
    run = RunConfig.from_config(cfg)
    spec, device = run.model, run.engine.device  # the model in the dtype it runs in (backend.dtype)
    group = resolve_group_size(spec, cfg.get("quant_group_size"))
    return quality_report(spec, prompts(cfg, spec), settings(cfg, group), new_tokens=int(cfg.quality.new_tokens),
                          seed=run.seed, dtype=DTYPES[spec.dtype], device=device,
                          kernels=resolve_kernels(run.engine.kernels, device), block_size=run.kv.block_size)


def write(report: QualityReport, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return report.write(out / "quality.json")


@hydra_app("quant_study")
def main(cfg: DictConfig) -> None:
    if cfg.backend.get("num_threads"):
        torch.set_num_threads(int(cfg.backend.num_threads))
    report = run_quality(cfg)
    path = write(report, HydraConfig.get().runtime.output_dir)
    log.info(report.format_table())
    log.info(f"wrote {path.resolve()}")


if __name__ == "__main__":
    main()
