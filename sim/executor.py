"""The simulator's executor: step time from a cost model, placeholder tokens."""

from __future__ import annotations

from core.batch import Batch
from core.interfaces import BaseExecutor, StepOutput
from sim.cost.base import CostModel


class CostModelExecutor(BaseExecutor):
    """Predicts each step's duration with a cost model; measures nothing."""

    def __init__(self, cost_model: CostModel, token_id: int = 0) -> None:
        self.cost_model = cost_model
        self.token_id = token_id  # simulated outputs carry no content; EOS never fires in the simulator

    def execute(self, batch: Batch) -> StepOutput:
        n = sum(1 for ch in batch.chunks if ch.samples)
        return StepOutput([self.token_id] * n, self.cost_model.step_time(batch.features))
