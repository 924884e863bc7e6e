"""Load client benchmark: the client's own send lag (actual send - due time) at a given request rate.

A fake OpenAI-compatible server (``experiments.serving.fake_openai``) runs in its own process on 127.0.0.1 and streams
every answer at a known pace; ``experiments.serving.loadgen`` replays a Poisson workload against it. Prints the send-lag
percentiles (goal: p99 < 2 ms at 100 req/s) and whether every request finished with its length.

On a shared machine the client's event-loop thread is sometimes runnable but not running (other processes hold the
cores): no client can send on time then. The benchmark reads that thread's run-queue wait (Linux
/proc/thread-self/schedstat) and reports, besides the raw lag, the share of the run it spent waiting for a CPU and
"lag_net": each request's lag minus the run-queue wait between its task's start (5 ms before its due time) and
its send (a task that itself started late because the thread waited for a CPU is not corrected), and the machine's
idle share over the run (all cores, /proc/stat).
Usage: python -m experiments.bench_loadgen [--rate 100] [--requests 1000] [--output-len 32] [--itl-ms 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir

from core.output import read_timing
from experiments.build import CONF_DIR, REPO_ROOT
from experiments.serving.loadgen.client import LoadGen
from experiments.serving.loadgen.run import run_loadgen, summary_line

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def cpu_times() -> list[int]:
    """The machine's CPU time counters (user, nice, system, idle, ...) from /proc/stat (empty elsewhere)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def runqueue_wait_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (0 where the kernel does not say)."""
    try:
        return int(SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class ProbedLoadGen(LoadGen):
    """LoadGen that notes its event-loop thread's run-queue wait from each request task's start to its send."""

    last: ProbedLoadGen | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wait_at_launch: dict[str, float] = {}
        self.waited: dict[str, float] = {}
        self.runqueue_share = 0.0

    async def _until(self, due, rec) -> None:
        self.wait_at_launch[rec.id] = runqueue_wait_s()  # the task starts loadgen.LAUNCH_LEAD_S before due
        await super()._until(due, rec)

    async def _on_sent(self, session, ctx, params) -> None:
        await super()._on_sent(session, ctx, params)
        rec = (ctx.trace_request_ctx or {}).get("record")
        if rec is not None and rec.id not in self.waited and rec.id in self.wait_at_launch:
            self.waited[rec.id] = runqueue_wait_s() - self.wait_at_launch[rec.id]

    def run(self):
        w0, t0 = runqueue_wait_s(), time.monotonic()
        res = super().run()
        self.runqueue_share = (runqueue_wait_s() - w0) / max(time.monotonic() - t0, 1e-9)
        ProbedLoadGen.last = self
        return res


def start_fake_server(ttft_ms: float, itl_ms: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "experiments.fake_openai", "--port", "0", "--ttft-ms", str(ttft_ms),
                             "--itl-ms", str(itl_ms)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"fake server did not start: {line!r}")
    return proc, int(line.split()[1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rate", type=float, default=100.0, help="Poisson arrival rate (req/s)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--ttft-ms", type=float, default=10.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = p.parse_args(argv)
    proc, port = start_fake_server(args.ttft_ms, args.itl_ms)
    cpu0 = cpu_times()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("loadgen", overrides=[
                f"target.url=http://127.0.0.1:{port}", "target.model=fake", "output.plots=false",
                "output.progress=false", f"workload.num_requests={args.requests}",
                f"workload.arrival.rate_rps={args.rate}", f"workload.prompt_len={args.prompt_len}",
                f"workload.output_len={args.output_len}"])
        with tempfile.TemporaryDirectory() as tmp:
            metrics = run_loadgen(cfg, args.out or tmp, client=ProbedLoadGen)
            wall_s = read_timing(args.out or tmp)["wall_s"]
    finally:
        proc.terminate()
        proc.wait(10)
    gen = ProbedLoadGen.last
    lags = {r.id: r.sent_s - r.scheduled_s for r in gen.records if r.sent_s is not None}
    net = np.array([max(0.0, v - gen.waited.get(k, 0.0)) for k, v in lags.items()]) * 1e3
    lag = metrics["send_lag_s"]
    busy = [b - a for a, b in zip(cpu0, cpu_times(), strict=False)]
    idle = busy[3] / sum(busy) if len(busy) > 3 and sum(busy) else None
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    out = {"rate_rps": args.rate, "requests": metrics["num_requests"], "completed": metrics["num_completed"],
           "send_lag_p50_ms": lag["p50"] * 1e3, "send_lag_p90_ms": lag["p90"] * 1e3,
           "send_lag_p99_ms": lag["p99"] * 1e3, "send_lag_max_ms": lag["max"] * 1e3,
           "lag_net_p50_ms": float(np.percentile(net, 50)), "lag_net_p99_ms": float(np.percentile(net, 99)),
           "lag_net_max_ms": float(net.max()), "runqueue_wait_share": gen.runqueue_share, "machine_idle_share": idle,
           "loadavg_1min": load,
           "wall_s": wall_s,
           "exact_lengths": metrics["output_tokens"] == args.output_len * metrics["num_completed"]}
    print(summary_line(metrics))
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
