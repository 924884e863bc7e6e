"""Small builders shared by tests: a list workload, a formula executor, requests run in one call, a parsed run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from core.batch import StepFeatures
from core.interfaces import BaseExecutor, StepOutput
from core.kv_cache import PROMPT, KVCacheManager
from core.loop import RunResult, ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from sim.clock import run_virtual


class ListWorkload:
    """Open loop over a fixed list of requests."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival_s)

    def initial(self):
        return iter(self.requests)

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        return None


class FormulaExecutor(BaseExecutor):
    """Step time = f(features); samples token 1 (tests only)."""

    def __init__(self, f: Callable[[StepFeatures], float]) -> None:
        self.f = f

    def execute(self, batch):
        return StepOutput([1] * sum(ch.samples for ch in batch.chunks), self.f(batch.features))


def run_requests(requests: Sequence[Request], scheduler_factory, *, step_time=lambda f: 0.01, num_blocks=64,
             block_size=16, replicas=1, router=None, eviction_factory=LRUEviction, prefix_caching=True,
             prefix_cache_mode=PROMPT, keep_batches=False, stamp_receipt=False,
             **limits) -> tuple[RunResult, list[Replica]]:
    reps = [Replica(i, scheduler_factory(),
                    KVCacheManager(num_blocks, block_size, eviction_factory(), prefix_caching,
                                   prefix_cache_mode=prefix_cache_mode),
                    SchedulerLimits(**limits), stamp_receipt=stamp_receipt) for i in range(replicas)]
    loop = ServingLoop(reps, [FormulaExecutor(step_time) for _ in reps], router or RoundRobinRouter(),
                       ListWorkload(requests), keep_batches=keep_batches)
    return run_virtual(loop), reps


def parsed(cfg: Any, **changes: Any) -> Any:
    """``experiments.config.RunConfig`` of a composed config, with fields replaced (``num_kv_blocks=64``)."""
    from experiments.config import RunConfig

    return replace(RunConfig.from_config(cfg), **changes)


def wait_healthy(proc: Any, url: str, timeout_s: float) -> bool:
    """Poll ``url``/health until it answers or ``proc`` exits (a server started by a test); True when it is up."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return True
        except OSError:
            time.sleep(2)
    return False
