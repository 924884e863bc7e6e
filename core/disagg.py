"""PD disaggregation: prefill replicas and decode replicas, each request's KV moved from one to the other.

Request flow (``PDServingLoop``):

1. A new request goes to a *prefill* replica chosen by the run's ``Router`` (it sees the prefill replicas only).
2. That replica schedules and prefills it as usual and samples its first token; ``Replica.apply`` then hands it
   off (``Replica.on_prefilled``): it leaves the running set but keeps its KV blocks, and joins the FIFO transfer
   queue of its prefill replica's link. A request that is complete after its first token (one output, or a stop
   token) finishes on the prefill replica: nothing is left to decode, so nothing moves.
3. When the transfer reaches the head of the queue, the ``Placement`` plugin chooses a decode replica. The
   transfer waits there (the *KV wait*) until that replica can hold it: enough free blocks for the request's KV
   (``KVCacheManager.receive`` reserves them) and a free seat under its ``max_num_seqs``.
4. The ``KVTransport`` moves the KV and says how long that takes (the simulator prices bytes over a link; the
   engine copies the tensors and measures the copy); the link process sleeps that long on the clock.
5. At the end of the transfer the prefill replica frees the request's blocks the normal way (its hashed prompt
   blocks stay in its prefix cache), the first token is *delivered* (``first_token_s``, so TTFT includes the
   transfer) and the decode replica adopts the request, which decodes there from its next step.

Links: one FIFO queue per prefill replica -- its NIC's egress. Transfers from one prefill replica run one at a
time in prefill-completion order (a head that waits for decode KV holds up the ones behind it, as a NIC's send
queue would); transfers from different prefill replicas run in parallel, and a decode replica's ingress is not
modelled as a shared resource. Each link is its own clock process, so transfers overlap with the steps of both
replicas. Seeded sampling generators do not move with a request (greedy and unseeded sampling are unaffected).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.interfaces import Executor, KVTransport, Placement, ReplicaView, Router, Workload
from core.loop import Idle, Process, ServingLoop, Sleep, plugin_index
from core.metrics import DEFAULT_PERCENTILES, stats
from core.replica import Replica
from core.request import Request, RequestState, Status


@dataclass(slots=True, eq=False)
class Transfer:
    """One request's KV move, on the run's clock (a row of requests.csv's PD columns)."""

    state: RequestState
    prefill: int  # replica index of the prefill replica (its link's queue)
    ready_s: float  # first token sampled: queued on the link
    decode: int = -1  # replica index of the decode replica, chosen at the head of the queue
    num_tokens: int = 0  # KV tokens moved
    placed_s: float | None = None  # reached the head of the queue; waits for the decode replica's KV from here
    start_s: float | None = None  # decode KV reserved; the copy starts
    end_s: float | None = None  # copy done: first token delivered

    @property
    def link_wait_s(self) -> float | None:
        """Time queued behind other transfers on the link."""
        return None if self.placed_s is None else self.placed_s - self.ready_s

    @property
    def kv_wait_s(self) -> float | None:
        """Time the decode replica could not hold the request (KV blocks or seats)."""
        return None if self.start_s is None or self.placed_s is None else self.start_s - self.placed_s

    @property
    def transfer_s(self) -> float | None:
        return None if self.end_s is None or self.start_s is None else self.end_s - self.start_s


class PDServingLoop(ServingLoop):
    """A ``ServingLoop`` over ``num_prefill`` prefill replicas (the first ones) and decode replicas (the rest),
    plus one link process per prefill replica (see the module docstring)."""

    def __init__(self, replicas: Sequence[Replica], executors: Sequence[Executor], router: Router,
                 workload: Workload, *, num_prefill: int, placement: Placement, transport: KVTransport,
                 **kwargs: Any) -> None:
        super().__init__(replicas, executors, router, workload, **kwargs)
        if not 1 <= num_prefill < len(self.replicas):
            raise ValueError(f"a PD cluster needs at least one prefill and one decode replica; got {num_prefill} "
                             f"prefill of {len(self.replicas)} replicas")
        self.num_prefill = num_prefill
        self.placement, self.transport = placement, transport
        self.transfers: list[Transfer] = []
        self._queues: list[deque[Transfer]] = [deque() for _ in range(num_prefill)]
        self._incoming = [0] * len(self.replicas)  # transfers started toward each replica, not yet delivered
        for r in self.replicas[:num_prefill]:
            r.on_prefilled = self._prefilled
        self.on_terminal.insert(0, self._ended)

    @property
    def num_idle_slots(self) -> int:
        return len(self.replicas) + self.num_prefill  # the replicas', then one per link

    def processes(self, clock) -> list[Process]:
        return [*super().processes(clock), *(self._link(p) for p in range(self.num_prefill))]

    def unfinished(self) -> list[str]:
        return [*super().unfinished(), *(t.state.id for q in self._queues for t in q)]

    def dispatch(self, req: Request) -> RequestState:
        """Route and queue a request on a prefill replica; reject it there if no decode pool could ever hold it."""
        state = super().dispatch(req)
        decode = self.replicas[self.num_prefill:]
        need = decode[0].kv.blocks_for(req.prompt_len + req.max_new_tokens - 1)
        room = min(r.kv.num_blocks for r in decode)
        if not state.status.terminal and need > room:
            self.replicas[state.replica].end_early(req.id, self.clock.now, Status.REJECTED,
                                                   f"needs {need} KV blocks on a decode replica; the smallest decode "
                                                   f"pool has {room}")
        return state

    def _route(self, req: Request) -> int:
        """The router chooses among the prefill replicas only."""
        n = self.num_prefill
        idx = self.router.route(req, [r.view() for r in self.replicas[:n]]) if n > 1 else 0
        return plugin_index(idx, n, f"router {type(self.router).__name__}", "prefill replica")

    # ---- hand-off and placement ------------------------------------------------------------------------------
    def _prefilled(self, state: RequestState, now: float) -> None:
        t = Transfer(state, state.replica, now)
        self.transfers.append(t)
        self._queues[t.prefill].append(t)
        self.clock.wake(self._slot(t.prefill))

    def _slot(self, prefill: int) -> int:
        return len(self.replicas) + prefill

    def decode_views(self) -> list[ReplicaView]:
        """The decode replicas as a ``Placement`` sees them: transfers on their way count as waiting requests."""
        return [replace(v, num_waiting=v.num_waiting + self._incoming[r.index] + r.num_adopting)
                for r in self.replicas[self.num_prefill:] for v in (r.view(),)]

    def _place(self, request: Request) -> int:
        views = self.decode_views()
        idx = self.placement.place(request, views) if len(views) > 1 else 0
        return self.num_prefill + plugin_index(idx, len(views), f"placement {type(self.placement).__name__}",
                                               "decode replica")

    def _reserve(self, t: Transfer, now: float) -> list[int] | None:
        """The decode replica's blocks for ``t``'s KV, or None while it cannot hold it (blocks or seats)."""
        dst = self.replicas[t.decode]
        seats = len(dst.running) + dst.num_adopting + self._incoming[t.decode]
        if seats >= dst.limits.max_num_seqs:
            return None
        return dst.kv.receive(t.state, t.num_tokens, now)

    # ---- the link: one process per prefill replica -----------------------------------------------------------
    def _link(self, p: int) -> Process:
        queue, slot, clock, src = self._queues[p], self._slot(p), self.clock, self.replicas[p]
        while True:
            if not queue:
                yield Idle(slot)
                continue
            t = queue[0]
            if t.placed_s is None:
                t.placed_s, t.decode = clock.now, self._place(t.state.request)
                t.num_tokens = t.state.num_computed_tokens
            dst_blocks = self._reserve(t, clock.now)
            if dst_blocks is None:
                yield Idle(slot)  # woken when a request ends on a decode replica
                continue
            t.start_s = clock.now
            self._incoming[t.decode] += 1
            src_blocks = src.kv.block_table(t.state.id)[:len(dst_blocks)]
            seconds = self.transport.transfer(p, t.decode, src_blocks, dst_blocks, t.num_tokens)
            yield Sleep(seconds, t.start_s)
            queue.popleft()
            self._deliver(t, clock.now)

    def _deliver(self, t: Transfer, now: float) -> None:
        state, dst = t.state, self.replicas[t.decode]
        t.end_s = now
        self.replicas[t.prefill].release_sent(state, now)
        self.executors[t.prefill].release(state.id)
        # the first token reaches the client now: TTFT includes the transfer
        state.first_token_s = now
        state.token_times[0] = now
        self._incoming[t.decode] -= 1
        dst.adopt(state)
        self.clock.wake(t.decode)
        self.clock.wake(t.prefill)  # the freed blocks may let it admit a request it was holding back

    def _ended(self, state: RequestState, now: float) -> None:
        """A request ended on a decode replica, freeing blocks and a seat: wake links whose head waits there."""
        if state.replica < self.num_prefill:
            return
        for p, queue in enumerate(self._queues):
            if queue and queue[0].decode == state.replica and queue[0].start_s is None:
                self.clock.wake(self._slot(p))

    # ---- results ---------------------------------------------------------------------------------------------
    def request_columns(self) -> dict[str, Callable[[RequestState], Any]]:
        """requests.csv's PD columns: prefill and decode replica, transfer queued / start / end times (empty where
        nothing moved: a rejected request, or one complete after its first token)."""
        by_id = {t.state.id: t for t in self.transfers}

        def col(get: Callable[[Transfer], Any]) -> Callable[[RequestState], Any]:
            return lambda s: get(by_id[s.id]) if s.id in by_id else None

        return {"prefill_replica": lambda s: by_id[s.id].prefill if s.id in by_id else s.replica,
                "decode_replica": col(lambda t: t.decode if t.decode >= 0 else None),
                "transfer_queued_s": col(lambda t: t.ready_s), "transfer_start_s": col(lambda t: t.start_s),
                "transfer_end_s": col(lambda t: t.end_s)}

    def metrics(self, method: str = "nearest_rank", percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                kv_bytes_per_token: float | None = None) -> dict[str, Any]:
        """metrics.json's ``pd`` section over the measured (non-warmup) requests' completed transfers."""
        done = [t for t in self.transfers if t.end_s is not None and not t.state.request.warmup]
        out: dict[str, Any] = {
            "prefill_replicas": self.num_prefill, "decode_replicas": len(self.replicas) - self.num_prefill,
            "num_transfers": len(done), "transfer_tokens": sum(t.num_tokens for t in done),
            "transfer_s": stats([t.transfer_s for t in done], method, percentiles),
            "transfer_kv_wait_s": stats([t.kv_wait_s for t in done], method, percentiles),
            "transfer_link_wait_s": stats([t.link_wait_s for t in done], method, percentiles),
            "num_kv_waits": sum(t.kv_wait_s > 0 for t in done)}
        if kv_bytes_per_token is not None:
            out["transfer_bytes"] = out["transfer_tokens"] * kv_bytes_per_token
        return out
