"""Simulator speed benchmark: the Azure conversation trace on 4 replicas of Llama-3-8B on H100 (roofline cost model,
default scheduler), as simulated seconds per wall second, every case measured in this one run:

- ``loop``: the serving loop alone, in this process (config built, trace loaded, nothing written);
- ``process_csv``: ``python -m experiments.run`` as a whole process (imports, loop, metrics, files, plots) with the
  default outputs (CSV, every token event, plots);
- ``process_parquet``: the same with ``output.format=parquet``; ``process_tokens_none``: with ``output.tokens=none``.

Goal (issue 13): >= 60x real time for ``process_csv`` on the first 3,000 requests. A process case's simulated
seconds are the run's own (timing.json: ``wall_s`` x ``sim_s_per_wall_s``), its wall seconds the whole
subprocess's; ``cpu_s`` is the child's user + system CPU time (robust on a shared, noisy machine), ``peak_rss_mb``
its peak resident memory.

``loop_per_step`` / ``process_csv_per_step``: the same with decode fast-forward off; the run prints the
fast-forward speed-up and whether the two modes' files are byte-identical. More cases: add a ``Case`` to ``CASES``;
``--cases`` picks some; ``--full`` runs the whole trace (19,366 requests) after ``--limit``, ``--only-full`` it alone.
Usage: python -m experiments.bench_sim [--limit 3000] [--full | --only-full] [--cases loop process_csv] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments.build import REPO_ROOT

REPO = REPO_ROOT
COMMON = ["backend=sim", "model=llama3_8b", "hardware=h100", "cost_model=roofline", "workload=azure"]


@dataclass(frozen=True)
class Case:
    name: str
    process: bool  # True: a whole `python -m experiments.run` subprocess; False: the loop alone, in this process
    overrides: tuple[str, ...] = field(default_factory=tuple)  # Hydra overrides after COMMON and the size


CASES = (
    Case("loop", False),
    Case("process_csv", True),
    Case("process_parquet", True, ("output.format=parquet",)),
    Case("process_tokens_none", True, ("output.tokens=none",)),
    # decode fast-forward off (core.fast_forward; on by default): every step through schedule / execute / apply.
    # The files are byte-identical; the ratio to ``loop`` / ``process_csv`` is what fast-forward buys.
    # The full trace: ``--full --cases loop loop_per_step process_csv``.
    Case("loop_per_step", False, ("backend.fast_forward=false",)),
    Case("process_csv_per_step", True, ("backend.fast_forward=false",)),
)


def _overrides(case: Case, limit: int | None, replicas: int, extra: list[str]) -> list[str]:
    size = f"workload.limit={'null' if limit is None else limit}"
    return [*COMMON, size, f"replicas={replicas}", "output.progress=false", *case.overrides, *extra]


def run_loop(overrides: list[str]) -> dict:
    """The serving loop alone: build it from the config (trace loaded), simulate, time it."""
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR, build_loop
    from experiments.config import RunConfig
    from sim.clock import run_virtual

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    t0 = time.perf_counter()
    loop = build_loop(RunConfig.from_config(cfg))
    build_s = time.perf_counter() - t0
    cpu0, w0 = time.process_time(), time.perf_counter()
    res = run_virtual(loop)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - w0
    return {"requests": len(res.states), "steps": len(res.steps), "simulated_s": res.end_s, "wall_s": wall_s,
            "cpu_s": cpu_s, "build_s": build_s}


def run_process(overrides: list[str], out_dir: Path) -> dict:
    """``python -m experiments.run`` with ``overrides`` into ``out_dir``, timed as a whole process; its own CPU time
    and peak resident memory from ``wait4``."""
    cmd = [sys.executable, "-m", "experiments.run", *overrides, f"hydra.run.dir={out_dir}"]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONHASHSEED": "0"})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall_s = time.perf_counter() - t0
        if proc.returncode:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.read().decode()[-3000:]}")
    timing = json.loads((out_dir / "timing.json").read_text())
    metrics = json.loads((out_dir / "metrics.json").read_text())
    written = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    return {"requests": metrics["num_requests"], "steps": metrics.get("num_steps"),
            "simulated_s": timing["wall_s"] * timing["sim_s_per_wall_s"], "wall_s": wall_s,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "loop_wall_s": timing["wall_s"], "bytes_written": written}


EQUAL_FILES = ("requests.csv", "tokens.csv", "steps.csv", "metrics.json")


def same_outputs(a: Path, b: Path) -> dict[str, bool]:
    """File by file: are two run directories byte-identical (the fast-forward equivalence check)?"""
    return {n: (a / n).read_bytes() == (b / n).read_bytes() for n in EQUAL_FILES}


def bench(limit: int | None, args: argparse.Namespace, out_root: Path) -> dict:
    """Every selected case at one trace size; the fast-forward ratios and equivalence when both modes ran."""
    results: dict[str, dict] = {}
    label = "full trace" if limit is None else f"first {limit} requests"
    for case in CASES:
        if case.name not in args.cases:
            continue
        ov = _overrides(case, limit, args.replicas, args.overrides)
        r = run_process(ov, out_root / case.name) if case.process else run_loop(ov)
        r["sim_s_per_wall_s"] = r["simulated_s"] / r["wall_s"]
        r["sim_s_per_cpu_s"] = r["simulated_s"] / r["cpu_s"] if r["cpu_s"] > 0 else None
        results[case.name] = r
        print(f"[{label}] {case.name:22s} " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in r.items()), flush=True)
    out: dict = {"limit": limit, "replicas": args.replicas, "cases": results}
    if "loop" in results:  # the loop's figures at the top level (the `pytest -m bench` test reads them)
        out.update({k: results["loop"][k] for k in ("requests", "steps", "sim_s_per_wall_s", "sim_s_per_cpu_s")})
    if "process_csv" in results:
        out["process_sim_s_per_wall_s"] = results["process_csv"]["sim_s_per_wall_s"]
        print(f"[{label}] whole process, default outputs: {out['process_sim_s_per_wall_s']:.1f}x real time "
              "(goal >= 60x at 3,000 requests, >= 100x on the full trace)")
    for fast, slow in (("loop", "loop_per_step"), ("process_csv", "process_csv_per_step")):
        if fast in results and slow in results:
            ratio = results[fast]["sim_s_per_wall_s"] / results[slow]["sim_s_per_wall_s"]
            out[f"{fast}_fast_forward_speedup"] = ratio
            print(f"[{label}] {fast}: fast-forward {results[fast]['sim_s_per_wall_s']:.1f}x real time, per step "
                  f"{results[slow]['sim_s_per_wall_s']:.1f}x: {ratio:.2f}x faster")
    if "process_csv" in results and "process_csv_per_step" in results:
        same = same_outputs(out_root / "process_csv", out_root / "process_csv_per_step")
        out["fast_forward_identical"] = all(same.values())
        print(f"[{label}] fast-forward vs per-step files: "
              + ("byte-identical" if out["fast_forward_identical"] else f"DIFFER {same}"))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=3000, help="first N requests of the trace (default 3000)")
    p.add_argument("--full", action="store_true", help="also the whole trace (19,366 requests), after --limit")
    p.add_argument("--only-full", action="store_true", help="the whole trace only")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=[c.name for c in CASES])
    p.add_argument("--out", default=None, help="directory for the process cases' run directories (default: temp)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every case (key=value)")
    args = p.parse_args(argv)
    sizes = [None] if args.only_full else [args.limit, None] if args.full else [args.limit]
    out_root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench_sim-"))
    runs = [bench(n, args, out_root / ("full" if n is None else str(n))) for n in sizes]
    out = runs[0] if len(runs) == 1 else {"sizes": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
