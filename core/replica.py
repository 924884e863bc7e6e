"""One serving replica: waiting queue + running set + KV cache + a Scheduler plugin.

Both backends drive it with the same loop::

    batch = replica.schedule(now)
    out = executor.execute(batch)              # cost model, or a real forward pass
    replica.apply(batch, out.tokens, now + out.duration_s)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from core.batch import Batch
from core.interfaces import ReplicaView, Scheduler
from core.kv_cache import KVCacheManager
from core.prompt import block_hashes
from core.request import Request, RequestState, Status

OnTerminal = Callable[[RequestState, float], None]


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step budgets every scheduler must respect, and request limits the replica enforces."""

    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # sequences in one step / running at once
    max_model_len: int = 4096  # prompt + output tokens of one request
    request_timeout_s: float | None = None  # a request not finished this long after arrival is TIMED_OUT
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # empty: generate exactly max_new_tokens
    vocab_size: int | None = None  # when set, explicit prompt token ids must lie in [0, vocab_size)

    def __post_init__(self) -> None:
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"scheduler.{key} must be >= 1, got {getattr(self, key)}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 or null, got {self.request_timeout_s}")


class SchedulerView:
    """What a Scheduler sees and may do during one ``schedule`` call."""

    def __init__(self, replica: Replica, now: float) -> None:
        self._replica = replica
        self.now = now
        self.waiting: deque[RequestState] = replica.waiting
        self.running: list[RequestState] = replica.running
        self.limits = replica.limits
        self.kv = replica.kv
        self.preempted: list[str] = []
        # A scheduler that cannot place a waiting request even on an idle replica names it here; the replica
        # then rejects it (default: the head of the queue) instead of idling forever.
        self.blocked: RequestState | None = None

    def lookup(self, state: RequestState) -> int:
        """Tokens of a waiting request the prefix cache would skip (no side effects)."""
        return self.kv.lookup(state)

    def admit(self, state: RequestState, num_tokens: int) -> bool:
        """Move a waiting request to running with its cached prefix plus room for ``num_tokens`` new tokens.
        Returns False, changing nothing, when the KV pool cannot hold them."""
        if not self.kv.admit(state, num_tokens, self.now):
            return False
        self.waiting.remove(state)
        self.running.append(state)
        if state.first_scheduled_s is None:
            # max(): SimPy's float clock can land an ulp before an arrival time it was asked to reach
            state.first_scheduled_s = max(self.now, state.request.arrival_s)
            state.num_cached_tokens = state.num_computed_tokens
        state.status = Status.RUNNING
        return True

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens of a running request. False (no change) if the pool is full."""
        return self.kv.allocate(state, num_tokens, self.now)

    def preempt(self, state: RequestState) -> None:
        """Recompute preemption: drop the running request's KV and put it at the head of the waiting queue."""
        self.running.remove(state)
        self.kv.free(state, self.now)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = Status.PREEMPTED
        self.waiting.appendleft(state)
        self.preempted.append(state.id)


class Replica:
    def __init__(self, index: int, scheduler: Scheduler, kv: KVCacheManager, limits: SchedulerLimits,
                 on_terminal: OnTerminal | None = None) -> None:
        self.index = index
        self.scheduler = scheduler
        self.kv = kv
        self.limits = limits
        self.on_terminal: OnTerminal = on_terminal or (lambda state, now: None)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._view = SchedulerView(self, 0.0)
        self._last_hashed: tuple[Request | None, list[int]] = (None, [])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- requests in ---------------------------------------------------------------------------------------
    def add(self, request: Request, now: float) -> RequestState:
        """Queue a request, or reject it now (with a reason) if this replica can never serve it."""
        state = RequestState(request, replica=self.index)
        total = request.prompt_len + request.max_new_tokens
        reason = ""
        if total > self.limits.max_model_len:
            reason = (f"prompt_len {request.prompt_len} + max_new_tokens {request.max_new_tokens} = {total} "
                      f"exceeds max_model_len {self.limits.max_model_len}")
        elif self.kv.blocks_for(total - 1) > self.kv.num_blocks:
            reason = (f"needs {self.kv.blocks_for(total - 1)} KV blocks of {self.kv.block_size} tokens; "
                      f"the pool has {self.kv.num_blocks}")
        elif self.limits.vocab_size is not None and request.prompt_token_ids is not None and (
                min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= self.limits.vocab_size):
            reason = f"prompt token ids outside the vocabulary [0, {self.limits.vocab_size})"
        if reason:
            self._end(state, Status.REJECTED, now, reason)
            return state
        state.block_hashes = self._hashes(request)
        self.waiting.append(state)
        return state

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Batch:
        if self.limits.request_timeout_s is not None:
            self._expire(now)
        view = self._view  # one object reused every step (cheaper than building one per step)
        view.now, view.preempted, view.blocked = now, [], None
        batch = self.scheduler.schedule(view)
        batch.preempted = view.preempted
        self._validate(batch)
        if batch.empty and not self.running and self.waiting:
            # Nothing runs and nothing will free memory: the blocked request can never be scheduled.
            stuck = view.blocked if view.blocked in self.waiting else self.waiting[0]
            self.waiting.remove(stuck)
            self._end(stuck, Status.REJECTED, now,
                      f"scheduler {type(self.scheduler).__name__} could not schedule it on an idle replica")
        return batch

    def apply(self, batch: Batch, tokens: list[int], end_s: float) -> None:
        """Advance every chunk, append sampled tokens, finish requests, release their blocks."""
        sampled = iter(tokens)
        finished = False
        eos = self.limits.eos_token_ids
        bs = self.kv.block_size
        for ch in batch.chunks:
            state = ch.state
            state.num_computed_tokens = ch.end
            if ch.start < len(state.block_hashes) * bs:  # only chunks inside the prompt's full blocks can publish
                self.kv.register_computed(state, end_s)
            if not ch.samples:
                continue
            tok = next(sampled, None)
            if tok is None:
                raise RuntimeError(f"executor returned {len(tokens)} tokens; the batch samples more")
            state.output_token_ids.append(tok)
            state.token_times.append(end_s)
            if state.first_token_s is None:
                state.first_token_s = end_s
            if len(state.output_token_ids) >= state.request.max_new_tokens or tok in eos:
                state.status = Status.FINISHED
                finished = True
        if next(sampled, None) is not None:
            raise RuntimeError(f"executor returned {len(tokens)} tokens; the batch samples fewer")
        if finished:
            done = [s for s in self.running if s.status is Status.FINISHED]
            self.running[:] = [s for s in self.running if s.status is not Status.FINISHED]
            for state in done:
                self._end(state, Status.FINISHED, end_s)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _end(self, state: RequestState, status: Status, now: float, reason: str = "") -> None:
        state.status = status
        state.finish_s = now
        state.reason = reason
        self.kv.free(state, now)
        self.on_terminal(state, now)

    def _expire(self, now: float) -> None:
        deadline = now - self.limits.request_timeout_s
        for queue in (self.waiting, self.running):
            late = [s for s in queue if s.request.arrival_s < deadline]
            for state in late:
                queue.remove(state)
                self._end(state, Status.TIMED_OUT, now, f"not finished {self.limits.request_timeout_s}s after arrival")

    def _validate(self, batch: Batch) -> None:
        """Reject a plugin's batch that breaks a budget or runs a request without room for its tokens."""
        f = batch.features
        name = type(self.scheduler).__name__
        if f.num_batched_tokens > self.limits.max_num_batched_tokens:
            raise RuntimeError(f"{name}: {f.num_batched_tokens} tokens > max_num_batched_tokens "
                               f"{self.limits.max_num_batched_tokens}")
        if f.num_seqs > self.limits.max_num_seqs:
            raise RuntimeError(f"{name}: {f.num_seqs} sequences > max_num_seqs {self.limits.max_num_seqs}")
        seen = set()
        tables, bs, running = self.kv._tables, self.kv.block_size, Status.RUNNING
        for ch in batch.chunks:
            state = ch.state
            if state.status is not running or state.id in seen:
                raise RuntimeError(f"{name}: request {state.id} is {state.status.name} or scheduled twice")
            seen.add(state.id)
            if len(tables[state.id]) * bs < ch.end:
                raise RuntimeError(f"{name}: request {state.id} scheduled to token {ch.end} without KV blocks")

    def view(self) -> ReplicaView:
        return ReplicaView(
            index=self.index, num_waiting=len(self.waiting), num_running=len(self.running),
            num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
            pending_tokens=self._pending_tokens, cached_prefix_len=self.cached_prefix_len)

    def _pending_tokens(self) -> tuple[int, int]:
        """(prefill tokens, output tokens) still to compute over waiting + running requests."""
        prefill = decode = 0
        for queue in (self.waiting, self.running):
            for s in queue:
                prefill += s.num_remaining_tokens if s.in_prefill else 0
                decode += s.request.max_new_tokens - len(s.output_token_ids)
        return prefill, decode

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of ``request``'s prompt cached on this replica (pure lookup, for routers)."""
        return self.kv.lookup(RequestState(request, block_hashes=self._hashes(request)))

    def _hashes(self, request: Request) -> list[int]:
        """Block hashes of a request, memoised for the last request seen: a router's lookup and the
        following ``add`` of the same request hash its prompt once."""
        if self._last_hashed[0] is not request:
            self._last_hashed = (request, block_hashes(request, self.kv.block_size))
        return self._last_hashed[1]
