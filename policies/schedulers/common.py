"""Building blocks shared by the schedulers: room-making with preemption and FCFS admission."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from core.batch import Chunk
from core.replica import SchedulerView
from core.request import RequestState, Status


def make_room(view: SchedulerView, state: RequestState, n: int, chunks: dict[str, Chunk]) -> bool:
    """Allocate ``n`` tokens for a running request, preempting the newest running requests until it fits
    (recompute preemption, newest first as in vLLM). A victim already in ``chunks`` loses its chunk.
    Returns False if ``state`` itself had to be preempted."""
    while not view.allocate(state, n):
        victim = view.running[-1]
        view.preempt(victim)
        chunks.pop(victim.id, None)
        if victim is state:
            return False
    return True


def schedule_running(view: SchedulerView, order: list[RequestState], chunks: dict[str, Chunk], budget: int,
                     chunked: bool = True) -> int:
    """Give each running request in ``order`` its next chunk while budget lasts. Without ``chunked``, a
    request whose remaining tokens do not fit the budget is skipped this step. Returns the budget left."""
    for state in order:
        if budget == 0:
            break
        if state.status is not Status.RUNNING:
            continue  # preempted as a victim earlier in this loop
        n = min(state.num_remaining_tokens, budget)
        if not chunked and n < state.num_remaining_tokens:
            continue
        if make_room(view, state, n, chunks):
            chunks[state.id] = Chunk.next(state, n)
            budget -= n
    return budget


def fcfs(view: SchedulerView) -> Iterator[RequestState]:
    """The head of the waiting queue, again after each admission (no copy of a long queue)."""
    while view.waiting:
        yield view.waiting[0]


def admit(view: SchedulerView, queue: Iterable[RequestState], chunks: dict[str, Chunk], budget: int,
          chunked: bool = True) -> int:
    """Admit requests from ``queue`` (waiting requests in the order to try) while the token budget,
    ``max_num_seqs`` and KV allow. With ``chunked`` the last one may get a partial prefill; without, a
    prefill that does not fit whole stops admission (head-of-line order is kept). Returns the budget left."""
    for state in queue:
        if budget <= 0 or len(view.running) >= view.limits.max_num_seqs:
            break
        need = state.num_tokens - view.lookup(state)
        n = min(need, budget)
        if (not chunked and n < need) or not view.admit(state, n):
            break
        chunks[state.id] = Chunk.next(state, n)
        budget -= n
    return budget
