"""Longest prefix match first (SGLang's ``lpm`` schedule policy), chunked like Sarathi."""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.checks import check_int
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import admit, fcfs, schedule_running, steady_running_order


class LPMScheduler:
    """Running requests as in Sarathi (decodes, then ongoing prefills), then waiting requests in
    decreasing order of cached prefix length (``view.lookup``; ties keep queue order), so requests that
    reuse the cache run while it still holds their prefix. Sorting costs a lookup per waiting request,
    so when more than ``fcfs_threshold`` requests wait it falls back to FCFS (SGLang switches at 128)."""

    def __init__(self, fcfs_threshold: int = 128) -> None:
        self.fcfs_threshold = check_int(fcfs_threshold, "scheduler.fcfs_threshold", 0)

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: running order, while nothing can be admitted
        (``steady_running_order``)."""
        return steady_running_order(view)

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        decodes = [s for s in view.running if not s.in_prefill]
        prefills = [s for s in view.running if s.in_prefill]
        budget = schedule_running(view, decodes + prefills, chunks, view.limits.max_num_batched_tokens)
        if len(view.waiting) > self.fcfs_threshold:
            queue = fcfs(view)
        else:
            queue = sorted(view.waiting, key=view.lookup, reverse=True)
        admit(view, queue, chunks, budget)
        return Batch(list(chunks.values()))
