"""Least outstanding requests: the replica with the fewest waiting + running requests (lowest index on ties)."""

from collections.abc import Sequence

from core.interfaces import ReplicaView
from core.request import Request


class LeastOutstandingRouter:
    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_outstanding, i))
