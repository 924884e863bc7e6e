"""Uniformly random decode replica, from a seeded generator (same seed, same placements)."""

from collections.abc import Sequence

import numpy as np

from core.interfaces import ReplicaView
from core.request import Request


class RandomPlacement:
    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def place(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return int(self._rng.integers(len(replicas)))
