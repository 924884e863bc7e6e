"""`python -m experiments.serve`: our engine (any ``model=``, scheduler, eviction, router, replicas) behind an
OpenAI-compatible server on the wall clock. The run directory gets the usual run files, written at shutdown, so a
served session is analysed, replayed and calibrated like any run. While serving, memory holds only live requests:
each request is journaled as it is queued and as it ends, each step as it runs (``core.journal``, under
``journal/``); every ``serve.flush_interval_s`` the journal is fsynced and metrics.json (``run_status: running``)
updated with the counts. At shutdown the journal becomes the run files; a killed server leaves it for
``twinserve recover DIR`` (``experiments.serving.recover``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

from aiohttp import web
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.checks import check_float, check_int
from core.journal import read_journal, remove_journal
from core.realtime import RealTimeClock
from core.request import SamplingParams
from experiments.build import build_loop
from experiments.cli import hydra_app
from experiments.config import RunConfig
from experiments.run import config_yaml, finish_run
from experiments.serving.journal import SERVE, journal_result, open_journal, write_status
from experiments.serving.server.app import OpenAIServer, ServerSettings, drain
from experiments.serving.server.bridge import LoopThread, NoArrivals
from experiments.serving.server.metrics import ServerMetrics
from experiments.serving.server.protocol import PROMPT_CHARS_PER_TOKEN

log = logging.getLogger(__name__)
SERVER = web.AppKey("server", OpenAIServer)


def _seconds(cfg: DictConfig, key: str) -> float:
    return check_float(cfg.serve[key], f"serve.{key}", 0.0, strict=True)


API_KEY_ENV = "TWINSERVE_API_KEY"  # the API key when serve.api_key is null


def _settings(cfg: DictConfig, name: str, max_waiting: int, sampling: SamplingParams, has_logits: bool,
              max_model_len: int) -> ServerSettings:
    key = cfg.serve.api_key or os.environ.get(API_KEY_ENV) or None
    return ServerSettings(name, max_waiting, sampling, str(key) if key is not None else None,
                          check_int(cfg.serve.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len,
                                    "serve.max_prompt_chars", 1),
                          _seconds(cfg, "tokenize_timeout_s"), has_logits)


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
    server = OpenAIServer(run.model, tokenizer, _settings(cfg, name, max_waiting, sampling, run.engine is not None,
                                                          run.model.max_model_len))
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[server.middleware])
    app[SERVER] = server
    app.add_routes(server.routes())
    tasks: dict[str, asyncio.Task] = {}

    label = run.backend
    journal = open_journal(out_dir, SERVE, label, config_yaml(run.config))
    loop.journal_to(journal)  # memory holds live requests only; ended ones and steps are in the run directory
    write_lock, finished = threading.Lock(), []

    def write(final: bool) -> None:
        # one writer at a time: a flush whose task was cancelled at shutdown still runs in its thread, and must
        # neither interleave with the final write nor land after it
        with write_lock:
            if finished:
                return
            if not final:  # while serving: fsync the journal, a small metrics.json (run_status "running")
                journal.flush()
                write_status(out_dir, journal, label)
                return
            # the run path's own end from the journal: checks, host-tier section, the complete run files
            journal.close()
            now = server.bridge.now()
            result = journal_result(read_journal(out_dir), now, now, run.output.tokens, run.metrics.prompt_len_edges)
            finish_run(run, loop, result, out_dir)
            remove_journal(out_dir)
            finished.append(True)

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
        server.parser.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, write, True)
        log.info("wrote %s", out_dir)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


def serve(cfg: DictConfig, out_dir: str | Path) -> None:
    """Serve until SIGINT / SIGTERM, then drain and write the run directory (``run_until_signalled``)."""
    app = build_app(cfg, out_dir)
    host, port = cfg.serve.host, int(cfg.serve.port)
    log.info(f"serving on http://{host}:{port} (run files: {out_dir})")
    asyncio.run(run_until_signalled(app, host, port, _seconds(cfg, "drain_timeout_s")))


async def run_until_signalled(app: web.Application, host: str, port: int, drain_s: float) -> None:
    """Serve ``app`` until the first SIGINT / SIGTERM; then drain while still listening (new requests get 503,
    /health says ``draining``) for up to ``drain_s``; a second signal cancels the requests still running; then
    stop listening, and the app's cleanup writes the run files. Later signals are ignored (logged)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_s)
    await runner.setup()
    aio, stop, signals = asyncio.get_running_loop(), asyncio.Event(), []

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        server: OpenAIServer = app[SERVER]
        if len(signals) == 1:
            log.info(f"{sig.name}: draining (up to {drain_s} s; a second signal cancels what is running)")
            stop.set()
        elif len(signals) == 2 and server.bridge is not None:
            log.info(f"{sig.name} again: cancelling the requests still running, then writing the run files")
            server.bridge.hurry.set()
        else:
            log.info(f"{sig.name}: already shutting down (writing the run files)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, on_signal, sig)
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:  # a user error in one line (experiments.cli): the port is taken, the host unknown
            raise ValueError(f"serve.host={host} serve.port={port}: cannot listen there ({e.strerror or e})") from None
        await stop.wait()
        await drain(app[SERVER], drain_s)
    finally:
        await runner.cleanup()


@hydra_app("serve")
def main(cfg: DictConfig) -> None:
    serve(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
