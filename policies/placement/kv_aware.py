"""KV aware: the decode replica with the most free (free + evictable) KV blocks, where a long-context request is
least likely to wait for KV or to be preempted later; ties -> fewest outstanding, then the lower index."""

from collections.abc import Sequence

from core.interfaces import ReplicaView
from core.request import Request


class KVAwarePlacement:
    def place(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (-replicas[i].num_free_blocks, replicas[i].num_outstanding, i))
