"""Decode fast-forward: runs of pure-decode steps that provably cannot change a replica's schedule, without calling
the scheduler, the executor or ``Replica.apply`` for each of them.

When, after a step, every running request of a replica is in decode (its next chunk is one token), its scheduler
promises that such a state repeats itself and says in which order it decodes (``SteadyDecodeScheduler``), and its
executor predicts decode steps (``Executor.predicts_decodes``: the simulator's cost-model executor), the next steps
are known in advance: the same decodes, each request one token further, each step reading ``num_seqs`` more KV
tokens. A ``DecodeRun`` then stands for those steps:

- step times come from ``Executor.forecast_decodes`` (vectorised over the growing context, bit-identical to
  ``execute``);
- the KV allocations the scheduler would make (a request crossing a block boundary) are made at the same step
  start, in the scheduler's order, with the same clock reading, so the pool, the eviction policy and the prefix
  cache evolve exactly as per step;
- output tokens and token times are filled in bulk (``sync``, through ``RequestState.add_tokens``), when someone
  needs them: when the run ends, and when a router reads the replica (``Replica.view``).

The run still takes one clock event per step, created when the per-step loop would create it, and appends one
step record per step when that event fires (a simulated clock calls ``DecodeRun.advance`` from its event loop,
``core.loop.Decodes``; another clock gets one ``Sleep`` per step): the clock's order of events -- between replicas
whose steps end at the same float time, between a step and an arrival -- stays exactly the per-step order, so
steps.csv, every router decision and every closed-loop follow-up are byte-identical to a per-step run. What a step
costs is then a heap push and pop and two appends (its end time, its place in the step log: the run's steps are
one ``core.records.DecodeSteps``) instead of scheduling, pricing, applying and recording a batch. (One event
per *run* instead would lose that order: two replicas in lockstep end steps at equal float times, and which comes
first -- hence the order of steps.csv rows -- depends on when each step's event was created.)

Horizon. Before each step ``m`` of the run (at the moment the per-step loop would call ``schedule``) the run checks
what could make ``schedule`` decide differently, and ends (the replica materialises its tokens and goes back to
per-step) when any holds:

- a request would finish at the end of step m (``max_new_tokens``, or the executor's token is one of its stop ids
  past ``min_tokens``): that step is run per step, so ``apply`` finishes it and ``on_terminal`` fires as usual;
- the waiting queue changed (a request was dispatched to this replica), an abort is pending or a transferred
  request was adopted: the replica tells its run (``DecodeRun.interrupt``) when any of these happens;
- a request (waiting or running) would time out at this step's start (``request_timeout_s``, same comparison as
  ``Replica._expire``);
- the step's KV allocations do not all fit in the free (plus evictable) blocks: the scheduler would preempt.

Arrivals routed to *other* replicas do not end a run: the router reads this replica through ``Replica.view``, which
first syncs the run (tokens of the steps completed so far), so it sees exactly the per-step state.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from core.batch import StepFeatures
from core.interfaces import Executor
from core.kv_cache import KVCacheManager
from core.records import DecodeSteps, StepLog
from core.request import RequestState

FIRST_CHUNK = 64  # steps priced by the first Executor.forecast_decodes call; each further call doubles, up to MAX_CHUNK
MAX_CHUNK = 1024


def decode_features(first: StepFeatures, m: int) -> StepFeatures:
    """Step ``m`` of a decode run whose step 0 has features ``first``: every sequence one token further."""
    n = first.num_decode_seqs
    return StepFeatures(n, n, 0, 0, n, 0, first.kv_tokens_read + m * n, 0, first.max_context_len + m, 0,
                        first.max_decode_context + m, first.min_decode_context + m)


class DecodeRun:
    """Steps of a replica in steady decode, from the moment a step was applied after which every running request
    decodes, in the scheduler's ``order`` (see the module docstring). ``core.loop`` drives it: ``begin`` before
    the first step, ``advance(now)`` when a step's clock event fires (it records that step, one int in the step
    log, and starts the next: its duration, or None: the run ends); ``Replica.end_decode_run`` then ``close``
    end it."""

    __slots__ = ("states", "first", "executor", "kv", "interrupted", "timeout", "min_arrival", "limit",
                 "token", "durations", "ends", "synced", "m", "used_blocks", "record", "_row",
                 "_allocs", "_next_alloc", "_until", "_bs")

    def __init__(self, kv: KVCacheManager, waiting: Sequence[RequestState], timeout_s: float | None,
                 order: Sequence[RequestState], executor: Executor, limit: int) -> None:
        """``kv``, ``waiting``, ``timeout_s``: the replica's KV pool, waiting queue and request timeout."""
        self.executor, self.kv = executor, kv
        self.states = states = list(order)  # the order the scheduler decodes and allocates in (steady_decode)
        n = len(states)
        ctx = [s.num_computed_tokens + 1 for s in states]  # each next decode attends to its context and itself
        self.first = StepFeatures(n, n, 0, 0, n, 0, sum(ctx), 0, max(ctx), 0, max(ctx), min(ctx))
        run = executor.forecast_decodes(self.first, min(FIRST_CHUNK, limit))
        self.durations: list[float] = list(run.durations)
        self.token = run.token
        if any(self.token in s.stop_token_ids for s in states):
            limit = min(limit, finish_limit(states, self.token))
        self.limit = limit
        self.interrupted = False  # set by the replica (``interrupt``)
        self.timeout = timeout = timeout_s
        self.min_arrival = (min(s.request.arrival_s for s in (*states, *waiting)) if timeout is not None
                            else 0.0)
        self.ends: list[float] = []  # end time of each completed step (shared with the step log's record)
        self.synced = 0  # completed steps whose tokens are in the request states
        self.m = 0  # the next step to start (= steps started so far)
        # (step, chunk index): the next step at which a request needs a new KV block -- per step the scheduler
        # allocates room for context c + m + 1 tokens, which a table of b blocks holds while c + m + 1 <= b * size
        bs = self._bs = self.kv.block_size
        held = self.kv.num_blocks_held
        allocs = [(held(s.id) * bs - s.num_computed_tokens, i) for i, s in enumerate(states)]
        self._allocs = [a for a in allocs if a[0] < limit]
        heapq.heapify(self._allocs)
        self._next_alloc = self._allocs[0][0] if self._allocs else limit
        # the first step at which advance has more to do than the timeout check: the run's limit, an allocation,
        # or the end of the priced durations (one comparison a step for all three)
        self._until = min(limit, self._next_alloc, len(self.durations))
        self.used_blocks = self.kv.num_used_blocks  # changes only by this run's allocations while it lasts

    def begin(self, index: int, steps: StepLog, now: float) -> float | None:
        """Start the run at clock ``now`` on replica ``index``, its steps going to ``steps`` (as one
        ``DecodeSteps``): the first step's duration, or None (the run does not even start)."""
        first = self.first
        self.record = DecodeSteps(index, first.num_seqs, first.kv_tokens_read, first.max_context_len,
                                  first.max_decode_context, first.min_decode_context, now,
                                  [(0, self.used_blocks)], self.ends, self.durations)
        self._row = steps.add_run(self.record)
        return self.advance(now)

    def advance(self, now: float) -> float | None:
        """Step ``self.m`` starts at clock ``now``, where the previous step (if any) ended: that one is recorded;
        returns the new step's duration, its KV allocations made, or None: the run is over (the replica goes back
        to schedule / execute / apply at this very moment). The clock calls it once a step: the common case is a
        timeout check and one comparison, the rest is in ``_horizon``."""
        m = self.m
        if m:
            self.ends.append(now)
            self._row()
        if self.timeout is not None and self.min_arrival < now - self.timeout:  # as Replica._expire compares
            return None
        if m >= self._until and not self._horizon(m, now):
            return None
        self.m = m + 1
        return self.durations[m]

    def interrupt(self) -> None:
        """The replica's queues changed (an arrival, an abort, an adopted request): the run ends before its next
        step, where the per-step loop's ``schedule`` would see the change."""
        self.interrupted = True
        self._until = 0  # the next advance goes through _horizon

    def close(self) -> None:
        """The run is over and its tokens synced: its step log entry shrinks to its final size; the executor learns
        how many of its priced steps were taken."""
        self.record.close()
        self.executor.decodes_taken(self.m)

    def _horizon(self, m: int, now: float) -> bool:
        """Step m is where the run may end, allocate KV or run out of priced steps: False if it ends, else the
        allocations made, the durations priced ahead, and the next such step found."""
        if m >= self.limit or self.interrupted:
            return False
        if m == self._next_alloc and not self._allocate(m, now):
            return False
        durations = self.durations
        if m >= len(durations):
            size = min(max(FIRST_CHUNK, min(2 * len(durations), MAX_CHUNK)), self.limit - m)
            durations.extend(self.executor.forecast_decodes(decode_features(self.first, m), size).durations)
        self._until = min(self.limit, self._next_alloc, len(durations))
        return True

    def _allocate(self, m: int, now: float) -> bool:
        """The blocks the scheduler would allocate at step m (requests whose next token starts a block), in chunk
        order; False (nothing allocated) if they do not all fit: the scheduler would preempt."""
        allocs = self._allocs
        due = []
        while allocs and allocs[0][0] == m:
            due.append(heapq.heappop(allocs)[1])  # (m, chunk index) pairs pop in chunk order
        if len(due) > self.kv.num_free_blocks:
            return False
        lag = m - self.synced  # tokens computed since the last sync, not yet in num_computed_tokens
        allocate, states, nxt = self.kv.allocate, self.states, m + self._bs
        for i in due:
            state = states[i]
            ok = allocate(state, lag + 1, now)
            assert ok, f"fast-forward: allocation for {state.id} failed although blocks were free"
            if nxt < self.limit:
                heapq.heappush(allocs, (nxt, i))
        self.used_blocks += len(due)
        blocks = self.record.blocks  # from step m on (an allocation at step 0 replaces the initial count)
        if blocks[-1][0] == m:
            blocks.pop()
        blocks.append((m, self.used_blocks))
        self._next_alloc = allocs[0][0] if allocs else self.limit
        return True

    def sync(self) -> None:
        """Put the tokens of the completed steps into the request states (bulk append)."""
        done, synced = len(self.ends), self.synced
        k = done - synced
        if k <= 0:
            return
        times, toks = self.ends[synced:done], [self.token] * k
        for state in self.states:
            state.add_tokens(toks, times)
            state.num_computed_tokens += k
        self.synced = done


def finish_limit(states: Sequence[RequestState], token: int | None = None) -> int:
    """Steps (from the next) that end no request: step m gives each request its output number o + m + 1, which
    finishes it at ``max_new_tokens``, or when ``token`` is one of its stop ids and it has more than ``min_tokens``
    outputs (as ``Replica.apply`` decides)."""
    limit = None
    for s in states:
        o, r = len(s.output_token_ids), s.request
        m = r.max_new_tokens - o - 1
        if token is not None and token in s.stop_token_ids:
            m = min(m, max(0, r.min_tokens - o))
        if limit is None or m < limit:
            limit = m
    return max(limit or 0, 0)
