"""Least loaded: the decode replica with the fewest outstanding requests (transfers on their way included); ties ->
most free KV blocks, then the lower index."""

from collections.abc import Sequence

from core.interfaces import ReplicaView
from core.request import Request


class LeastLoadedPlacement:
    def place(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_outstanding, -replicas[i].num_free_blocks, i))
