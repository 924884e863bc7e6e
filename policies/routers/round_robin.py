"""Round robin: replica i, i+1, ... regardless of load or cache."""

from collections.abc import Sequence

from core.interfaces import ReplicaView
from core.request import Request


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i
