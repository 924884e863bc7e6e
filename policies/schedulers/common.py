"""Building blocks shared by the schedulers: room-making with preemption and FCFS admission."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from core.batch import Chunk
from core.interfaces import SchedulerView
from core.request import RequestState, Status

Victim = Callable[[SchedulerView], RequestState]


def newest(view: SchedulerView) -> RequestState:
    """Default preemption victim: the most recently admitted running request (vLLM)."""
    return view.running[-1]


def make_room(view: SchedulerView, state: RequestState, n: int, chunks: dict[str, Chunk],
              victim: Victim = newest) -> bool:
    """Allocate ``n`` tokens for a running request, preempting running requests chosen by ``victim``
    (newest first by default, as in vLLM) until it fits (recompute preemption). A victim already in
    ``chunks`` loses its chunk. Returns False if ``state`` itself had to be preempted."""
    while not view.allocate(state, n):
        v = victim(view)
        view.preempt(v)
        chunks.pop(v.id, None)
        if v is state:
            return False
    return True


def schedule_running(view: SchedulerView, order: list[RequestState], chunks: dict[str, Chunk], budget: int,
                     chunked: bool = True, victim: Victim = newest) -> int:
    """Give each running request in ``order`` its next chunk while budget lasts. Without ``chunked``, a
    request whose remaining tokens do not fit the budget is skipped this step. Returns the budget left."""
    running, allocate = Status.RUNNING, view.allocate  # bound once: this loop is the hot path of every step
    draft = view.num_draft_tokens
    for state in order:
        if budget == 0:
            break
        if state.status is not running:
            continue  # preempted as a victim earlier in this loop
        remaining = state.num_remaining_tokens
        n = remaining if remaining < budget else budget
        if not chunked and n < remaining:
            continue
        # speculative decoding: a decode also verifies d draft tokens, 1 + d tokens of budget and KV; drafts
        # only use free KV, never preempt another request
        d = min(draft(state), budget - 1) if remaining == 1 and state.output_token_ids else 0
        if d and not allocate(state, n + d):
            d = 0
        # the common case (room already there) first, without the preemption machinery
        if d or allocate(state, n) or make_room(view, state, n, chunks, victim):
            chunks[state.id] = Chunk.next(state, n, d)
            budget -= n + d
    return budget


def fcfs(view: SchedulerView) -> Iterator[RequestState]:
    """The head of the waiting queue, again after each admission (no copy of a long queue)."""
    while view.waiting:
        yield view.waiting[0]


def lifetime_tokens(state: RequestState) -> int:
    """KV tokens a request can ever hold: prompt + all outputs but the last (which is never fed back)."""
    return state.request.prompt_len + state.request.max_new_tokens - 1


def admit(view: SchedulerView, queue: Iterable[RequestState], chunks: dict[str, Chunk], budget: int,
          chunked: bool = True, reserve: bool = False) -> int:
    """Admit requests from ``queue`` (waiting requests in the order to try) while the token budget,
    ``max_num_seqs`` and KV allow. With ``chunked`` the last one may get a partial prefill; without, a
    prefill that does not fit whole stops admission (head-of-line order is kept). With ``reserve`` the
    KV for the request's whole lifetime is allocated at admission (Orca / FasterTransformer), so it can
    never be preempted later. Returns the budget left."""
    if view.preempted:  # KV ran out this step: admitting now would re-take the victims' blocks (ping-pong)
        return budget
    for state in queue:
        if budget <= 0 or len(view.running) >= view.limits.max_num_seqs:
            break
        cached = view.lookup(state)
        need = state.num_tokens - cached
        n = min(need, budget)
        kv_tokens = max(n, lifetime_tokens(state) - cached) if reserve else n
        if (not chunked and n < need) or not view.admit(state, kv_tokens):
            break
        chunks[state.id] = Chunk.next(state, n)
        budget -= n
    return budget


def steady_running_order(view: SchedulerView) -> list[RequestState] | None:
    """``SteadyDecodeScheduler.steady_decode`` of the schedulers that decode the running requests in running order
    (``schedule_running``) and then admit through ``admit``: with every running request in decode and within the
    token budget, the next steps decode them in running order and admit nobody as long as nothing waits, or
    admission stops before trying anyone -- no seat left under ``max_num_seqs``, or the decodes use the whole token
    budget. Neither changes while the state holds."""
    limits = view.limits
    n = len(view.running)
    if view.waiting and n < limits.max_num_seqs and n < limits.max_num_batched_tokens:
        return None
    return list(view.running)
