"""`python -m experiments.gateway`: an OpenAI-compatible proxy in front of N backends (ours, vLLM, any OpenAI
server), routing every request by one of the project's router plugins (``router=``, conf/router). It serves until
SIGINT / SIGTERM, then lets requests in flight finish for ``gateway.drain_timeout_s`` and writes the run directory
(requests.csv with each request's backend, tokens.csv, metrics.json); a snapshot every
``gateway.flush_interval_s`` while serving (``.partial`` data files, ``run_status: running``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from core.interfaces import Router
from experiments.build import summary_options
from experiments.cli import hydra_app
from experiments.config import MetricsConfig, section
from experiments.serving.gateway.config import GatewayConfig
from experiments.serving.gateway.proxy import Gateway
from experiments.serving.gateway.records import Recorder

log = logging.getLogger(__name__)


def _tokenizers(gw: GatewayConfig) -> dict[str, Any]:
    from engine.tokenizer import load_tokenizer

    out = {}
    for path in {b.tokenizer or gw.tokenizer for b in gw.backends} - {None}:
        tok = load_tokenizer(path)
        if tok is None:
            raise ValueError(f"gateway tokenizer {path!r}: no tokenizer files in that directory")
        out[path] = tok
    return out


def build_gateway(cfg: DictConfig, out_dir: str | Path) -> tuple[Gateway, web.Application]:
    """The gateway and its aiohttp application (polling starts and the run files are written with the app)."""
    gw = GatewayConfig.from_config(cfg.gateway)
    router = instantiate(cfg.router)
    if not isinstance(router, Router):
        raise ValueError(f"router: {type(router).__name__} has no route(request, replicas) method")
    metrics = section(MetricsConfig, "metrics", cfg.get("metrics"))
    if metrics.prefix_cost is None:  # no model here: work saved = tokens reused
        metrics = dataclasses.replace(metrics, prefix_cost=[1.0, 0.0])
    options = summary_options(metrics, cfg.slo, None)
    recorder = Recorder(out_dir, [b.name for b in gw.backends], {"router": type(router).__name__})
    gateway = Gateway(gw, router, recorder, _tokenizers(gw))
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes(gateway.routes())
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    tasks: dict[str, asyncio.Task] = {}

    def write(final: bool) -> None:
        scraped = {b.name: dict(b.scraped) for b in gateway.backends}
        recorder.write(final, options, {"backend_metrics": scraped}, {"config.yaml": config_yaml})

    async def flush_periodically() -> None:
        while True:
            await asyncio.sleep(gw.flush_interval_s)
            await asyncio.get_running_loop().run_in_executor(None, write, False)

    async def on_startup(app: web.Application) -> None:
        await gateway.start()
        tasks["flush"] = asyncio.create_task(flush_periodically())

    async def on_shutdown(app: web.Application) -> None:
        gateway.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + gw.drain_timeout_s
        while any(b.flights for b in gateway.backends) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def on_cleanup(app: web.Application) -> None:
        tasks["flush"].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks["flush"]
        with contextlib.suppress(Exception):  # the last scrape goes into metrics.json (best effort)
            await gateway.poll()
        await gateway.stop()
        await asyncio.get_running_loop().run_in_executor(None, write, True)
        log.info("wrote %s", out_dir)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return gateway, app


def serve(cfg: DictConfig, out_dir: str | Path) -> None:
    gateway, app = build_gateway(cfg, out_dir)
    gw = gateway.cfg
    names = ", ".join(f"{b.name}={b.url}" for b in gw.backends)
    log.info(f"gateway on http://{gw.host}:{gw.port} (router {gateway.router_name}; backends {names}; "
             f"run files: {out_dir})")
    web.run_app(app, host=gw.host, port=gw.port, handler_cancellation=True, shutdown_timeout=gw.drain_timeout_s,
                print=None, access_log=None)


@hydra_app("gateway")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    serve(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
