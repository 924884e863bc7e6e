"""`make gpu-check` / `python -m experiments.gpu_check [--out DIR] [--model llama3_8b] [--quick]`: one GPU check,
under 10 minutes on one H100/H200, that writes one report (DIR/report.md and DIR/report.json):

1. the GPU tests (``pytest -m gpu`` over tests/kernels and tests/engine): pass / fail per test;
2. experiments.benchmarks.gpu on an 8B-shaped model in bf16: kernel times vs their baselines (torch SDPA, bf16
   cuBLAS), the MoE grouped GEMM vs a loop of per-expert cuBLAS matmuls (Qwen3-30B-A3B and Mixtral-8x7B experts,
   TFLOP/s), decode steps as % of the bandwidth roofline, prefill MFU, W4A16 and int8-KV speed-ups measured vs
   predicted;
3. a calibration profile: the simulator's linear step-cost model fitted on the benchmark's steps (steps.csv);
4. tensor parallelism over NCCL (experiments.benchmarks.tp, two GPUs): TP 2 vs TP 1 step times and tokens of a
   small Llama, and of a small Qwen3-MoE with its experts split (ep 2) on the Triton grouped GEMM; ``skipped`` on
   a machine with one GPU. (The GPU tests of 1. check the engine's MoE layers on the grouped GEMM against the
   torch path's tokens, and TP 2 over NCCL against one GPU's, where two GPUs exist.)

Each section runs on its own: one that fails (or runs out of its time) is reported with its error and the rest still
run; a ``skipped`` section (not this machine's to check) does not fail the check. Without CUDA nothing runs: the
report says "no GPU" and the command exits with status 2 (a machine that cannot check is not a passing check).
Exit status 1 when any test or section failed, 0 when all passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from experiments.build import REPO_ROOT

ROOT = REPO_ROOT
NO_GPU = 2


def _hardware(name: str) -> str:
    """The conf/hardware option for a device name (roofline peaks); H100 numbers for anything unknown."""
    name = name.lower()
    return next((hw for hw in ("h200", "h100", "a100") if hw in name), "h100")


def run_tests(out: Path, timeout_s: int, per_test_timeout_s: int = 90) -> dict:
    """pytest -m gpu in a subprocess (its own CUDA context; a crash there cannot take the report down). Its output
    goes straight to gpu_tests.log, so a run stopped at ``timeout_s`` still shows how far it got and what was slow;
    pytest-timeout, where installed, stops any one test after ``per_test_timeout_s``."""
    import importlib.util

    xml, log = out / "gpu_tests.xml", out / "gpu_tests.log"
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "--durations=15", "tests/kernels", "tests/engine"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={per_test_timeout_s}")
    if importlib.util.find_spec("xdist") is not None:  # Triton's compiles, not the GPU, bound the tests' time
        cmd += ["-n", str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = f"stopped after {timeout_s} s"
    text = log.read_text()
    tests = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            status = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (el.get("message") or "")[:300]
                    break
            else:
                message = ""
            tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "status": status,
                          "seconds": float(case.get("time") or 0), "message": message})
    else:  # stopped before pytest wrote its report: the verbose log's PASSED / FAILED lines
        for line in text.splitlines():
            for status in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
                if f" {status}" in line and "::" in line:
                    tests.append({"test": line.split(" ")[0], "status": status.lower(), "seconds": 0.0,
                                  "message": ""})
                    break
    return {"returncode": returncode, "seconds": time.perf_counter() - t0, "tests": tests, "tail": text[-3000:]}


def run_bench(out: Path, model: str, hardware: str, quick: bool) -> dict:
    from experiments.benchmarks.gpu import main as bench

    args = ["--model", model, "--hardware", hardware, "--out", str(out / "bench"), "--reps", "5" if quick else "10"]
    return bench(args + (["--quick"] if quick else []))


def run_calibration(out: Path) -> dict:
    """The linear step-cost model fitted on the benchmark's steps (relative error per shape group)."""
    from core.output import read_step_features
    from sim.fit import fit_linear

    features, durations, _ = read_step_features(out / "bench" / "steps.csv")
    model, report = fit_linear(list(features), durations)
    return {"linear_model": {k: v for k, v in vars(model).items() if isinstance(v, int | float | str)},
            "fit": {k: v for k, v in vars(report).items() if isinstance(v, int | float | str | dict)},
            "steps": len(durations)}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: list[dict], keys: list[str]) -> list[str]:
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return lines


def markdown(report: dict) -> str:
    lines = [f"# gpu-check — {report['device']}", "", f"torch {report['torch']}, started {report['started']}, "
             f"{report['seconds']:.0f} s; overall: **{'PASS' if report['ok'] else 'FAIL'}**", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec.get('seconds', 0):.0f} s)", ""]
        if sec["status"] != "ok":
            lines += ["```", sec.get("error", "")[-3000:], "```", ""]
            continue
        res = sec["result"]
        if name == "tests":
            counts = {s: sum(t["status"] == s for t in res["tests"]) for s in ("passed", "failed", "error", "skipped")}
            lines += [", ".join(f"{k} {v}" for k, v in counts.items()), ""]
            if res["returncode"] != 0:
                lines += [f"pytest: {res['returncode']}", "", "```", res["tail"], "```", ""]
            lines += _table(res["tests"], ["test", "status", "seconds", "message"])
        elif name == "bench":
            lines += ["### kernels (ms; speedup = baseline / ours)", ""]
            lines += _table(res["kernels"], ["op", "shape", "baseline", "baseline_ms", "ms", "speedup",
                                             "predicted_speedup", "fraction_of_bandwidth_roofline",
                                             "speedup_vs_16bit", "predicted_speedup_vs_16bit", "torch_ref_ms"])
            lines += ["", "### MoE grouped GEMM (ms; speedup = baseline / ours; roofline: whichever binds)", ""]
            lines += _table(res.get("grouped_gemm", []), ["op", "shape", "baseline", "baseline_ms", "ms", "speedup",
                                                          "tflops", "baseline_tflops", "fraction_of_bandwidth_roofline",
                                                          "fraction_of_peak_flops"])
            lines += ["", "### steps (decode: % of the bandwidth roofline; prefill: MFU)", ""]
            lines += _table(res["steps"], ["kind", "batch", "context", "tokens", "step_ms", "bandwidth_bound_ms",
                                           "fraction_of_bandwidth_roofline", "eager_step_ms", "graph_speedup",
                                           "tflops", "fraction_of_peak_flops"])
            lines += ["", "### W4A16 and int8 KV engines (decode; measured vs predicted speed-up over 16-bit)", ""]
            lines += _table(res.get("quant", []), ["quant", "kv_dtype", "batch", "context", "step_ms",
                                                   "fraction_of_bandwidth_roofline", "speedup_vs_16bit",
                                                   "predicted_speedup_vs_16bit"])
        else:
            lines += ["```json", json.dumps(res, indent=1, default=str)[:4000], "```"]
        lines.append("")
    return "\n".join(lines)


class Skipped(Exception):
    """A section this machine cannot run (e.g. TP on one GPU): reported, not a failure."""


def run_tp(out: Path, quick: bool) -> dict:
    """TP 1 vs TP 2 over NCCL on GPUs 0 and 1 (a dense and an expert-parallel MoE model), tokens compared."""
    import torch

    from experiments.benchmarks.tp import main as bench

    if torch.cuda.device_count() < 2:
        raise Skipped(f"tensor parallelism needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    base = ["--device", "cuda", "--kernels", "triton", "--tp", "1,2", "--repeats", "2" if quick else "3",
            "--batch", "8" if quick else "32", "--threads", "1"]
    return {"llama": bench(base), "qwen3_moe_ep2": bench([*base, "--arch", "qwen3_moe", "--ep", "2"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/gpu_check")
    p.add_argument("--model", default="llama3_8b", help="a conf/model option for the benchmark")
    p.add_argument("--quick", action="store_true", help="small benchmark shapes (a smoke run of the check)")
    p.add_argument("--test-timeout", type=int, default=300, help="seconds for the GPU tests")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    t0 = time.perf_counter()
    report = {"torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "sections": {}}
    if not torch.cuda.is_available():
        report.update(device="no GPU", ok=False, seconds=0.0)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        msg = f"gpu-check: no GPU (torch {torch.__version__}, CUDA build: {torch.version.cuda}); nothing was run"
        (out / "report.md").write_text(msg + "\n")
        print(msg)
        return NO_GPU
    report["device"] = torch.cuda.get_device_name()
    hardware = _hardware(report["device"])
    sections = {
        "tests": lambda: run_tests(out, args.test_timeout),
        "bench": lambda: run_bench(out, args.model, hardware, args.quick),
        "calibration": lambda: run_calibration(out),
        "tp": lambda: run_tp(out, args.quick),
    }
    for name, fn in sections.items():
        s0 = time.perf_counter()
        try:
            sec = {"status": "ok", "result": fn()}
        except Skipped as e:
            sec = {"status": "skipped", "error": str(e)}
        except BaseException as e:  # noqa: BLE001 - keep every other section's result
            if isinstance(e, KeyboardInterrupt):
                raise
            sec = {"status": "failed", "error": traceback.format_exc()}
        sec["seconds"] = time.perf_counter() - s0
        report["sections"][name] = sec
        print(f"gpu-check: {name} {sec['status']} ({sec['seconds']:.0f} s)", flush=True)
        # Written after every section: a check stopped by an outer time limit still leaves what it measured.
        tests = report["sections"]["tests"]
        tests_ok = tests["status"] == "ok" and tests["result"]["returncode"] == 0
        report["ok"] = tests_ok and all(s["status"] in ("ok", "skipped") for s in report["sections"].values())
        report["seconds"] = time.perf_counter() - t0
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "report.md").write_text(markdown(report))
    print(f"gpu-check: {'PASS' if report['ok'] else 'FAIL'}; report in {out / 'report.md'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
