"""Power of two choices: sample two distinct replicas (seeded), send to the one with fewer outstanding requests."""

from collections.abc import Sequence

import numpy as np

from core.interfaces import ReplicaView
from core.request import Request


class PowerOfTwoRouter:
    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        if len(replicas) == 1:
            return 0
        i, j = (int(x) for x in self._rng.choice(len(replicas), size=2, replace=False))
        return j if replicas[j].num_outstanding < replicas[i].num_outstanding else i
