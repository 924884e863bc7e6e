"""`python -m experiments.serve`: our engine (any ``model=``, scheduler, eviction, router, replicas) behind an
OpenAI-compatible server on the wall clock. The run directory gets the usual run files, written at shutdown, so a
served session is analysed, replayed and calibrated like any run; every ``serve.flush_interval_s`` while serving,
a snapshot is written as ``.partial`` files beside a metrics.json whose ``run_status`` is ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from pathlib import Path

from aiohttp import web
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.checks import check_float, check_int
from core.loop import RunResult
from core.output import RUNNING
from core.realtime import RealTimeClock
from core.request import SamplingParams
from experiments.build import build_loop
from experiments.cli import hydra_app
from experiments.config import RunConfig
from experiments.run import finish_run, write_run_dir
from experiments.serving.server.app import OpenAIServer, ServerSettings, drain
from experiments.serving.server.bridge import LoopThread, NoArrivals
from experiments.serving.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def _seconds(cfg: DictConfig, key: str) -> float:
    return check_float(cfg.serve[key], f"serve.{key}", 0.0, strict=True)


def build_app(cfg: DictConfig, out_dir: str | Path) -> web.Application:
    """The aiohttp application; the engine starts with the app (on_startup) and stops with it (on_cleanup). The loop
    is the run path's (``experiments.build.build_loop``), its requests coming from HTTP instead of a workload."""
    from engine.tokenizer import load_tokenizer

    run = RunConfig.from_config(cfg)
    max_waiting = check_int(cfg.serve.max_waiting, "serve.max_waiting", 1)
    drain_s, flush_s = _seconds(cfg, "drain_timeout_s"), _seconds(cfg, "flush_interval_s")
    name = cfg.serve.model_name or run.model.path or run.model.name
    if run.cluster.kind != "colocated":  # the server's real-time loop has no transfer processes
        raise ValueError(f"cluster={run.cluster.kind}: the server runs colocated replicas only; use "
                         "python -m experiments.run for a PD cluster")
    loop = build_loop(run, workload=NoArrivals())
    tokenizer = load_tokenizer(run.model.path)
    sampling = run.engine.sampling if run.engine is not None else SamplingParams()  # the simulator samples nothing
    server = OpenAIServer(run.model, tokenizer, ServerSettings(name, max_waiting, sampling))
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes(server.routes())
    tasks: dict[str, asyncio.Task] = {}

    write_lock, finished = threading.Lock(), []

    def write(final: bool) -> None:
        # one writer at a time: a flush whose task was cancelled at shutdown still runs in its thread, and must
        # neither interleave with the final write nor land after it
        with write_lock:
            if finished:
                return
            bridge = server.bridge
            if bridge.thread.is_alive():
                states, steps, pool = bridge.records()
            else:  # stopped: its state is ours to read
                states, steps, pool = [s for s in loop.states if s.status.terminal], list(loop.steps), loop.itl_pool
            result = RunResult(states, steps, bridge.now(), bridge.now(), itl_pool=pool)
            if final:  # the run path's own end: checks, host-tier section, the complete run files
                finish_run(run, loop, result, out_dir)
                finished.append(True)
            else:  # while serving: a snapshot (run_status "running", data files named .partial), no figures
                write_run_dir(run, result, out_dir, run_status=RUNNING, plots=False)

    async def flush_periodically() -> None:
        while True:
            await asyncio.sleep(flush_s)
            await asyncio.get_running_loop().run_in_executor(None, write, False)

    async def on_startup(app: web.Application) -> None:
        server.metrics = ServerMetrics(name, lambda: server.bridge.snapshot, run.kv.block_size)
        server.bridge = LoopThread(loop, RealTimeClock(), asyncio.get_running_loop(), server.metrics)
        server.bridge.start()
        tasks["flush"] = asyncio.create_task(flush_periodically())

    async def on_shutdown(app: web.Application) -> None:
        await drain(server, drain_s)

    async def on_cleanup(app: web.Application) -> None:
        tasks["flush"].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks["flush"]
        server.bridge.stop()
        await asyncio.get_running_loop().run_in_executor(None, write, True)
        log.info("wrote %s", out_dir)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def serve(cfg: DictConfig, out_dir: str | Path) -> None:
    """Serve until SIGINT / SIGTERM, then drain and write the run directory."""
    app = build_app(cfg, out_dir)
    host, port = cfg.serve.host, int(cfg.serve.port)
    log.info(f"serving on http://{host}:{port} (run files: {out_dir})")
    web.run_app(app, host=host, port=port, handler_cancellation=True,
                shutdown_timeout=_seconds(cfg, "drain_timeout_s"), print=None, access_log=None)


@hydra_app("serve")
def main(cfg: DictConfig) -> None:
    serve(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
