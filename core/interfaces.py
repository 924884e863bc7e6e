"""The plugin Protocols. A policy implements one of these and imports nothing but ``core``.

This module depends only on ``core.batch``, ``core.checks`` and ``core.request``; the KV cache and the replica
implement what it declares (``SchedulerView``, ``EvictionPolicy``'s ``Block``), never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

from core.batch import Batch, StepFeatures
from core.checks import check_float, check_int
from core.request import Request, RequestState


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step budgets every scheduler must respect, and request limits the replica enforces."""

    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_num_seqs: int = 128  # sequences in one step / running at once
    max_model_len: int = 4096  # prompt + output tokens of one request
    request_timeout_s: float | None = None  # a request not finished this long after arrival is TIMED_OUT
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)  # the model's EOS ids (empty: none known)
    vocab_size: int | None = None  # when set, explicit prompt token ids must lie in [0, vocab_size)
    ignore_eos: bool = False  # default of Request.ignore_eos: True generates exactly max_new_tokens (stop ids aside)

    def __post_init__(self) -> None:
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            check_int(getattr(self, key), f"scheduler.{key}", 1)
        if self.request_timeout_s is not None:
            check_float(self.request_timeout_s, "request_timeout_s", 0.0, strict=True)


class SchedulerView(Protocol):
    """What a Scheduler sees and may do during one ``schedule`` call (``core.replica.ReplicaSchedulerView``).

    Read: the time, the waiting queue (in order) and the running list (in admission order), the limits, the
    ids preempted so far in this call, and the KV pool's block size and free-block count. Do: look a waiting
    request's cached prefix up, admit it, grow a running request, preempt one. The queues change only through
    ``admit`` and ``preempt``; the KV pool only through ``admit``, ``allocate`` and ``preempt``.
    """

    @property
    def now(self) -> float: ...

    @property
    def waiting(self) -> Sequence[RequestState]: ...

    @property
    def running(self) -> Sequence[RequestState]: ...

    @property
    def limits(self) -> SchedulerLimits: ...

    @property
    def preempted(self) -> Sequence[str]: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """KV blocks an allocation can take now (free plus evictable)."""

    blocked: RequestState | None
    """A waiting request the scheduler cannot place even on an idle replica; the replica then rejects it
    (default: the head of the queue) instead of idling forever."""

    def lookup(self, state: RequestState) -> int:
        """Tokens of a waiting request the prefix cache would skip (no side effects)."""

    def admit(self, state: RequestState, num_tokens: int, fit_tokens: int = 0) -> bool:
        """Move a waiting request to running with its cached prefix plus room for ``num_tokens`` new tokens.
        False, changing nothing, when the KV pool cannot hold them, or could not hold ``fit_tokens`` tokens of the
        request in all, its cached prefix included (vLLM admits a first chunk only if the whole prompt would fit)."""

    def allocate(self, state: RequestState, num_tokens: int) -> bool:
        """Room for ``num_tokens`` more tokens of a running request. False (no change) if the pool is full."""

    def preempt(self, state: RequestState) -> None:
        """Preempt a running request to the head of the waiting queue: by recompute (its KV is dropped), or by
        swap (its KV goes to the host tier and comes back when it is admitted again), as the replica's
        ``PreemptionPolicy`` decides for this victim."""

    @property
    def num_free_host_blocks(self) -> int:
        """Host-tier blocks a swap-out can take now (0 without a host tier)."""

    def num_draft_tokens(self, state: RequestState) -> int:
        """Draft tokens a running request in decode should verify this step (speculative decoding; 0 when off):
        the replica's ``SpeculationPolicy``, capped so that drafts never run past the request's remaining outputs
        or ``max_model_len``. A scheduler budgets 1 + this many tokens (and KV slots) for the decode."""


@runtime_checkable
class SpeculationPolicy(Protocol):
    """Speculative decoding: how many draft tokens (k) a decoding request verifies in this step. A policy may
    read the request's acceptance so far (``state.num_draft_accepted / state.num_draft_proposed``) and how many
    requests run (``num_running``): drafts pay at small batches and high acceptance, and cost compute otherwise."""

    def num_draft_tokens(self, state: RequestState, num_running: int) -> int: ...


SWAP, RECOMPUTE = "swap", "recompute"
PREEMPTION_MODES = (SWAP, RECOMPUTE)


@runtime_checkable
class PreemptionPolicy(Protocol):
    """How a preempted request gives up its KV: ``"recompute"`` (drop it; its tokens are computed again when it is
    readmitted) or ``"swap"`` (copy its blocks to the host tier and back on readmission). Asked once per victim
    by ``SchedulerView.preempt``; a swap the host tier has no room for falls back to recompute. ``view`` shows
    ``block_size`` and ``num_free_host_blocks``; ``state.num_computed_tokens`` is what a swap would save."""

    def mode(self, state: RequestState, view: SchedulerView) -> str: ...


@runtime_checkable
class Scheduler(Protocol):
    """Decides what one step of one replica runs.

    ``view`` (a ``SchedulerView``) exposes the waiting queue, the running list, the limits and the KV pool
    through lookup / admit / allocate / preempt; the scheduler returns a ``Batch``. The replica validates it.
    """

    def schedule(self, view: SchedulerView) -> Batch: ...


@runtime_checkable
class SteadyDecodeScheduler(Scheduler, Protocol):
    """Opt-in capability of a Scheduler: it can promise that a replica in *steady decode* keeps getting the same
    decodes, so the simulator may fast-forward those steps (``core.fast_forward``) instead of calling ``schedule``
    for each. A scheduler without this method is called every step.

    Declared here, checked once per replica with ``isinstance`` (never looked up by name per step).
    """

    def steady_decode(self, view: SchedulerView) -> Sequence[RequestState] | None:
        """Called after a step was applied when every running request is in decode (its next chunk is one token)
        and the running requests fit one step's token budget; ``view`` shows the replica at that moment.

        Returns the running requests in the order ``schedule`` would decode them -- and allocate their KV -- which
        promises: as long as the waiting queue and the running list stay as they are, every running request only
        gains one output token per step, its KV grows without preemption (the pool only shrinks: nothing is freed)
        and the clock advances, each further ``schedule`` returns one decode per running request in that order,
        admitting and preempting nothing. The promise must not depend on ``view.now`` (timeouts, aborts and
        arrivals the replica re-checks itself). None (or no such method): ``schedule`` is called every step."""
        ...


@dataclass(slots=True, eq=False)
class Block:
    """One KV block as the KV cache manager keeps it and an eviction policy reads it (policies never change it)."""

    id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block holds a registered (full, computed) prefix block
    depth: int = 0  # position in its prefix chain: covers tokens [depth*size, (depth+1)*size)
    size: int = 16  # tokens it holds (the pool's block_size)
    num_hits: int = 0  # times reused through the prefix cache since it was cached
    last_used_s: float = 0.0
    cached_s: float = 0.0


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the evictable blocks (refcount 0, still holding a cached prefix)."""

    def on_cached(self, block: Block, now: float) -> None:
        """A block's content was registered in the prefix cache (it is in use, not yet evictable)."""

    def on_hit(self, block: Block, now: float) -> None:
        """A cached block was reused; if it was evictable, it no longer is."""

    def on_free(self, block: Block, now: float) -> None:
        """A cached block's refcount dropped to 0: it becomes evictable."""

    def victim(self) -> int:
        """Remove and return the id of the evictable block to evict next."""

    def __len__(self) -> int:
        """Number of evictable blocks."""


@dataclass(frozen=True)
class ReplicaView:
    """What a router may see of one replica at routing time. Counts are a snapshot; the pending-token totals
    and the prefix lookup are computed only if a router asks (routers that ignore them cost nothing)."""

    index: int
    num_waiting: int
    num_running: int
    num_free_blocks: int  # free + evictable
    num_blocks: int
    block_size: int
    pending_tokens: Callable[[], tuple[int, int]]  # (prefill tokens, output tokens) still to compute
    cached_prefix_len: Callable[[Request], int]  # pure lookup: tokens of this request's prompt cached here

    @cached_property
    def _pending(self) -> tuple[int, int]:
        return self.pending_tokens()

    @property
    def pending_prefill_tokens(self) -> int:
        """Tokens still to prefill over waiting + running requests."""
        return self._pending[0]

    @property
    def pending_decode_tokens(self) -> int:
        """Output tokens still to generate over waiting + running requests."""
        return self._pending[1]

    @property
    def num_outstanding(self) -> int:
        return self.num_waiting + self.num_running


@runtime_checkable
class Router(Protocol):
    """Chooses the replica (index into ``replicas``) that serves a new request."""

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int: ...


@runtime_checkable
class Placement(Protocol):
    """PD disaggregation (``core.disagg``): chooses the decode replica (index into ``replicas``, the decode replicas'
    views) that receives a prefilled request's KV. ``num_waiting`` of a view includes the transfers already on their
    way to that replica; ``num_free_blocks`` already excludes the blocks they reserved."""

    def place(self, request: Request, replicas: Sequence[ReplicaView]) -> int: ...


@runtime_checkable
class KVTransport(Protocol):
    """PD disaggregation: moves one request's KV from a prefill replica's pool to a decode replica's and returns the
    seconds it takes (the simulator prices a link; the engine copies tensors and measures the copy)."""

    def transfer(self, src: int, dst: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                 num_tokens: int) -> float:
        """Copy the KV of the first ``num_tokens`` tokens held in blocks ``src_blocks`` of replica ``src`` into
        blocks ``dst_blocks`` of replica ``dst`` (same block size, same order)."""
        ...


@runtime_checkable
class Workload(Protocol):
    """Where requests come from. Open loop: everything comes from ``initial``; closed loop: each finished
    request may bring its client's next one (``arrival_s`` = finish time + think time)."""

    def initial(self) -> Iterator[Request]:
        """Requests known up front, in non-decreasing ``arrival_s`` (may be lazy)."""

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        """Called once per request reaching a terminal status; returns the next request or None."""


@dataclass(frozen=True, slots=True)
class DecodeForecast:
    """An executor's prediction of consecutive pure-decode steps (``Executor.forecast_decodes``): ``durations[m]`` is
    step m's duration, bit-identical to what ``execute`` would return for that step's batch, and every step samples
    ``token`` for every sequence."""

    durations: Sequence[float]
    token: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Result of executing one batch: the sampled tokens of the chunks with ``samples`` set (in batch order), and
    the step's duration in seconds (predicted by a cost model, or measured by the engine).

    Without speculation each sampling chunk yields one token and ``num_tokens`` is None. A speculative decode
    (a chunk with d draft tokens) yields its accepted drafts plus one token from the target, 1 to d + 1 tokens:
    ``num_tokens`` then gives the count per sampling chunk and ``tokens`` holds them all, flattened in order."""

    tokens: list[int]
    duration_s: float
    num_tokens: list[int] | None = None


@runtime_checkable
class Executor(Protocol):
    """Runs a batch. The simulator's executor asks a cost model; the engine's runs the model.

    Everything the serving loop (``core.loop``) uses is declared here; ``BaseExecutor`` has the defaults.
    """

    copy_s: float
    """Seconds of host-tier block copies inside the steps so far (measured by the engine, priced by the simulator;
    0 without a host tier): metrics.json's ``host_tier.copy_s``."""

    stopwatch: Callable[[], float] | None
    """How a measuring executor reads time (e.g. ``time.perf_counter``); the loop times ``schedule()`` with it
    and adds that to the step, so a measured step runs from one schedule() to the next. None: the duration is
    predicted (a cost model, a replayed recording) and scheduling takes no simulated time."""

    def execute(self, batch: Batch) -> StepOutput: ...

    @property
    def predicts_decodes(self) -> bool:
        """True if ``forecast_decodes`` can predict pure-decode steps without seeing their batches (a stateless
        cost-model executor). False (``BaseExecutor``'s default): every step goes through ``execute`` -- an engine
        that runs the model, a replay that checks each recorded batch."""
        ...

    def forecast_decodes(self, first: StepFeatures, num_steps: int) -> DecodeForecast:
        """Predict ``num_steps`` consecutive steps that each decode the same ``first.num_decode_seqs`` sequences:
        step m reads ``first.kv_tokens_read + m * num_decode_seqs`` KV tokens and has ``max_context_len``,
        ``max_decode_context`` and ``min_decode_context`` m above ``first``'s (``core.fast_forward.decode_features``).
        Only called when ``predicts_decodes``; durations must equal ``execute``'s for those batches bit for bit."""
        ...

    def decodes_taken(self, num_steps: int) -> None:
        """The decode run (the ``forecast_decodes`` calls since the last ``execute``) ended after starting ``num_steps``
        of the steps priced: they were taken, the rest never run (a cost model with step noise counts steps)."""
        ...

    def release(self, request_id: str) -> None:
        """A request reached a terminal status: drop whatever the executor kept for it."""

    def finish(self) -> None:
        """The run ended: check that the executor's own record agrees (a replay must have used every step)."""


class BaseExecutor:
    """No-op defaults for the optional parts of ``Executor``: a predicting executor, nothing kept per request."""

    stopwatch: Callable[[], float] | None = None
    copy_s: float = 0.0
    predicts_decodes: bool = False  # every step goes through execute() (see Executor.predicts_decodes)

    def forecast_decodes(self, first: StepFeatures, num_steps: int) -> DecodeForecast:
        raise NotImplementedError(f"{type(self).__name__} does not predict decode steps (predicts_decodes is False)")

    def decodes_taken(self, num_steps: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def finish(self) -> None:
        pass
