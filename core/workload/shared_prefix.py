"""Prefix-sharing workloads: groups sharing a system prompt, and multi-turn sessions.

Shared content is expressed with ``Request.hash_ids``: each id stands for ``tokens_per_hash_id`` fixed
pseudo-random tokens (``core.prompt``), equal ids mean equal tokens, and unshared content gets fresh ids
from the workload's counter. Sharing is exact at the token level: a shared segment always ends on an id
boundary (the id size is shrunk to gcd(tokens_per_hash_id, segment length) where needed), and a session's
turns are prefixes of one token stream, so a partial last id of one turn is the same id, with the same
leading tokens, in the next turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.checks import check_choice, check_float, check_int
from core.request import Request, RequestState, Status
from core.workload.arrivals import TraceArrivals, make_arrivals
from core.workload.base import (
    ARRIVALS,
    GROUP,
    OUTPUT,
    PROMPT,
    SESSION,
    IdCounter,
    OpenLoop,
    blocks,
    bounded,
    check_bound,
    check_think,
    content_block_size,
    draw_think,
    rng,
    tenant_name,
)
from core.workload.lengths import make_length

ASSIGNMENTS = ("random", "round_robin")


class SharedPrefixWorkload(OpenLoop):
    """``num_groups`` system prompts of ``prefix_len`` tokens; each request = its group's prompt + a unique suffix.

    Group g belongs to tenant g % num_tenants (tenants never share KV). Requests pick a group at random
    with weights 1 / (g + 1) ** zipf_s (0: uniform) or ``round_robin``. Bounds as in SyntheticWorkload.
    """

    def __init__(self, arrival: Mapping[str, Any], num_groups: int, prefix_len: int,
                 suffix_len: Mapping[str, Any] | int, output_len: Mapping[str, Any] | int,
                 num_requests: int | None = None, duration_s: float | None = None, warmup_requests: int = 0,
                 num_tenants: int = 1, assignment: str = "random", zipf_s: float = 0.0, tokens_per_hash_id: int = 16,
                 seed: int = 0) -> None:
        check_choice(assignment, "workload.assignment", ASSIGNMENTS)
        self.arrival = make_arrivals(arrival)
        check_bound(num_requests, duration_s, required=not isinstance(self.arrival, TraceArrivals))
        self.num_groups = check_int(num_groups, "workload.num_groups", 1)
        self.prefix_len = check_int(prefix_len, "workload.prefix_len", 1)
        self.suffix_len = make_length(suffix_len, "suffix_len", minimum=0)
        self.output_len = make_length(output_len, "output_len")
        self.num_requests, self.duration_s = num_requests, duration_s
        self.warmup_requests = check_int(warmup_requests, "workload.warmup_requests", 0)
        self.num_tenants = check_int(num_tenants, "workload.num_tenants", 1)
        self.assignment = assignment
        w = 1.0 / np.arange(1, self.num_groups + 1) ** check_float(zipf_s, "workload.zipf_s")
        self.group_weights = w / w.sum()
        tokens_per_hash_id = check_int(tokens_per_hash_id, "workload.tokens_per_hash_id", 1)
        self.block = content_block_size(tokens_per_hash_id, self.prefix_len)
        self.seed = check_int(seed, "workload.seed", 0)

    def group_ids(self, g: int) -> tuple[int, ...]:
        nb = self.prefix_len // self.block
        return tuple(range(g * nb, (g + 1) * nb))

    def initial(self) -> Iterator[Request]:
        s = self.seed
        counter = IdCounter(self.num_groups * (self.prefix_len // self.block))
        suffixes, outputs = self.suffix_len.stream(rng(s, PROMPT)), self.output_len.stream(rng(s, OUTPUT))
        picks = rng(s, GROUP)
        for i, t in bounded(self.arrival.times(rng(s, ARRIVALS)), self.num_requests, self.duration_s):
            g = i % self.num_groups if self.assignment == "round_robin" else \
                int(picks.choice(self.num_groups, p=self.group_weights))
            n_suffix = next(suffixes)
            yield Request(id=f"r{i}", arrival_s=t, prompt_len=self.prefix_len + n_suffix, max_new_tokens=next(outputs),
                          hash_ids=self.group_ids(g) + counter.take(blocks(n_suffix, self.block)),
                          tokens_per_hash_id=self.block, tenant=tenant_name(g % self.num_tenants, self.num_tenants),
                          warmup=i < self.warmup_requests)


@dataclass
class _Session:
    index: int
    turns: int
    tenant: str
    warmup: bool
    rng: np.random.Generator
    ids: list[int] = field(default_factory=list)  # content ids of the session's token stream so far
    turn: int = 0


class MultiTurnWorkload:
    """Chat sessions: turn t+1's prompt = turn t's prompt + turn t's answer + a new user message.

    Sessions start by the ``arrival`` process (``num_sessions`` and/or ``duration_s`` bound the starts);
    each has ``num_turns`` turns (an int or a length spec). Turn 1's prompt = an optional system prompt of
    ``system_prompt_len`` tokens shared by all sessions of a tenant + a user message. A later turn arrives
    ``think`` time after the previous answer ends, so turns come from ``on_finish``. The answer's length in
    the next prompt is the number of tokens actually generated. A session ends early when a turn does not
    finish (rejected / timed out: the user leaves) or when the next prompt would exceed ``max_prompt_len``.
    All turns of the first ``warmup_sessions`` sessions are warmup. Session s belongs to tenant
    s % num_tenants. Request ids are ``s{session}t{turn}``.
    """

    def __init__(self, arrival: Mapping[str, Any], user_len: Mapping[str, Any] | int,
                 output_len: Mapping[str, Any] | int, num_turns: Mapping[str, Any] | int = 4,
                 num_sessions: int | None = None, duration_s: float | None = None, system_prompt_len: int = 0,
                 think_time_s: float = 0.0, think: str = "fixed", max_prompt_len: int | None = None,
                 warmup_sessions: int = 0, num_tenants: int = 1, tokens_per_hash_id: int = 16, seed: int = 0) -> None:
        self.arrival = make_arrivals(arrival)
        check_bound(num_sessions, duration_s, "num_sessions", required=not isinstance(self.arrival, TraceArrivals))
        self.user_len = make_length(user_len, "user_len")
        self.output_len = make_length(output_len, "output_len")
        self.num_turns = make_length(num_turns, "num_turns")
        self.num_sessions, self.duration_s = num_sessions, duration_s
        self.system_prompt_len = check_int(system_prompt_len, "workload.system_prompt_len", 0)
        self.think_time_s, self.think = check_think(think_time_s, think), think
        self.max_prompt_len = (None if max_prompt_len is None
                               else check_int(max_prompt_len, "workload.max_prompt_len", 1))
        self.warmup_sessions = check_int(warmup_sessions, "workload.warmup_sessions", 0)
        self.num_tenants = check_int(num_tenants, "workload.num_tenants", 1)
        tokens_per_hash_id = check_int(tokens_per_hash_id, "workload.tokens_per_hash_id", 1)
        self.block = content_block_size(tokens_per_hash_id, self.system_prompt_len)
        self.seed = check_int(seed, "workload.seed", 0)
        self._live: dict[str, _Session] = {}
        self._counter = IdCounter()

    def _request(self, sess: _Session, prompt_len: int, arrival_s: float) -> Request | None:
        if self.max_prompt_len is not None and prompt_len > self.max_prompt_len:
            return None
        need = blocks(prompt_len, self.block)
        if need > len(sess.ids):
            sess.ids.extend(self._counter.take(need - len(sess.ids)))
        req = Request(id=f"s{sess.index}t{sess.turn}", arrival_s=arrival_s, prompt_len=prompt_len,
                      max_new_tokens=int(self.output_len.sample(sess.rng, 1)[0]), hash_ids=tuple(sess.ids[:need]),
                      tokens_per_hash_id=self.block, tenant=sess.tenant, warmup=sess.warmup)
        self._live[req.id] = sess
        return req

    def initial(self) -> Iterator[Request]:
        self._live.clear()
        n_sys = self.system_prompt_len // self.block
        self._counter = IdCounter(self.num_tenants * n_sys)  # ids below this: the tenants' system prompts
        for i, t in bounded(self.arrival.times(rng(self.seed, ARRIVALS)), self.num_sessions, self.duration_s):
            g = rng(self.seed, SESSION, i)
            k = i % self.num_tenants
            sess = _Session(i, int(self.num_turns.sample(g, 1)[0]), tenant_name(k, self.num_tenants),
                            i < self.warmup_sessions, g, ids=list(range(k * n_sys, (k + 1) * n_sys)))
            req = self._request(sess, self.system_prompt_len + int(self.user_len.sample(g, 1)[0]), t)
            if req is not None:
                yield req

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        sess = self._live.pop(state.id, None)
        if sess is None:
            raise ValueError(f"multi-turn: request {state.id!r} was not issued by this workload (or ended twice)")
        sess.turn += 1
        if state.status is not Status.FINISHED or sess.turn >= sess.turns:
            return None
        n = state.request.prompt_len + state.num_output_tokens + int(self.user_len.sample(sess.rng, 1)[0])
        return self._request(sess, n, now + draw_think(sess.rng, self.think_time_s, self.think))
