"""vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``, vLLM 0.32, FCFS policy), decision by decision.

``experiments/calibration/vllm_sched_trace.py`` records vLLM's own decisions and ``tests/policies/test_vllm_v1.py``
checks that this class makes the same ones, step by step, with the KV pool in ``kv.prefix_cache_mode=vllm`` (vLLM's
prefix-cache semantics). docs/policies.md lists what is mirrored and what is not.
"""

from __future__ import annotations

from core.batch import Batch, Chunk
from core.checks import check_bool, check_int
from core.interfaces import SchedulerView
from core.request import RequestState
from policies.schedulers.common import make_room, steady_running_order


class VLLMv1Scheduler:
    """One token budget (``max_num_batched_tokens``) per step, spent first on the running requests in running order
    (decodes and partial prefills alike), then on waiting requests FCFS.

    A running request gets min(remaining, budget left, ``long_prefill_token_threshold`` when > 0) tokens. If its
    KV does not fit, the newest running request is preempted (recompute) until it does, the request itself last;
    then no later running request runs this step, and nobody is admitted in a step that preempted. A waiting request
    is admitted while budget and a seat under ``max_num_seqs`` remain: its prefix-cache hit (whole blocks, at most
    num_tokens - 1 tokens, so a fully cached prompt recomputes its last block) is skipped, the rest capped by the
    threshold and the budget; the first that cannot be admitted stops admission (head-of-line). Without
    ``enable_chunked_prefill`` a waiting request whose (threshold-capped) chunk exceeds the budget left stops
    admission. With ``scheduler_reserve_full_isl`` a request is admitted only if the pool could hold its whole
    prompt (plus outputs, when it resumes after preemption) besides its cached prefix.

    The threshold applies only when more than one request is running or waiting; with
    ``long_prefill_token_threshold_adaptive`` it is raised to at least max_num_batched_tokens divided by that count.

    ``async_scheduling`` (vLLM's default since 0.12 with AsyncLLM): the step is decided one step ahead, so a request
    queued while a step runs, or a seat a finishing request frees, reaches the batch after next (the replica
    applies that lag, ``core.replica``); off, the decisions are vLLM's synchronous scheduler's, step for step.
    """

    def __init__(self, long_prefill_token_threshold: int = 0, long_prefill_token_threshold_adaptive: bool = False,
                 enable_chunked_prefill: bool = True, scheduler_reserve_full_isl: bool = True,
                 async_scheduling: bool = False) -> None:
        self.long_prefill_token_threshold = check_int(long_prefill_token_threshold,
                                                      "scheduler.long_prefill_token_threshold", 0)
        self.long_prefill_token_threshold_adaptive = check_bool(
            long_prefill_token_threshold_adaptive, "scheduler.long_prefill_token_threshold_adaptive")
        self.enable_chunked_prefill = check_bool(enable_chunked_prefill, "scheduler.enable_chunked_prefill")
        self.scheduler_reserve_full_isl = check_bool(scheduler_reserve_full_isl, "scheduler.scheduler_reserve_full_isl")
        # vLLM's AsyncScheduler: this step is decided while the previous one runs; the replica implements the lag
        # (core.replica: late arrivals and freed seats reach the batch after next); decisions are otherwise these
        self.async_scheduling = check_bool(async_scheduling, "scheduler.async_scheduling")

    def steady_decode(self, view: SchedulerView) -> list[RequestState] | None:
        """``core.interfaces.SteadyDecodeScheduler``: running order, while nothing can be admitted
        (``steady_running_order``); a decode's one token is below any threshold."""
        return steady_running_order(view)

    def _threshold(self, view: SchedulerView) -> int:
        """The step's chunk cap (0: none), fixed before anything is scheduled."""
        threshold = self.long_prefill_token_threshold
        num_eligible = len(view.running) + len(view.waiting)
        if num_eligible <= 1:  # nobody to starve
            return 0
        if threshold and self.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, view.limits.max_num_batched_tokens // num_eligible)
        return threshold

    def schedule(self, view: SchedulerView) -> Batch:
        budget = view.limits.max_num_batched_tokens
        threshold = self._threshold(view)
        chunks: dict[str, Chunk] = {}
        running = view.running  # live: preemption pops victims off its end
        i = 0
        while i < len(running) and budget > 0:
            state = running[i]
            n = state.num_remaining_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
            if not make_room(view, state, n, chunks):  # it was preempted itself: every later one went before it
                break
            chunks[state.id] = Chunk.next(state, n)
            budget -= n
            i += 1
        if view.preempted:
            return Batch(list(chunks.values()))
        waiting, max_num_seqs = view.waiting, view.limits.max_num_seqs
        while budget > 0 and waiting and len(running) < max_num_seqs:
            state = waiting[0]
            n = state.num_tokens - view.lookup(state)
            if 0 < threshold < n:
                n = threshold
            if not self.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not view.admit(state, n, state.num_tokens if self.scheduler_reserve_full_isl else 0):
                break
            chunks[state.id] = Chunk.next(state, n)
            budget -= n
        return Batch(list(chunks.values()))
