"""`python -m experiments.bench_serve`: output tokens/s through HTTP (our server, measured by loadgen) over the offline
engine on the same workload (goal >= 0.9x), and loadgen's send lag. Ratios measured in one run; the machine is
shared, so read them as such.

Both sides run the same config (model, scheduler, KV pool) with the engine timed on the wall clock. Offline:
``experiments.run.run`` (steps back to back, the simulated clock advanced by measured step times). Through HTTP:
``experiments.serve`` in a subprocess and ``experiments.loadgen`` replaying the workload against it. Throughput =
output tokens / (last finish - first arrival) in both.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.build import CONF_DIR


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a 44M random Llama made here)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine (both sides)")
    a = p.parse_args(argv)
    from experiments.run import run
    from experiments.serving.loadgen.run import run_loadgen
    from experiments.serving.server.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.model is None:
            from experiments.benchmarks.tiny_checkpoint import make_checkpoint

            a.model = str(make_checkpoint(tmp / "ckpt"))
        common = [f"model.path={a.model}", "kv.num_blocks=2048", "scheduler.max_num_seqs=64",
                  f"backend.num_threads={a.threads}", "output.plots=false", "output.progress=false"]
        work = [f"workload.num_requests={a.requests}", "workload.arrival.kind=fixed",
                "workload.arrival.rate_rps=1000000", f"workload.prompt_len={a.prompt}",
                f"workload.output_len={a.output}"]
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            offline_cfg = compose("config", overrides=["backend=engine", "engine_clock=wall", *common, *work])
            load_cfg = compose("loadgen", overrides=[f"model.path={a.model}", *work, "output.plots=false",
                                                     "output.progress=false"])
        offline = run(offline_cfg, tmp / "offline")
        server = ServerProcess(Path(a.model), tmp / "served", *common)
        load_cfg.target.url = server.url
        try:
            http = run_loadgen(load_cfg, tmp / "http")
        finally:
            server.stop()
    out = {"offline_tok_s": offline["throughput_tok_s"], "http_tok_s": http["throughput_tok_s"],
           "http_over_offline": http["throughput_tok_s"] / offline["throughput_tok_s"],
           "send_lag_p99_ms": 1e3 * http["send_lag_s"]["p99"]}
    print(" ".join(f"{k}={v:.3g}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
