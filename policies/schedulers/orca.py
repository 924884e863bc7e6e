"""Orca: iteration-level scheduling with whole (never chunked) prefills."""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.checks import check_bool
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import admit, fcfs, schedule_running, steady_running_order


class OrcaScheduler:
    """Every step runs all running decodes, then admits new requests FCFS whose whole prompt fits the
    token budget left (a prompt that does not fit stops admission: head-of-line). Prefills and decodes
    mix in one step; a prompt is never split.

    ``reserve`` (default) allocates a request's KV for prompt + max_new_tokens - 1 at admission, as Orca
    does (the vLLM paper's "Orca (Oracle)" when outputs run to max_new_tokens), so nothing is preempted.
    Without it KV grows per token (paged) and KV exhaustion preempts the newest request (recompute)."""

    def __init__(self, reserve: bool = True) -> None:
        self.reserve = check_bool(reserve, "scheduler.reserve")

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: running order, while nothing can be admitted
        (``steady_running_order``)."""
        return steady_running_order(view)

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        budget = schedule_running(view, list(view.running), chunks, view.limits.max_num_batched_tokens,
                                  chunked=False)
        admit(view, fcfs(view), chunks, budget, chunked=False, reserve=self.reserve)
        return Batch(list(chunks.values()))
