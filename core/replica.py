"""One serving replica: waiting queue + running set + KV cache + a Scheduler plugin.

Both backends drive it with the same loop::

    batch = replica.schedule(now)
    out = executor.execute(batch)              # cost model, or a real forward pass
    replica.apply(batch, out.tokens, now + out.duration_s)
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable

from core.batch import Batch
from core.fast_forward import DecodeRun, finish_limit
from core.interfaces import (
    PREEMPTION_MODES,
    SWAP,
    Executor,
    PreemptionPolicy,
    ReplicaView,
    Scheduler,
    SchedulerLimits,
    SchedulerView,
    SpeculationPolicy,
    SteadyDecodeScheduler,
)
from core.kv_cache import KVCacheManager
from core.prompt import block_hashes
from core.request import Request, RequestState, Status

OnTerminal = Callable[[RequestState, float], None]

# SchedulerLimits and the SchedulerView Protocol are defined in core.interfaces; they stay importable from here.
__all__ = ["OnTerminal", "Replica", "ReplicaSchedulerView", "SchedulerLimits", "SchedulerView"]


class ReplicaSchedulerView:
    """The ``SchedulerView`` a Replica hands its Scheduler: one object reused every step, holding the replica's
    queues and (privately) its KV cache manager."""

    __slots__ = ("now", "waiting", "running", "limits", "preempted", "blocked", "block_size", "_kv", "_allocate",
                 "_speculation", "_preemption")

    def __init__(self, replica: Replica, now: float) -> None:
        self.now = now
        self.waiting: deque[RequestState] = replica.waiting
        self.running: list[RequestState] = replica.running
        self.limits: SchedulerLimits = replica.limits
        self.preempted: list[str] = []
        self.blocked: RequestState | None = None  # see SchedulerView.blocked
        self.block_size: int = replica.kv.block_size
        self._kv = replica.kv
        self._allocate = replica.kv.allocate  # bound once: allocate() runs for every running request every step
        self._speculation = replica.speculation
        self._preemption = replica.preemption

    @property
    def num_free_blocks(self) -> int:
        return self._kv.num_free_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return 0 if self._kv.host is None else self._kv.host.num_free_blocks

    def lookup(self, state: RequestState) -> int:
        """Tokens of a waiting request the prefix cache would skip (no side effects)."""
        return self._kv.lookup(state)

    def admit(self, state: RequestState, num_tokens: int, fit_tokens: int = 0) -> bool:
        """Move a waiting request to running with its cached prefix plus room for ``num_tokens`` new tokens.
        Returns False, changing nothing, when the KV pool cannot hold them (or ``fit_tokens`` in all; see
        SchedulerView.admit)."""
        if not self._kv.admit(state, num_tokens, self.now, fit_tokens):
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
        return self._allocate(state, num_tokens, self.now)

    def preempt(self, state: RequestState) -> None:
        """Preempt a running request to the head of the waiting queue, by swap or recompute as the replica's
        ``PreemptionPolicy`` says (recompute without one, or when the host tier has no room)."""
        self.running.remove(state)
        if not self._swap_out(state):
            self._kv.free(state, self.now)
            state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = Status.PREEMPTED
        self.waiting.appendleft(state)
        self.preempted.append(state.id)

    def _swap_out(self, state: RequestState) -> bool:
        """True if the preemption policy chose swap and the host tier took the request's blocks."""
        if self._preemption is None or self._kv.host is None:
            return False
        mode = self._preemption.mode(state, self)
        if mode not in PREEMPTION_MODES:
            raise RuntimeError(f"{type(self._preemption).__name__}.mode returned {mode!r}; "
                               f"allowed: {list(PREEMPTION_MODES)}")
        return mode == SWAP and self._kv.swap_out(state, self.now)

    def num_draft_tokens(self, state: RequestState) -> int:
        """Draft tokens for a decode of ``state`` this step (0 without a speculation policy); see SchedulerView."""
        if self._speculation is None:
            return 0
        asked = self._speculation.num_draft_tokens(state, len(self.running))
        try:
            k = operator.index(asked)  # an int (or a NumPy one): a float or None is a bug, not a draft count
        except TypeError:
            k = -1
        if k < 0:
            raise RuntimeError(f"{type(self._speculation).__name__}.num_draft_tokens returned {asked!r}; allowed: "
                               "an integer >= 0")
        # a draft past the last output is never used; nor may a position pass max_model_len (the state's
        # tokens + 1 decode + k drafts, minus the last output, which is never fed back)
        left = min(state.request.max_new_tokens - len(state.output_token_ids),
                   self.limits.max_model_len - state.num_tokens) - 1
        return max(0, min(k, left))


class Replica:
    def __init__(self, index: int, scheduler: Scheduler, kv: KVCacheManager, limits: SchedulerLimits,
                 on_terminal: OnTerminal | None = None, speculation: SpeculationPolicy | None = None,
                 preemption: PreemptionPolicy | None = None, stamp_receipt: bool = False) -> None:
        self.index = index
        self.scheduler = scheduler
        self.speculation = speculation  # speculative decoding: draft tokens per decode (None: off)
        self.preemption = preemption  # swap or recompute per victim (None: recompute); needs kv.host to swap
        self.kv = kv
        self.limits = limits
        self.on_terminal: OnTerminal = on_terminal or (lambda state, now: None)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._view = ReplicaSchedulerView(self, 0.0)
        self._last_hashed: tuple[Request | None, list[int]] = (None, [])
        self._aborts: dict[str, tuple[RequestState, Status, str]] = {}  # running requests to end at next schedule()
        self._async = bool(getattr(scheduler, "async_scheduling", False))  # vLLM's step-ahead scheduling (below)
        self._queued_s = {}
        # requests added since the last schedule(), to stamp received_s there (None: not stamped)
        self._unreceived: list[RequestState] | None = [] if stamp_receipt else None


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
        state.stop_token_ids = self._stop_ids(request)
        if self._async:
            self._queued_s[state.id] = now
        if self._unreceived is not None:
            self._unreceived.append(state)
        self.waiting.append(state)
        self._interrupt_decode_run()
        return state

    def abort(self, request_id: str, now: float, reason: str = "cancelled") -> RequestState | None:
        """Cancel a request (the client went away, the server cancelled it): it ends CANCELLED (``end_early``)."""
        return self.end_early(request_id, now, Status.CANCELLED, reason)

    def finish_early(self, request_id: str, now: float, reason: str) -> RequestState | None:
        """A request's answer is complete before the replica saw it end (a server matched a stop string in its
        text): it ends FINISHED (``end_early``)."""
        return self.end_early(request_id, now, Status.FINISHED, reason)

    def end_early(self, request_id: str, now: float, status: Status, reason: str) -> RequestState | None:
        """End a request before it ran to its end, with the terminal ``status`` and ``reason``.

        A waiting or preempted request ends now (it leaves the queue; it holds no KV). A running one is marked and
        ends at the start of this replica's next ``schedule()``, which frees its KV blocks and calls
        ``on_terminal``: on a real-time clock this runs between steps, possibly while a step that includes the
        request is in flight (between ``execute`` and ``apply``), and ``apply`` must never see a request whose
        blocks were freed. That step's token is still appended; if it finishes the request (EOS, stop id, length),
        it ends FINISHED as usual and the early end is dropped. Returns the request's state, or None for an id this
        replica does not hold (unknown, or already ended). Call it on the loop's thread.
        """
        if not status.terminal:
            raise ValueError(f"end_early: status must be terminal, got {status.name}")
        for state in self.waiting:
            if state.id == request_id:
                self.waiting.remove(state)
                self._interrupt_decode_run()
                self._end(state, status, now, reason)
                return state
        for state in self.running:
            if state.id == request_id:
                self._aborts.setdefault(request_id, (state, status, reason))  # the first early end's status wins
                self._interrupt_decode_run()
                return state
        return None

    # ---- one step ------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> Batch:
        if self._unreceived:  # the loop takes in what arrived while the last step ran (vLLM stamps queued_ts here)
            for state in self._unreceived:
                state.received_s = max(now, state.request.arrival_s)
            self._unreceived.clear()
        if self._adopted:
            self._admit_adopted()
        if self._aborts:
            self._end_aborted(now)
        if self.limits.request_timeout_s is not None:
            self._expire(now)
        view = self._view  # one object reused every step (cheaper than building one per step)
        view.now, view.preempted, view.blocked = now, [], None
        hidden = self._hide_for_async() if self._async else None
        batch = self._schedule_once(view)
        if hidden:
            self.waiting.extend(hidden)
            if batch.empty and not view.preempted:  # nothing in flight to wait behind: vLLM schedules them now
                view.preempted, view.blocked = [], None
                batch = self._schedule_once(view)
        if self._async:
            self._prev_start = now if not batch.empty else math.inf
            for state in batch.chunks:
                self._queued_s.pop(state.state.id, None)
        batch.preempted = view.preempted
        host = self.kv.host
        if host is not None and host.has_copies and not batch.empty:
            batch.copies = host.take_copies()  # an empty batch runs nothing: its copies wait for the next step
        self._validate(batch)
        if batch.empty and not self.running and self.waiting and not self._sending:
            # Nothing runs and nothing will free memory: the blocked request can never be scheduled.
            stuck = view.blocked if view.blocked in self.waiting else self.waiting[0]
            self.waiting.remove(stuck)
            self._end(stuck, Status.REJECTED, now,
                      f"scheduler {type(self.scheduler).__name__} could not schedule it on an idle replica")
        return batch

    def apply(self, batch: Batch, tokens: list[int], end_s: float, num_tokens: list[int] | None = None) -> None:
        """Advance every chunk, append sampled tokens, finish requests, release their blocks.

        ``num_tokens`` (``StepOutput.num_tokens``): tokens per sampling chunk when the step verified drafts; a
        speculative decode with d drafts yields 1 to d + 1 tokens, and KV blocks that only held rejected drafts
        go back to the pool."""
        counts = iter(num_tokens) if num_tokens is not None else None
        pos = 0
        finished = False
        bs = self.kv.block_size
        for ch in batch.chunks:
            state = ch.state
            state.num_computed_tokens = ch.end
            if ch.start < len(state.block_hashes) * bs:  # only chunks inside the prompt's full blocks can publish
                self.kv.register_computed(state, end_s)
            if not ch.samples:
                continue
            n = 1 if counts is None else next(counts, 0)
            if not 1 <= n <= 1 + ch.num_draft_tokens or pos + n > len(tokens):
                raise RuntimeError(f"executor returned {n} tokens for request {state.id} "
                                   f"({ch.num_draft_tokens} drafts; {len(tokens)} tokens in all)")
            drafts = ch.num_draft_tokens
            if drafts:
                state.num_draft_proposed += drafts
                state.num_draft_accepted += n - 1
                state.num_draft_rejections += n <= drafts
                state.num_computed_tokens = ch.end + n - 1  # the accepted drafts' KV is in the cache
            if self._append(state, tokens, pos, n, end_s):
                finished = True
            pos += n
            if drafts:
                self.kv.trim(state, state.num_computed_tokens)  # blocks that held only rejected drafts
        if pos != len(tokens) or (counts is not None and next(counts, None) is not None):
            raise RuntimeError(f"executor returned {len(tokens)} tokens; the batch samples {pos}")
        self._held_seats = 0
        if finished:
            done = [s for s in self.running if s.status is Status.FINISHED]
            self._held_seats = len(done)
            self.running[:] = [s for s in self.running if s.status is not Status.FINISHED]
            for state in done:
                self._end(state, Status.FINISHED, end_s)
        if self.on_prefilled is not None:
            self._hand_off(end_s)

    @staticmethod
    def _append(state: RequestState, tokens: list[int], start: int, n: int, end_s: float) -> bool:
        """Append ``tokens[start:start + n]`` until a stop condition; True when the request finished (tokens
        after the stop are dropped, as a verified draft past EOS is)."""
        out, stop, req = state.output_token_ids, state.stop_token_ids, state.request
        for i in range(start, start + n):
            tok = tokens[i]
            state.add_token(tok, end_s)  # output id, token time, first_token_s
            n = len(out)
            # a stop token (EOS unless ignored, or a stop id) counts after min_tokens others
            if n >= req.max_new_tokens or (tok in stop and n > req.min_tokens):
                state.status = Status.FINISHED
                if state.num_computed_tokens > req.prompt_len + n - 1:  # drafts accepted past the stop
                    state.num_computed_tokens = req.prompt_len + n - 1
                return True
        return False

    # ---- helpers -------------------------------------------------------------------------------------------
    def _end(self, state: RequestState, status: Status, now: float, reason: str = "") -> None:
        state.status = status
        # max(): as for first_scheduled_s, SimPy's float clock can stand an ulp before the arrival it was asked to
        # reach (e.g. the idle-replica rejection right at an arrival); a request never ends before it arrives
        state.finish_s = max(now, state.request.arrival_s)
        state.reason = reason
        if self._async:
            self._queued_s.pop(state.id, None)
        self.kv.free(state, now)
        self.on_terminal(state, now)

    def _end_aborted(self, now: float) -> None:
        """End the running requests ``abort`` marked (unless the last step finished them already)."""
        aborts, self._aborts = self._aborts, {}
        for state, status, reason in aborts.values():
            if state.status.terminal:
                continue
            (self.running if state in self.running else self.waiting).remove(state)
            self._end(state, status, now, reason)

    def _stop_ids(self, request: Request) -> frozenset[int]:
        """The token ids that end ``request``: the model's EOS unless ignored, plus its own stop ids."""
        limits = self.limits
        ignore = limits.ignore_eos if request.ignore_eos is None else request.ignore_eos
        eos = frozenset() if ignore else limits.eos_token_ids
        return eos | frozenset(request.stop_token_ids) if request.stop_token_ids else eos

    def _expire(self, now: float) -> None:
        deadline = now - self.limits.request_timeout_s
        for queue in (self.waiting, self.running):
            late = [s for s in queue if s.request.arrival_s < deadline]
            for state in late:
                queue.remove(state)
                self._end(state, Status.TIMED_OUT, now, f"not finished {self.limits.request_timeout_s}s after arrival")

    def _schedule_once(self, view: ReplicaSchedulerView) -> Batch:
        """The scheduler's batch: an error it raises names it (a note), and what it returns must be a Batch (a list
        or None would fail later, far from its cause)."""
        try:
            batch = self.scheduler.schedule(view)
        except Exception as e:
            e.add_note(f"raised by scheduler {type(self.scheduler).__name__}.schedule on replica {self.index}")
            raise
        if not isinstance(batch, Batch):
            raise RuntimeError(f"{type(self.scheduler).__name__}.schedule returned {type(batch).__name__}, "
                               "not a core.batch.Batch")
        return batch

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
        held, bs, running = self.kv.num_blocks_held, self.kv.block_size, Status.RUNNING
        for ch in batch.chunks:
            state = ch.state
            if state.id in seen:
                raise RuntimeError(f"{name}: request {state.id} scheduled twice in one batch")
            if state.status is not running:
                raise RuntimeError(f"{name}: request {state.id} scheduled while {state.status.name}, not RUNNING")
            seen.add(state.id)
            total = state.request.prompt_len + len(state.output_token_ids)
            if not 0 < ch.num_tokens <= total - ch.start:
                raise RuntimeError(f"{name}: request {state.id} scheduled {ch.num_tokens} tokens from token "
                                   f"{ch.start}; it has {total - ch.start} left to compute (Chunk.next builds one)")
            if held(state.id) * bs < ch.end + ch.num_draft_tokens:
                raise RuntimeError(f"{name}: request {state.id} scheduled to token {ch.end + ch.num_draft_tokens} "
                                   "without KV blocks")

    def view(self) -> ReplicaView:
        if self._decode_run is not None:  # a router reads output counts: bring a fast-forward's tokens in first
            self._decode_run.sync()
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

    # ---- vLLM v1's async scheduling (a scheduler whose ``async_scheduling`` is true) ---------------------------
    # vLLM >= 0.12 schedules step k+1 while step k runs (the engine core queues two batches; AsyncScheduler): the
    # scheduler deciding step k+1 has seen neither the requests that arrived during step k nor the seats that
    # requests finishing in step k free. So a request queued while a step runs joins the batch after the next one,
    # and a finished request's seat is reused one step later. KV blocks are freed as without it (not lagged).
    _prev_start = math.inf  # start of the step that ran last (inf: the replica was idle, so nothing is in flight)
    _held_seats = 0  # requests the last step finished: their seats count once more
    _queued_s: dict[str, float]  # when each waiting request reached this replica

    def _hide_for_async(self) -> list[RequestState]:
        """Take off the waiting queue's tail what the step-ahead scheduler cannot see yet: requests queued after
        the last step started (the tail: new requests are appended, preempted ones go to the head), and beyond the
        seats the last step's finished requests still hold. Returned in order, to be put back after scheduling."""
        waiting, queued = self.waiting, self._queued_s
        seats = max(0, self.limits.max_num_seqs - len(self.running) - self._held_seats)
        k = 0
        for state in waiting:
            if k >= seats or queued.get(state.id, -math.inf) > self._prev_start:
                break
            k += 1
        hidden = []
        while len(waiting) > k:
            hidden.append(waiting.pop())
        hidden.reverse()
        return hidden

    # ---- decode fast-forward (core.fast_forward) -------------------------------------------------------------
    _decode_run: DecodeRun | None = None  # the fast-forward in progress (class default: none)
    _steady: bool | None = None  # whether the scheduler declares SteadyDecodeScheduler (checked once)

    def start_decode_run(self, executor: Executor, now: float) -> DecodeRun | None:
        """Right after a step was applied at clock ``now``: a fast-forward of the next steps if they provably are
        the same decodes (``core.fast_forward``), else None. The caller ends it with ``end_decode_run`` before the
        next ``schedule``; in between, the run's ``advance`` stands for schedule / execute / apply."""
        running = self.running
        # with a host tier a fast-forwarded allocation could spill evicted blocks, whose copies no batch would carry;
        # a pool that publishes blocks when scheduled (vLLM's) would have to hash each decode's new block as its
        # step starts, which the run does not do
        if not running or self._aborts or self._decode_run is not None or self.kv.host is not None or self._async \
                or self.kv.publishes_on_schedule or len(running) > self.limits.max_num_batched_tokens:
            return None
        for state in running:
            if state.in_prefill:
                return None
        if self._steady is None:
            self._steady = isinstance(self.scheduler, SteadyDecodeScheduler)
        if not self._steady:
            return None
        limit = finish_limit(running)  # the executor's token may end requests earlier (DecodeRun refines it)
        if limit <= 0:
            return None
        view = self._view
        view.now, view.preempted, view.blocked = now, [], None
        order = self.scheduler.steady_decode(view)
        if order is None:
            return None
        if len(order) != len(running):
            raise RuntimeError(f"{type(self.scheduler).__name__}.steady_decode returned {len(order)} requests; "
                               f"{len(running)} are running (it must order all of them)")
        run = DecodeRun(self.kv, self.waiting, self.limits.request_timeout_s, order, executor, limit)
        if run.limit <= 0:
            return None
        if self._adopted:  # adopted during the step just applied: the run ends before its first step
            run.interrupt()
        self._decode_run = run
        return run

    def _interrupt_decode_run(self) -> None:
        """The waiting queue, the aborts or the adopted requests changed: a fast-forward in progress ends before
        its next step (``schedule`` sees the change there)."""
        if self._decode_run is not None:
            self._decode_run.interrupt()

    def end_decode_run(self) -> None:
        """Bring the run's tokens into the request states; the replica is back to per-step scheduling."""
        run, self._decode_run = self._decode_run, None
        if run is not None:
            run.sync()

    # ---- PD disaggregation (core.disagg) ---------------------------------------------------------------------
    # A prefill replica hands each request off once its first token is sampled, keeping its KV blocks until the
    # transfer ends (``release_sent``); a decode replica adopts transferred requests with their KV in its pool.
    on_prefilled: OnTerminal | None = None  # set on a prefill replica: takes each request whose prefill completed
    _sending = 0  # handed-off requests whose blocks this replica still holds
    _adopted: list[RequestState] | None = None  # transferred requests that join ``running`` at the next schedule

    @property
    def sending(self) -> bool:
        """Handed-off requests still hold KV here: an idle replica that cannot admit its queue head waits for them
        to leave instead of rejecting it."""
        return self._sending > 0

    @property
    def num_adopting(self) -> int:
        return len(self._adopted) if self._adopted else 0

    def _hand_off(self, end_s: float) -> None:
        """Running requests that got their first token this step leave for a decode replica (``on_prefilled``)."""
        ready = [s for s in self.running if s.output_token_ids]
        if not ready:
            return
        self.running[:] = [s for s in self.running if not s.output_token_ids]
        self._sending += len(ready)
        for state in ready:
            self.on_prefilled(state, end_s)

    def release_sent(self, state: RequestState, now: float) -> None:
        """A handed-off request's transfer ended: free its blocks the normal way (its prompt blocks stay cached)."""
        self.kv.free(state, now)
        self._sending -= 1

    def adopt(self, state: RequestState) -> None:
        """A request prefilled elsewhere, its KV already in this pool (``KVCacheManager.receive``): it joins the
        running set at the next ``schedule`` and decodes from there."""
        if self._adopted is None:
            self._adopted = []
        state.replica = self.index
        self._adopted.append(state)
        self._interrupt_decode_run()  # the batch changes at the next schedule

    def _admit_adopted(self) -> None:
        for state in self._adopted:
            state.status = Status.RUNNING
            self.running.append(state)
        self._adopted.clear()
