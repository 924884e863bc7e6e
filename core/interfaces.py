"""The plugin Protocols. A policy implements one of these and imports nothing but ``core``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from core.batch import Batch
from core.request import Request, RequestState

if TYPE_CHECKING:
    from core.kv_cache import Block
    from core.replica import SchedulerView


@runtime_checkable
class Scheduler(Protocol):
    """Decides what one step of one replica runs.

    ``view`` exposes the waiting queue, the running list, the KV cache (lookup / allocate) and the
    limits; the scheduler admits, preempts and returns a ``Batch``. The replica validates the batch.
    """

    def schedule(self, view: SchedulerView) -> Batch: ...


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

    @property
    def kv_free_fraction(self) -> float:
        return self.num_free_blocks / self.num_blocks


@runtime_checkable
class Router(Protocol):
    """Chooses the replica (index into ``replicas``) that serves a new request."""

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int: ...


@runtime_checkable
class Workload(Protocol):
    """Where requests come from. Open loop: everything comes from ``initial``; closed loop: each finished
    request may bring its client's next one (``arrival_s`` = finish time + think time)."""

    def initial(self) -> Iterator[Request]:
        """Requests known up front, in non-decreasing ``arrival_s`` (may be lazy)."""

    def on_finish(self, state: RequestState, now: float) -> Request | None:
        """Called once per request reaching a terminal status; returns the next request or None."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """Result of executing one batch: one sampled token per chunk with ``samples`` set (in batch order), and the
    step's duration in seconds (predicted by a cost model, or measured by the engine)."""

    tokens: list[int]
    duration_s: float


@runtime_checkable
class Executor(Protocol):
    """Runs a batch. The simulator's executor asks a cost model; the engine's runs the model."""

    def execute(self, batch: Batch) -> StepOutput: ...
