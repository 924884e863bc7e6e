"""Per-operator error of the roofline against published linear-layer and MoE profiles, by tensor-parallel degree.

    python -m experiments.op_errors [--out DIR]

- Vidur (``gpu-measurements/vidur/<gpu>/<model>/mlp.csv``: one layer's operators on one TP shard, ms, at TP 1, 2,
  4 and 8): ``attn_pre_proj`` (QKV), ``attn_post_proj`` (o), ``mlp_up_proj`` (gate + up), ``mlp_down_proj``, their
  shapes from the file's own columns, split over ``num_tensor_parallel_workers``.
- LLMServingSim (``gpu-measurements/llmservingsim/<GPU>/<org>/<model>/bf16/tp<N>/``, µs, vLLM 0.19): ``qkv_proj``,
  ``o_proj``, ``gate_up_proj``, ``down_proj`` of ``dense.csv`` at TP 1 and 2 (the ``tp2`` rows are the half-shape
  shard, docs/calibration.md), and ``moe.csv`` (Qwen3-30B-A3B: T tokens over ``activated_experts`` distinct experts,
  TP 1): the roofline's ``moe`` group with those experts' weights streamed and T·k expert-token pairs computed.

Each operator is priced as the roofline prices it (``sim.cost.roofline``): max(2·weights·T / (peak·compute_eff),
(weights + T·(in + out) activations) bytes / (bandwidth·bw_eff)), with the default efficiencies, no overhead.
Rows: one per (source, GPU, model, TP, operator): points, median and p90 of |predicted / measured − 1|, and the
median signed error (bias).
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from core import arithmetic as ar
from core.specs import HardwareSpec, ModelSpec
from experiments.calibration.published import conf_specs
from experiments.config import shared_data

COMPUTE_EFF, BW_EFF = 0.7, 0.75  # the roofline's defaults (conf/cost_model/roofline.yaml)
VIDUR = {"a100": "a100", "h100": "h100"}  # folder -> conf/hardware
LLMSERVINGSIM = {"RTXPRO6000": "rtxpro6000", "RTX4090": "rtx4090"}
DENSE_OPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
VIDUR_OPS = {"attn_pre_proj": "qkv_proj", "attn_post_proj": "o_proj", "mlp_up_proj": "gate_up_proj",
             "mlp_down_proj": "down_proj"}


@dataclass(frozen=True)
class OpError:
    source: str
    gpu: str
    model: str
    tp: int
    op: str
    points: int
    median_abs: float
    p90_abs: float
    median_signed: float


def linear_shape(m: ModelSpec, op: str, tp: int) -> tuple[int, int]:
    """(input width, output width) of one TP shard of a linear operator (column-parallel QKV and gate/up, row-parallel
    o and down)."""
    d, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    return {"qkv_proj": (d, (q + 2 * kv) // tp), "o_proj": (q // tp, d), "gate_up_proj": (d, 2 * f // tp),
            "down_proj": (f // tp, d)}[op]


def linear_seconds(hw: HardwareSpec, width_in: int, width_out: int, tokens: int, dtype_bytes: int = 2) -> float:
    weights = width_in * width_out
    flops = 2.0 * weights * tokens
    nbytes = (weights + tokens * (width_in + width_out)) * dtype_bytes
    return max(flops / (hw.peak_flops * COMPUTE_EFF), nbytes / (hw.mem_bw * BW_EFF))


def moe_seconds(m: ModelSpec, hw: HardwareSpec, tokens: int, activated: int, tp: int = 1) -> float:
    """The roofline's ``moe`` group for T tokens whose T·k picks touch ``activated`` experts."""
    per_expert = ar.expert_params(m)
    flops = 2.0 * per_expert * tokens * m.moe.top_k / tp
    nbytes = (activated * per_expert / tp + 2 * tokens * m.moe.top_k * m.hidden_size) * ar.act_bytes(m)
    return max(flops / (hw.peak_flops * COMPUTE_EFF), nbytes / (hw.mem_bw * BW_EFF))


def summarise(source: str, gpu: str, model: str, tp: int, op: str, pred: Sequence[float],
              meas: Sequence[float]) -> OpError:
    rel = np.asarray(pred) / np.asarray(meas) - 1.0
    return OpError(source, gpu, model, tp, op, len(rel), float(np.median(np.abs(rel))),
                   float(np.percentile(np.abs(rel), 90)), float(np.median(rel)))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def vidur_errors(root: Path, specs) -> Iterator[OpError]:
    for folder, hw_name in VIDUR.items():
        hw = specs.hardware(hw_name)
        for path in sorted((root / "vidur" / folder).glob("*/mlp.csv")):
            rows = _rows(path)
            for tp in sorted({int(r["num_tensor_parallel_workers"]) for r in rows}):
                sel = [r for r in rows if int(r["num_tensor_parallel_workers"]) == tp]
                r0 = sel[0]
                heads, kv, d = int(r0["n_head"]), int(r0["n_kv_head"]), int(r0["n_embd"])
                shape = ModelSpec(path.parent.name, 1, d, heads, kv, d // heads, int(r0["n_expanded_embd"]),
                                  int(r0["vocab_size"]))
                for vop, op in VIDUR_OPS.items():
                    pred = [linear_seconds(hw, *linear_shape(shape, op, tp), int(r["num_tokens"])) for r in sel]
                    meas = [float(r[f"time_stats.{vop}.median"]) * 1e-3 for r in sel]
                    yield summarise("vidur", folder, path.parent.name, tp, op, pred, meas)


def llmservingsim_errors(root: Path, specs) -> Iterator[OpError]:
    models = {"Llama-3.1-8B": "llama3_1_8b", "Qwen3-30B-A3B-Instruct-2507": "qwen3_30b_a3b"}
    for folder, hw_name in LLMSERVINGSIM.items():
        hw = specs.hardware(hw_name)
        for tp_dir in sorted((root / "llmservingsim" / folder).glob("*/*/bf16/tp*")):
            model_name, tp = tp_dir.parent.parent.name, int(tp_dir.name.removeprefix("tp"))
            if model_name not in models:
                continue
            m = specs.model(models[model_name])
            dense = _rows(tp_dir / "dense.csv")
            for op in DENSE_OPS:
                sel = [r for r in dense if r["layer"] == op]
                if sel:
                    pred = [linear_seconds(hw, *linear_shape(m, op, tp), int(r["tokens"])) for r in sel]
                    yield summarise("llmservingsim", folder, model_name, tp, op, pred,
                                    [float(r["time_us"]) * 1e-6 for r in sel])
            if (tp_dir / "moe.csv").is_file():
                sel = _rows(tp_dir / "moe.csv")
                pred = [moe_seconds(m, hw, int(r["tokens"]), int(r["activated_experts"]), tp) for r in sel]
                yield summarise("llmservingsim", folder, model_name, tp, "moe", pred,
                                [float(r["time_us"]) * 1e-6 for r in sel])


def op_errors(root: Path | None = None) -> list[OpError]:
    root = root or shared_data("gpu-measurements")
    specs = conf_specs()
    return [*vidur_errors(root, specs), *llmservingsim_errors(root, specs)]


def markdown(errors: Sequence[OpError]) -> str:
    lines = ["| source | GPU | model | TP | operator | points | median abs error | p90 abs error | median bias |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {e.source} | {e.gpu} | {e.model} | {e.tp} | {e.op} | {e.points} | {100 * e.median_abs:.1f}% | "
              f"{100 * e.p90_abs:.1f}% | {100 * e.median_signed:+.1f}% |" for e in errors]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write op_errors.md and op_errors.json here")
    args = p.parse_args(argv)
    errors = op_errors()
    text = markdown(errors)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "op_errors.md").write_text(text)
        (args.out / "op_errors.json").write_text(json.dumps([asdict(e) for e in errors], indent=2))


if __name__ == "__main__":
    main()
