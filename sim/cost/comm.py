"""Collective communication times: TP all-reduce, PP send/recv, EP all-to-all.

Measured where the hardware matches: Vidur's NCCL tables (``gpu-measurements/vidur/network/<profile>/
{all_reduce,send_recv}.csv``, the median time in ms by message size in bytes and number of workers, all workers in
one node), chosen by ``hardware.network_profile``. Between two measured sizes the time is interpolated linearly
(NCCL's time is affine in the size within a protocol regime); below the smallest size it is the smallest size's
time (the latency floor); above the largest, the largest size's time plus the extra bytes at the bandwidth of the
table's last 10% of sizes.

Elsewhere (no profile, a worker count the table lacks, all-to-all, which the tables do not measure) the link model
of the hardware's peer link (``interconnect_bw`` per direction, ``interconnect_latency_s`` per hop): ring all-reduce
2(w-1)·latency + 2(w-1)/w · bytes / bw; send/recv latency + bytes / bw; all-to-all (each rank keeps 1/w of its
bytes and sends the rest, over a switch: all ranks at once) (w-1)·latency + (w-1)/w · bytes / bw.
"""

from __future__ import annotations

import csv
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from core.specs import HardwareSpec

MS = 1e-3
TABLES = ("all_reduce", "send_recv")
TAIL = 0.1  # the bandwidth beyond a table's largest size: from its largest 10% of sizes


@dataclass(frozen=True)
class Curve:
    """Measured (bytes, seconds) points of one collective at one worker count, sizes increasing."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __call__(self, nbytes: float) -> float:
        xs, ys = self.sizes, self.seconds
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            lo = min(len(xs) - 2, int(len(xs) * (1 - TAIL)))
            slope = max(0.0, (ys[-1] - ys[lo]) / (xs[-1] - xs[lo]))
            return ys[-1] + (nbytes - xs[-1]) * slope
        i = bisect_left(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def read_tables(folder: Path) -> dict[tuple[str, int], Curve]:
    """(collective, workers) -> Curve from one Vidur network folder, rank 0's rows of workers all in one node
    (``devices_per_node == num_workers``; send/recv: its 2 workers on one node)."""
    curves: dict[tuple[str, int], Curve] = {}
    for name in TABLES:
        path = folder / f"{name}.csv"
        if not path.is_file():
            raise FileNotFoundError(f"hardware.network_profile: no {path}")
        points: dict[int, dict[float, float]] = {}
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                workers = int(row["num_workers"])
                if int(row["rank"]) or int(row["devices_per_node"]) != workers:
                    continue
                points.setdefault(workers, {})[float(row["size"])] = float(row[f"time_stats.{name}.median"]) * MS
        for workers, by_size in points.items():
            sizes = tuple(sorted(by_size))
            if len(sizes) >= 2:
                curves[name, workers] = Curve(sizes, tuple(by_size[s] for s in sizes))
    return curves


@dataclass
class Comm:
    """Collective times on one kind of device: measured curves where there are, the peer link elsewhere."""

    bandwidth: float  # bytes/s per direction between peers
    latency_s: float = 0.0
    curves: dict[tuple[str, int], Curve] = field(default_factory=dict)
    profile: str | None = None

    @classmethod
    def of(cls, hardware: HardwareSpec, network_dir: str | Path | None = None) -> Comm:
        """The hardware's collectives: its ``network_profile`` tables under ``network_dir`` (None: link only)."""
        curves = {}
        if hardware.network_profile and network_dir is not None:
            curves = read_tables(Path(network_dir) / hardware.network_profile)
        return cls(hardware.interconnect_bw, hardware.interconnect_latency_s, curves,
                   hardware.network_profile if curves else None)

    def _link(self, workers: int) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"{workers} communicating devices need hardware.interconnect_bw > 0")

    def measured(self, collective: str, workers: int) -> bool:
        return (collective, workers) in self.curves

    def all_reduce_s(self, nbytes: float, workers: int) -> float:
        """One all-reduce of ``nbytes`` over ``workers`` devices (0 for one device)."""
        if workers <= 1 or nbytes <= 0:
            return 0.0
        curve = self.curves.get(("all_reduce", workers))
        if curve is not None:
            return curve(nbytes)
        self._link(workers)
        hops = 2 * (workers - 1)
        return hops * self.latency_s + hops / workers * nbytes / self.bandwidth

    def send_recv_s(self, nbytes: float) -> float:
        """One point-to-point transfer of ``nbytes`` between two devices (pipeline stages)."""
        if nbytes <= 0:
            return 0.0
        curve = self.curves.get(("send_recv", 2))
        if curve is not None:
            return curve(nbytes)
        self._link(2)
        return self.latency_s + nbytes / self.bandwidth

    def all_gather_s(self, nbytes: float, workers: int) -> float:
        """One ring all-gather in which each of ``workers`` devices contributes ``nbytes`` (and so receives
        (workers - 1) x nbytes); a reduce-scatter of the gathered result moves the same bytes the same way, so it is
        priced alike."""
        if workers <= 1 or nbytes <= 0:
            return 0.0
        self._link(workers)
        return (workers - 1) * (self.latency_s + nbytes / self.bandwidth)


def stage_collectives(comm: Comm, *, tokens: int, row_bytes: float, layers: int, moe_layers: int, tp: int,
                      dp: int = 1, ep: int = 1, moe_tokens: int | None = None, last: bool = True) -> dict[str, float]:
    """Seconds of the collectives one pipeline stage of ``layers`` decoder layers (``moe_layers`` of them MoE) runs
    for a step of ``tokens`` tokens of ``row_bytes`` activations each, on one rank of a tp x dp (x ep) replica; every
    cost model prices its collectives here (docs/parallelism.md, "Collectives").

    ``allreduce``: tensor parallelism's two per layer (after attention, after the MLP), except that an MoE layer of
    dp > 1 ranks meets the other ranks instead: with ep = 1 an all-reduce of the ``moe_tokens`` (all ranks' tokens,
    default the step's own) over tp x dp; ``all_to_all``: with ep > 1 and dp > 1, the expert-parallel exchange as
    vLLM does it by default (``all2all_backend=allgather_reducescatter``): per MoE layer an all-gather of every dp
    rank's token activations, then a reduce-scatter of the experts' outputs, each rank contributing its batch (the
    slowest rank, whose batch is the largest, sets the lockstep step, as vLLM pads every rank to it). Expert
    parallelism within one dp rank (ep = tp) moves nothing extra: the tp ranks already hold every token and combine
    with the tp all-reduce. ``send_recv``: the activations to the next stage (none from the ``last``)."""
    moe_dp = moe_layers if dp > 1 else 0  # MoE layers whose MLP collective is across the dp ranks
    allreduce = (2 * layers - moe_dp) * comm.all_reduce_s(tokens * row_bytes, tp) if tp > 1 else 0.0
    if moe_dp and ep == 1:
        allreduce += moe_dp * comm.all_reduce_s((tokens if moe_tokens is None else moe_tokens) * row_bytes, tp * dp)
    exchange = 2 * moe_dp * comm.all_gather_s(tokens * row_bytes, dp) if moe_dp and ep > 1 and tokens else 0.0
    return {"allreduce": allreduce, "all_to_all": exchange,
            "send_recv": 0.0 if last or not tokens else comm.send_recv_s(tokens * row_bytes)}
