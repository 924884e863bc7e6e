"""Sarathi-Serve style scheduling: decode-first, then chunked prefills, within a per-step token budget."""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import admit, fcfs, schedule_running, steady_running_order


class SarathiScheduler:
    """Decodes of running requests first (one token each; keeps inter-token gaps short), then ongoing
    prefill chunks, then new requests FCFS. Prefills are cut to what is left of ``max_num_batched_tokens``,
    so a long prompt never stalls the decodes for a whole prefill. KV exhaustion preempts the newest
    running request (recompute)."""

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: running order, while nothing can be admitted
        (``steady_running_order``)."""
        return steady_running_order(view)

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        decodes, prefills = [], []
        for s in view.running:
            (prefills if s.in_prefill else decodes).append(s)
        budget = schedule_running(view, decodes + prefills, chunks, view.limits.max_num_batched_tokens)
        admit(view, fcfs(view), chunks, budget)
        return Batch(list(chunks.values()))
