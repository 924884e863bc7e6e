"""Request-level (static) batching, as in FasterTransformer: a batch is formed only when the replica is
idle and runs until every request in it has finished."""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.checks import check_bool
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import fcfs, lifetime_tokens, schedule_running


class StaticScheduler:
    """When nothing runs, admit up to ``max_num_seqs`` waiting requests FCFS (each prompt must fit
    ``max_num_batched_tokens`` whole; the first that does not, or does not fit the KV pool, closes the
    batch). Then the batch runs in lockstep: prefill steps (whole prompts, as many as the token budget
    holds per step) until every member is prefilled, then decode steps of all members, until all finish.
    Nobody joins mid-batch; finished members leave their slot idle.

    ``reserve`` (default) allocates each member's KV for prompt + max_new_tokens - 1 at admission, as
    FasterTransformer preallocates its buffers, so a batch is never preempted. Without it KV grows per
    token and a member preempted by recompute waits for the next batch."""

    def __init__(self, reserve: bool = True) -> None:
        self.reserve = check_bool(reserve, "scheduler.reserve")

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: a batch in its decode phase decodes the same members (running
        order) until one finishes; nobody joins mid-batch, whatever waits."""
        return list(view.running)

    def schedule(self, view: SchedulerView) -> Batch:
        budget = view.limits.max_num_batched_tokens
        if not view.running:  # form the batch: FCFS while the seat, token-budget and KV limits hold
            for state in fcfs(view):
                cached = view.lookup(state)
                need = state.num_tokens - cached
                if need > budget or len(view.running) >= view.limits.max_num_seqs:
                    break  # head-of-line; a prompt that never fits is rejected by the idle replica
                if not view.admit(state, max(need, lifetime_tokens(state) - cached) if self.reserve else need):
                    break
        chunks: dict[str, Chunk] = {}
        prefills = [s for s in view.running if s.in_prefill]
        schedule_running(view, prefills or list(view.running), chunks, budget, chunked=False)
        return Batch(list(chunks.values()))
