"""`python -m experiments.bench_gateway`: prefix_aware vs round_robin routing through the gateway in front of two
real engine servers, measured, and the simulator's prediction of the same two runs, printed side by side.

Measured: for each router, two fresh `experiments.serve` processes (our engine on a tiny random-weight checkpoint,
CPU) behind `experiments.gateway` (a subprocess), and `experiments.loadgen` replaying a shared-prefix workload
(``--groups`` system prompts of ``--prefix`` tokens) through the gateway. Hit rate = the backends' own
``prefix_cache_hits`` / ``prefix_cache_queries`` (tokens, from their /metrics, summed over both); TTFT from
loadgen's run files (client side, so HTTP and the gateway's hop count).

Simulated: the simulator calibrated on the round_robin run's measured steps (both servers' steps.csv, a linear
step-time fit, ``experiments.calibration.calibrate``), then `experiments.run` with ``backend=sim replicas=2`` and
the same router, scheduler, KV pool and workload. The KV pool per server (``--blocks``) is sized so that one
server holds about half of the groups' prefixes: round robin sends every group to both and thrashes their LRU
caches, prefix-aware routing keeps each group on one. The question: does the simulator predict the direction and
the size of the win? The machine is shared; read one run's TTFTs as noisy (``--repeats`` runs both routers again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from experiments.build import CONF_DIR

ROUTERS = ("round_robin", "prefix_aware")


class GatewayProcess:
    """`python -m experiments.gateway` on a free port in front of ``urls``; stop() writes its run files."""

    def __init__(self, urls: list[str], router: str, out: Path) -> None:
        from experiments.serving.server.process import ROOT, free_port

        self.port, self.out = free_port(), out
        self.url = f"http://127.0.0.1:{self.port}"
        backends = "[" + ",".join(f'{{url:"{u}"}}' for u in urls) + "]"
        self.log = (out.parent / f"{out.name}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.gateway", f"gateway.port={self.port}",
                                      f"gateway.backends={backends}", f"router={router}", f"hydra.run.dir={out}"],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {(out.parent / f'{out.name}.log').read_text()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the gateway did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def measure(router: str, ckpt: str, server_args: list[str], load_cfg: Any, out: Path) -> dict[str, Any]:
    """One measured run: two servers, the gateway with ``router``, loadgen through it."""
    from concurrent.futures import ThreadPoolExecutor

    from experiments.serving.loadgen.run import run_loadgen
    from experiments.serving.server.process import ServerProcess

    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda i: ServerProcess(Path(ckpt), out / f"server{i}", *server_args), range(2)))
    try:
        gw = GatewayProcess([s.url for s in servers], router, out / "gateway")
        try:
            load_cfg.target.url = gw.url
            metrics = run_loadgen(load_cfg, out / "loadgen")
        finally:
            gw.stop()
        hits = [s.metric("prefix_cache_hits_total") for s in servers]
        queries = [s.metric("prefix_cache_queries_total") for s in servers]
    finally:
        for s in servers:
            s.stop()
    per_backend = json.loads((out / "gateway" / "metrics.json").read_text())["requests_per_backend"]
    return {"hit_rate": sum(hits) / max(sum(queries), 1), "per_backend_hit_rate": [h / max(q, 1) for h, q in
            zip(hits, queries, strict=True)], "ttft_mean_s": metrics["ttft_s"]["mean"],
            "ttft_p50_s": metrics["ttft_s"]["p50"], "ttft_p99_s": metrics["ttft_s"]["p99"],
            "completed": metrics["num_completed"], "requests_per_backend": per_backend,
            "steps": [str(out / f"server{i}") for i in range(2)]}


def simulate(router: str, sim_overrides: list[str], out: Path) -> dict[str, Any]:
    from core.output import read_requests
    from experiments.run import run

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*sim_overrides, f"router={router}"])
    m = run(cfg, out)
    replica = read_requests(out / "requests.csv")["replica"]
    return {"hit_rate": m["cached_tokens"] / max(m["prompt_tokens"], 1), "ttft_mean_s": m["ttft_s"]["mean"],
            "ttft_p50_s": m["ttft_s"]["p50"], "ttft_p99_s": m["ttft_s"]["p99"], "completed": m["num_completed"],
            "requests_per_backend": {f"b{i}": int((replica == i).sum()) for i in range(2)}}


def calibrate_linear(model_args: list[str], step_dirs: list[str], out: Path) -> Path:
    from experiments.calibration.calibrate import calibrate

    steps = "calibrate.steps=[" + ",".join(f"'{d}'" for d in step_dirs) + "]"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("calibrate", overrides=[*model_args, "calibrate.profile=false", "calibrate.fits=[linear]",
                                              "calibrate.plot=false", steps])
    return calibrate(cfg, out).paths["linear"]


def _row(label: str, r: dict[str, Any]) -> str:
    return (f"{label:<28} hit rate {r['hit_rate']:6.1%}   TTFT mean {r['ttft_mean_s'] * 1e3:8.2f} ms   "
            f"p50 {r['ttft_p50_s'] * 1e3:8.2f} ms   p99 {r['ttft_p99_s'] * 1e3:8.2f} ms   done {r['completed']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random Llama made here)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix", type=int, default=256, help="shared prefix tokens per group")
    p.add_argument("--suffix", type=int, default=32, help="mean own tokens per request")
    p.add_argument("--output", type=int, default=16, help="mean output tokens per request")
    p.add_argument("--blocks", type=int, default=56, help="KV blocks per server (block size 16)")
    p.add_argument("--repeats", type=int, default=1, help="measured runs per router")
    p.add_argument("--out", default=None, help="keep the run directories here (default: a temporary directory)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out) if a.out else Path(tmp)
        if a.model is None:
            from experiments.benchmarks.tiny_checkpoint import make_checkpoint

            a.model = str(make_checkpoint(root / "ckpt", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=4,
                                          intermediate_size=768, vocab_size=4096))
        model_args = [f"model.path={Path(a.model).resolve()}", "model=checkpoint"]
        pool = [f"kv.num_blocks={a.blocks}", "kv.block_size=16"]
        work = ["workload=shared_prefix", f"workload.num_requests={a.requests}", f"workload.arrival.rate_rps={a.rate}",
                f"workload.num_groups={a.groups}", f"workload.prefix_len={a.prefix}",
                f"workload.suffix_len.mean={a.suffix}", f"workload.output_len.mean={a.output}",
                "workload.tokens_per_hash_id=16"]
        server_args = [*pool, "backend.num_threads=1", "backend.warmup_steps=2"]
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            load_cfg = compose("loadgen", overrides=[*model_args, *work, "output.plots=false",
                                                     "output.progress=false"])
        measured: dict[str, list[dict[str, Any]]] = {r: [] for r in ROUTERS}
        for k in range(a.repeats):
            for router in ROUTERS:
                measured[router].append(measure(router, a.model, server_args, load_cfg.copy(),
                                                root / f"measured-{router}-{k}"))
        cal = calibrate_linear(model_args, measured["round_robin"][0]["steps"], root / "calibration")
        sim_overrides = [*model_args, "backend=sim", "replicas=2", "cost_model=calibrated",
                         f"cost_model.path={cal}", *pool, *work, "output.plots=false"]
        simulated = {r: simulate(r, sim_overrides, root / f"sim-{r}") for r in ROUTERS}
    print(f"shared-prefix workload: {a.requests} requests at {a.rate}/s, {a.groups} groups x {a.prefix} prefix "
          f"tokens; 2 servers x {a.blocks} KV blocks")
    for router in ROUTERS:
        for k, r in enumerate(measured[router]):
            print(_row(f"measured {router} #{k}", r), f"  per backend {r['requests_per_backend']}")
        sim = simulated[router]
        print(_row(f"simulated {router}", sim), f"  per backend {sim['requests_per_backend']}")
    out: dict[str, Any] = {"measured": measured, "simulated": simulated}
    pairs = [(f"measured #{k}", rr, pa) for k, (rr, pa) in enumerate(zip(measured["round_robin"],
                                                                          measured["prefix_aware"], strict=True))]
    for label, rr, pa in [*pairs, ("simulated", simulated["round_robin"], simulated["prefix_aware"])]:
        win = {"hit_rate_gain": pa["hit_rate"] - rr["hit_rate"],
               "ttft_mean_ratio": pa["ttft_mean_s"] / rr["ttft_mean_s"],
               "ttft_p50_ratio": pa["ttft_p50_s"] / rr["ttft_p50_s"]}
        out[f"{label} win"] = win
        print(f"{label:>12} prefix_aware vs round_robin: hit rate {100 * win['hit_rate_gain']:+.1f} points, "
              f"TTFT mean x{win['ttft_mean_ratio']:.2f}, p50 x{win['ttft_p50_ratio']:.2f}")
    return out


if __name__ == "__main__":
    main()
