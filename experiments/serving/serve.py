"""`python -m experiments.serve`: our engine (any ``model=``, scheduler, eviction, router, replicas) behind an
OpenAI-compatible server on the wall clock. The run directory gets the usual run files, written at shutdown, so a
served session is analysed, replayed and calibrated like any run; every ``serve.flush_interval_s`` while serving,
a snapshot is written as ``.partial`` files beside a metrics.json whose ``run_status`` is ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from pathlib import Path

import hydra
from aiohttp import web
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.checks import check_float, check_int
from core.loop import RunResult, ServingLoop
from core.output import COMPLETE, RUNNING
from core.realtime import RealTimeClock
from core.request import SamplingParams
from experiments.build import CONF_DIR, build_executors, cluster_kind, instantiate_group, model_spec, replicas_for
from experiments.cli import user_errors
from experiments.run import write_run_dir
from experiments.serving.server.app import OpenAIServer, ServerSettings, drain
from experiments.serving.server.bridge import LoopThread, NoArrivals
from experiments.serving.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def _seconds(cfg: DictConfig, key: str) -> float:
    return check_float(cfg.serve[key], f"serve.{key}", 0.0, strict=True)


def build_app(cfg: DictConfig, out_dir: str | Path) -> web.Application:
    """The aiohttp application; the engine starts with the app (on_startup) and stops with it (on_cleanup)."""
    from engine.tokenizer import load_tokenizer

    spec = model_spec(cfg)
    max_waiting = check_int(cfg.serve.max_waiting, "serve.max_waiting", 1)
    drain_s, flush_s = _seconds(cfg, "drain_timeout_s"), _seconds(cfg, "flush_interval_s")
    name = cfg.serve.model_name or cfg.model.get("path") or spec.name
    b = cfg.backend
    default_sampling = SamplingParams(float(b.get("temperature", 0.0)), float(b.get("top_p", 1.0)),
                                      int(b.get("top_k", 0)))
    if cluster_kind(cfg) != "colocated":  # the server's real-time loop has no transfer processes
        raise ValueError(f"cluster={cluster_kind(cfg)}: the server runs colocated replicas only; use "
                         "python -m experiments.run for a PD cluster")
    replicas = replicas_for(cfg)
    loop = ServingLoop(replicas, build_executors(cfg, spec, replicas), instantiate_group(cfg.router, "router"),
                       NoArrivals())
    tokenizer = load_tokenizer(cfg.model.get("path"))
    server = OpenAIServer(spec, tokenizer, ServerSettings(name, max_waiting, default_sampling))
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
                states, steps = bridge.records()
            else:  # stopped: its state is ours to read
                states, steps = [s for s in loop.states if s.status.terminal], list(loop.steps)
            # while serving: a snapshot (run_status "running", data files named .partial); at shutdown: complete
            write_run_dir(cfg if final else _without_plots(cfg), RunResult(states, steps, bridge.now(), bridge.now()),
                          out_dir, run_status=COMPLETE if final else RUNNING)
            if final:
                finished.append(True)

    async def flush_periodically() -> None:
        while True:
            await asyncio.sleep(flush_s)
            await asyncio.get_running_loop().run_in_executor(None, write, False)

    async def on_startup(app: web.Application) -> None:
        server.metrics = ServerMetrics(name, lambda: server.bridge.snapshot)
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


def _without_plots(cfg: DictConfig) -> DictConfig:
    out = cfg.copy()
    out.output.plots = False
    return out


def serve(cfg: DictConfig, out_dir: str | Path) -> None:
    """Serve until SIGINT / SIGTERM, then drain and write the run directory."""
    app = build_app(cfg, out_dir)
    host, port = cfg.serve.host, int(cfg.serve.port)
    log.info(f"serving {cfg.serve.model_name or cfg.model.get('path') or cfg.model.name} on http://{host}:{port} "
          f"(run files: {out_dir})")
    web.run_app(app, host=host, port=port, handler_cancellation=True,
                shutdown_timeout=_seconds(cfg, "drain_timeout_s"), print=None, access_log=None)


@hydra.main(config_path=str(CONF_DIR), config_name="serve", version_base="1.3")
@user_errors
def _main(cfg: DictConfig) -> None:
    serve(cfg, HydraConfig.get().runtime.output_dir)


def main() -> None:
    from experiments.run import checkpoint_paths_to_overrides

    sys.argv[1:] = checkpoint_paths_to_overrides(sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
