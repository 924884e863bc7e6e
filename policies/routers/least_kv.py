"""Least KV usage: the replica with the most free (free + evictable) KV blocks; ties -> fewest outstanding."""

from collections.abc import Sequence

from core.interfaces import ReplicaView
from core.request import Request


class LeastKVRouter:
    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (-replicas[i].num_free_blocks, replicas[i].num_outstanding, i))
