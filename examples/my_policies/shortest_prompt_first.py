"""Example user policy: admit the waiting request with the least prefill work left first (SJF on prompts).

It lives outside the project packages and imports only ``core`` and the public scheduler helpers, which is
all a policy needs to run unchanged in the simulator and in the engine.
"""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import admit, schedule_running


class ShortestPromptFirst:
    """Running requests first (decodes, then ongoing prefills, chunked within the token budget), then
    waiting requests by uncached prompt tokens, fewest first (ties: queue order). Short prompts get low
    TTFT; long ones can starve under sustained load, which is the point of comparing it with FCFS."""

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        running = [s for s in view.running if not s.in_prefill] + [s for s in view.running if s.in_prefill]
        budget = schedule_running(view, running, chunks, view.limits.max_num_batched_tokens)

        def work(state: RequestState) -> int:
            return state.num_tokens - view.lookup(state)

        admit(view, sorted(view.waiting, key=work), chunks, budget)
        return Batch(list(chunks.values()))
