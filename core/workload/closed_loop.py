"""Closed loop: N clients, each sends a request, waits for it to end, thinks, sends the next."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from core.checks import check_float, check_int
from core.request import Request, RequestState, Status
from core.workload.base import (
    OUTPUT,
    PROMPT,
    THINK,
    check_bound,
    check_think,
    draw_think,
    rng,
    tenant_name,
)
from core.workload.lengths import make_length

REJECT_RETRY_S = 1e-3


class ClosedLoopWorkload:
    """``num_clients`` concurrent clients, ``num_requests`` requests in all (or until ``duration_s``).

    ``initial`` yields each client's first request, client c at ``c * stagger_s`` (default 0: all at t = 0,
    the usual benchmark-client start). ``on_finish`` maps the request back to its client by id and returns
    that client's next request at ``now + think time`` (fixed or exponential with mean ``think_time_s``),
    whatever the status of the finished one (a rejected client moves on), or None once the budget or the
    duration is used up. Each client draws from its own random streams, so its lengths and think times do
    not depend on the order in which other clients finish. Calling ``initial`` again restarts the loop.
    """

    def __init__(self, num_clients: int, prompt_len: Mapping[str, Any] | int, output_len: Mapping[str, Any] | int,
                 num_requests: int | None = None, duration_s: float | None = None, think_time_s: float = 0.0,
                 think: str = "fixed", stagger_s: float = 0.0, warmup_requests: int = 0, num_tenants: int = 1,
                 seed: int = 0) -> None:
        check_bound(num_requests, duration_s)
        self.num_clients = check_int(num_clients, "workload.num_clients", 1)
        self.prompt_len = make_length(prompt_len, "prompt_len")
        self.output_len = make_length(output_len, "output_len")
        self.num_requests, self.duration_s = num_requests, duration_s
        self.think_time_s, self.think = check_think(think_time_s, think), think
        self.stagger_s = check_float(stagger_s, "workload.stagger_s")
        self.warmup_requests = check_int(warmup_requests, "workload.warmup_requests", 0)
        self.num_tenants = check_int(num_tenants, "workload.num_tenants", 1)
        self.seed = check_int(seed, "workload.seed", 0)
        self._reset()

    def _reset(self) -> None:
        s, n = self.seed, self.num_clients
        self._prompts = [self.prompt_len.stream(rng(s, PROMPT, c)) for c in range(n)]
        self._outputs = [self.output_len.stream(rng(s, OUTPUT, c)) for c in range(n)]
        self._think = [rng(s, THINK, c) for c in range(n)]
        self._client_of: dict[str, int] = {}
        self.num_issued = 0

    def _done(self, t: float) -> bool:
        return (self.num_requests is not None and self.num_issued >= self.num_requests) or \
            (self.duration_s is not None and t > self.duration_s)

    def _issue(self, c: int, t: float) -> Request:
        k = self.num_issued
        self.num_issued += 1
        req = Request(id=f"r{k}", arrival_s=t, prompt_len=next(self._prompts[c]), max_new_tokens=next(self._outputs[c]),
                      tenant=tenant_name(c % self.num_tenants, self.num_tenants), warmup=k < self.warmup_requests)
        self._client_of[req.id] = c
        return req

    def initial(self) -> Iterator[Request]:
        self._reset()
        for c in range(self.num_clients):
            if self._done(c * self.stagger_s):
                return
            yield self._issue(c, c * self.stagger_s)

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        c = self._client_of.pop(state.id, None)
        if c is None:
            raise ValueError(f"closed loop: request {state.id!r} was not issued by this workload (or ended twice)")
        t = now + draw_think(self._think[c], self.think_time_s, self.think)
        if state.status is Status.REJECTED and t <= now:
            # rejected on arrival: retry a moment later, so a client whose requests can never be served cannot
            # spin forever at one simulated instant (time must advance towards duration_s)
            t = now + REJECT_RETRY_S
        return None if self._done(t) else self._issue(c, t)
