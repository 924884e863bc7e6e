"""Prefix-aware routing with a load-imbalance guard (in the spirit of SGLang's cache-aware router)."""

from collections.abc import Sequence

from core.checks import check_int
from core.interfaces import ReplicaView
from core.request import Request


class PrefixAwareRouter:
    """Among replicas whose outstanding requests (waiting + running) are at most ``max_imbalance`` above
    the least loaded one, pick the longest cached prefix of this request; ties -> least loaded, then index.
    ``max_imbalance=0`` is least-outstanding routing with cache-aware tie breaks; a large value is pure
    cache affinity, which piles a popular prefix onto one replica."""

    def __init__(self, max_imbalance: int = 8) -> None:
        self.max_imbalance = check_int(max_imbalance, "router.max_imbalance", 0)

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        floor = min(r.num_outstanding for r in replicas)
        eligible = [i for i, r in enumerate(replicas) if r.num_outstanding <= floor + self.max_imbalance]
        return min(eligible, key=lambda i: (-replicas[i].cached_prefix_len(request), replicas[i].num_outstanding, i))
