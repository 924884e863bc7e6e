"""vLLM's queues and KV cache manager behind our ``SchedulerView`` (``core.interfaces``), for one ``schedule`` call.

Each vLLM ``Request`` has a mirror ``RequestState`` (kept by the adapter across steps) that the plugin reads: its
prompt length, output count (real outputs plus the async scheduler's in-flight placeholders), computed tokens,
priority and arrival time. The plugin's ``admit`` / ``allocate`` / ``preempt`` go straight to vLLM: the same
``KVCacheManager`` calls vLLM's own scheduler makes (``get_computed_blocks``, ``allocate_slots``), its
``_preempt_request``, its waiting and running queues. The view records what happened (admissions with their cache hit,
new blocks per request, preemptions) for the adapter to turn the plugin's ``Batch`` into a ``SchedulerOutput``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from core.interfaces import SchedulerLimits
from core.request import RequestState, Status


@dataclass
class Admission:
    """A request moved from waiting to running that the model runner has not seen yet: how it came, and what the
    prefix cache gave it."""

    request: Any  # vllm.v1.request.Request
    resumed: bool  # it was preempted before (vLLM's scheduled_resumed_reqs, if the runner knows it), else new
    num_cached_tokens: int  # vLLM's local prefix-cache hit, in tokens


class VllmSchedulerView:
    """The ``SchedulerView`` over a vLLM ``Scheduler`` (``sched``) for one step. ``running`` / ``waiting`` hold the
    mirrors of the requests the plugin may schedule (vLLM's order); requests vLLM must not schedule now are left out
    (an async step whose in-flight outputs already reach max_tokens; a waiting request that is not ready)."""

    def __init__(self, sched: Any, limits: SchedulerLimits, now: float, timestamp: float, running: list[RequestState],
                 waiting: deque[RequestState], requests: dict[str, Any], may_admit: bool,
                 admitted: dict[str, Admission]) -> None:
        self._sched, self._kv = sched, sched.kv_cache_manager
        self.now, self.limits = now, limits  # now: wall clock, as vLLM's arrival_time
        self._timestamp = timestamp  # vLLM's event clock (time.monotonic)
        self.running, self.waiting = running, waiting
        self.block_size: int = sched.block_size
        self.preempted: list[str] = []
        self.blocked: RequestState | None = None
        self._requests = requests  # id -> vLLM Request, for the mirrors in running / waiting
        self._may_admit = may_admit  # False while vLLM is paused for new requests
        # running requests vLLM's model runner has not seen yet (admitted, no chunk so far: a plugin may admit more
        # requests than one step's budget prefills); kept by the adapter across steps
        self.admitted = admitted
        self.new_blocks: dict[str, Any] = {}  # id -> KVCacheBlocks allocated this step for a running request

    @property
    def num_free_blocks(self) -> int:
        return self._kv.block_pool.get_num_free_blocks()

    @property
    def num_free_host_blocks(self) -> int:
        return 0  # vLLM's CPU offloading is a KV connector, which the adapter refuses

    def num_draft_tokens(self, state: RequestState) -> int:
        return 0  # vLLM's speculative decoding is refused at start

    def lookup(self, state: RequestState) -> int:
        """vLLM's local prefix-cache hit for a waiting request (whole blocks, at most num_tokens - 1)."""
        req = self._requests[state.id]
        if req.num_computed_tokens:
            return req.num_computed_tokens
        return self._kv.get_computed_blocks(req)[1]

    def admit(self, state: RequestState, num_tokens: int, fit_tokens: int = 0) -> bool:
        """``allocate_slots`` with the request's cached blocks, as vLLM's scheduler admits; ``fit_tokens`` equal to
        the request's tokens is vLLM's ``full_sequence_must_fit`` (scheduler_reserve_full_isl), any other positive
        value is checked against the free blocks first."""
        sched, kv, req = self._sched, self._kv, self._requests[state.id]
        if not self._may_admit or num_tokens < 1 or len(sched.running) >= sched.max_num_active_reqs:
            return False
        blocks, hit, boundary = kv.get_computed_blocks(req)
        full = fit_tokens >= req.num_tokens
        if fit_tokens and not full and -(-fit_tokens // self.block_size) - hit // self.block_size \
                > kv.block_pool.get_num_free_blocks():
            return False
        new = kv.allocate_slots(req, num_tokens, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                num_lookahead_tokens=sched.num_lookahead_tokens, full_sequence_must_fit=full,
                                has_scheduled_reqs=bool(sched.running))
        if new is None:
            return False
        req.shared_prefix_boundary = boundary
        sched.waiting.remove_request(req)
        sched.running.append(req)
        self.admitted[state.id] = Admission(req, req.status == RequestStatus.PREEMPTED, hit)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit
        self.waiting.remove(state)
        self.running.append(state)
        state.num_computed_tokens = hit
        state.status = Status.RUNNING
        if state.first_scheduled_s is None:
            state.first_scheduled_s = self.now
            state.num_cached_tokens = hit
        return True

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        req = self._requests[state.id]
        new = self._kv.allocate_slots(req, num_tokens, num_lookahead_tokens=self._sched.num_lookahead_tokens)
        if new is None:
            return False
        prev = self.new_blocks.get(state.id)
        self.new_blocks[state.id] = new if prev is None else prev + new
        return True

    def preempt(self, state: RequestState) -> None:
        """vLLM's recompute preemption (``Scheduler._preempt_request``): blocks freed, to the head of waiting."""
        sched, req = self._sched, self._requests[state.id]
        sched.running.remove(req)
        sched._preempt_request(req, self._timestamp, drop_stale_output=sched.requires_kv_delivery)
        self.admitted.pop(state.id, None)
        self.new_blocks.pop(state.id, None)
        self.running.remove(state)
        self.waiting.appendleft(state)
        self.preempted.append(state.id)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = Status.PREEMPTED

