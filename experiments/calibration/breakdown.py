"""Where a simulated run's step time goes, by part of the step, and (for a tensor-parallel run on the published
operator profiles) whether the TP-N tables agree with the TP-1 tables split by N.

    python -m experiments.step_breakdown RUN_DIR [--tp1-route] [--json]

Every step of the run's steps.csv is priced again by the run's own cost model (``breakdown``: its parts sum to the
step time) and the parts are summed over the run, grouped into ``dense`` (the linear layers, norms, activations,
rotary and the embedding), ``moe`` (routed experts), ``attention`` (skew included), ``head`` (LM head, sampler),
``collectives`` (all-reduce, all-to-all, send/recv), ``launches`` (kernel launches of steps run without a CUDA
graph, or of every step on the roofline), ``host`` (the roofline's ``host_wait``: the device waiting on
the host's kernel dispatch, with ``cost_model.host_kernel_s`` > 0) and ``overhead``; each group's share of the
summed step time is what a researcher reads first. A pipeline's virtual engines are priced as whole steps (every
stage's parts, the waits for busy stages not included).

``--tp1-route`` (``cost_model=profiled`` at tp > 1): the other way to price the same steps from the same bundle,
the TP-1 tables with every sharded operator divided by tp (the projections, activation, rotary and per-head norms,
attention and the experts split their work over the ranks; the norms, embedding and sampler do not) plus the same
collectives (``sim.cost.comm``), per operator beside the TP-N tables' own rows: how far the two routes agree is a
check of the tables' consistency, not of either route against a measured run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.batch import StepFeatures
from core.output import read_step_features

GROUPS = {  # breakdown key -> group (a key not listed: dense)
    "moe": "moe", "attention": "attention", "skew": "attention", "attention_prefill": "attention",
    "attention_decode": "attention", "lm_head": "head", "sampler": "head", "allreduce": "collectives",
    "all_to_all": "collectives", "send_recv": "collectives", "host_wait": "host", "kernels": "launches",
    "overhead": "overhead",
}
TP_STABLE = ("embedding", "layernorm", "final_layernorm", "sampler")  # rows every TP rank runs whole
COLLECTIVES = ("allreduce", "all_to_all", "send_recv")


def summed_parts(cost: Any, features: Sequence[StepFeatures]) -> dict[str, float]:
    """Each ``breakdown`` key summed over the steps (seconds)."""
    out: dict[str, float] = {}
    for f in features:
        for k, v in cost.breakdown(f).items():
            out[k] = out.get(k, 0.0) + v
    return out


def grouped(parts: Mapping[str, float]) -> dict[str, float]:
    """The parts summed by ``GROUPS``."""
    out: dict[str, float] = {}
    for k, v in parts.items():
        g = GROUPS.get(k, "dense")
        out[g] = out.get(g, 0.0) + v
    return out


def tp1_route(tp_parts: Mapping[str, float], tp1_parts: Mapping[str, float], tp: int) -> dict[str, dict[str, float]]:
    """Per operator: the TP-N tables' seconds, the TP-1 tables' split by ``tp`` (TP-stable rows whole), their
    ratio, and their ``total``; collectives are the same in both routes (one collective model) and are left out,
    as are parts neither route has."""
    out = {}
    for k in sorted(set(tp_parts) | set(tp1_parts)):
        a, one = tp_parts.get(k, 0.0), tp1_parts.get(k, 0.0)
        if k in COLLECTIVES or k == "overhead" or not (a or one):
            continue
        b = one if k in TP_STABLE else one / tp
        out[k] = {"tp_tables_s": a, "tp1_split_s": b, "ratio": b / a if a else float("nan")}
    a, b = sum(v["tp_tables_s"] for v in out.values()), sum(v["tp1_split_s"] for v in out.values())
    out["total"] = {"tp_tables_s": a, "tp1_split_s": b, "ratio": b / a if a else float("nan")}
    return out


def breakdown_report(run_dir: str | Path, tp1: bool = False) -> dict[str, Any]:
    """The run's parts and groups (seconds, shares of the summed step time), its TTFT / TPOT from metrics.json,
    and with ``tp1`` the two TP routes per operator."""
    from experiments.build import sim_cost_model
    from experiments.config import RunConfig

    d = Path(run_dir)
    run = RunConfig.from_config(OmegaConf.load(d / "config.yaml"))
    if run.sim is None:
        raise ValueError(f"{d}: an engine run; the breakdown prices a simulated run's steps with its cost model")
    features, _, _ = read_step_features(d / "steps.csv")
    cost = sim_cost_model(run)
    parts = summed_parts(cost, features)
    total = sum(parts.values())
    groups = grouped(parts)
    out: dict[str, Any] = {"run": str(d), "steps": len(features), "step_time_s": total, "parts_s": parts,
                           "groups_s": groups, "shares": {g: v / total for g, v in groups.items()} if total else {}}
    metrics = d / "metrics.json"
    if metrics.is_file():
        m = json.loads(metrics.read_text())
        out["metrics"] = {k: m[k] for k in ("num_completed", "ttft_s", "tpot_s") if k in m}
    if tp1:
        tp = run.parallel.tp
        if tp == 1 or not hasattr(cost, "tables"):
            raise ValueError("--tp1-route compares a cost_model=profiled run at parallel.tp > 1 with the TP-1 tables")
        one = sim_cost_model(run, tp=1)
        out["tp1_route"] = tp1_route(parts, summed_parts(one, features), tp)
    return out


def format_report(r: Mapping[str, Any]) -> str:
    lines = [f"{r['run']}: {r['steps']} steps, {r['step_time_s']:.4g} s of step time summed"]
    if "metrics" in r:
        m = r["metrics"]
        lines.append(f"  completed {m.get('num_completed')}, TTFT p50 {m['ttft_s']['p50'] * 1e3:.4g} ms, "
                     f"TPOT p50 {m['tpot_s']['p50'] * 1e3:.4g} ms")
    lines += ["| group | seconds | share |", "|---|---|---|"]
    lines += [f"| {g} | {v:.4g} | {r['shares'][g]:.1%} |" for g, v in sorted(r["groups_s"].items(),
                                                                              key=lambda kv: -kv[1])]
    if "tp1_route" in r:
        lines += ["", "| operator | TP-N tables (s) | TP-1 tables / N (s) | ratio |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['tp_tables_s']:.4g} | {v['tp1_split_s']:.4g} | {v['ratio']:.3f} |"
                  for k, v in r["tp1_route"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Where a simulated run's step time goes, by part of the step.")
    p.add_argument("run_dir", type=Path, help="a simulated run's directory (config.yaml, steps.csv)")
    p.add_argument("--tp1-route", action="store_true",
                   help="profiled at tp > 1: the TP-1 tables split by tp beside the TP-N tables, per operator")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    r = breakdown_report(args.run_dir, args.tp1_route)
    print(json.dumps(r, indent=1) if args.json else format_report(r))


if __name__ == "__main__":
    main()
