"""Priority / SLO-aware scheduling: priority class, then earliest TTFT deadline, then arrival."""

from __future__ import annotations

import math

from core.batch import Batch, Chunk
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import schedule_running


def urgency(state: RequestState) -> tuple[int, float, float, str]:
    """Sort key, smallest = most important: (priority, arrival + ttft_deadline_s or inf, arrival, id)."""
    r = state.request
    deadline = r.arrival_s + r.ttft_deadline_s if r.ttft_deadline_s is not None else math.inf
    return r.priority, deadline, r.arrival_s, r.id


def least_important(view: SchedulerView) -> RequestState:
    return max(view.running, key=urgency)


class PriorityScheduler:
    """Chunked like Sarathi (running decodes, then running prefills, then admissions, within
    ``max_num_batched_tokens``), but every list is taken in ``urgency`` order. When KV runs out the least
    important running request is preempted (recompute), not the newest. A waiting request that cannot be
    admitted (no KV or no seat under ``max_num_seqs``) preempts running requests strictly less important
    than itself until it fits (vLLM's priority preemption); the strict order rules out ping-pong."""

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: decodes in urgency order (fixed per request) repeat while
        nothing waits (a waiting request may preempt a less important one, so any waiting request ends it)."""
        return None if view.waiting else sorted(view.running, key=urgency)

    def schedule(self, view: SchedulerView) -> Batch:
        chunks: dict[str, Chunk] = {}
        running = sorted(view.running, key=urgency)
        order = [s for s in running if not s.in_prefill] + [s for s in running if s.in_prefill]
        budget = schedule_running(view, order, chunks, view.limits.max_num_batched_tokens, victim=least_important)
        if view.preempted:  # KV ran out for running requests: admitting now would only re-take the victims' blocks
            return Batch(list(chunks.values()))
        for state in sorted(view.waiting, key=urgency):
            if budget <= 0:
                break
            cached = view.lookup(state)
            n = min(state.num_tokens - cached, budget)
            while not (len(view.running) < view.limits.max_num_seqs and view.admit(state, n)):
                if not view.running or urgency(victim := least_important(view)) <= urgency(state):
                    return Batch(list(chunks.values()))
                view.preempt(victim)
                dropped = chunks.pop(victim.id, None)
                budget += dropped.num_positions if dropped else 0
            chunks[state.id] = Chunk.next(state, n)
            budget -= n
        return Batch(list(chunks.values()))
