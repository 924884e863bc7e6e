"""Simulator speed benchmark: the Azure conversation trace on 4 replicas of Llama-3-8B on H100.

Prints simulated seconds per wall second and steps per wall second (goal: >= 60x real time on a 2-core box).
Usage: python -m experiments.bench_sim [--limit N] [--replicas 4]
"""

from __future__ import annotations

import argparse
import time

from hydra import compose, initialize_config_dir

from core.loop import ServingLoop
from core.workload.replay import AzureTrace
from experiments.build import CONF_DIR, build_executors, instantiate_group, model_spec, replicas_for
from sim.clock import simulate


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace (default: all)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--router", default="round_robin")
    args = p.parse_args(argv)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama3_8b", "hardware=h100", "cost_model=roofline",
                                           f"replicas={args.replicas}", f"router={args.router}",
                                           "scheduler.max_num_batched_tokens=2048", "scheduler.max_num_seqs=256"])
    replicas = replicas_for(cfg)
    executors = build_executors(cfg, model_spec(cfg), replicas)
    t0 = time.perf_counter()
    workload = AzureTrace(limit=args.limit)
    load_s = time.perf_counter() - t0
    loop = ServingLoop(replicas, executors, instantiate_group(cfg.router, "router"), workload)
    cpu0 = time.process_time()
    res = simulate(loop)
    cpu_s = time.process_time() - cpu0
    out = {"requests": len(res.states), "steps": len(res.steps), "simulated_s": res.end_s, "wall_s": res.wall_s,
           "trace_load_s": load_s, "sim_s_per_wall_s": res.end_s / res.wall_s,
           "steps_per_wall_s": len(res.steps) / res.wall_s,
           "cpu_s": cpu_s, "sim_s_per_cpu_s": res.end_s / cpu_s}  # CPU time: robust on a shared, noisy machine
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
