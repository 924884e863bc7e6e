"""The simulator's executor: step time from a cost model, placeholder tokens."""

from __future__ import annotations

from core.batch import Batch
from core.interfaces import BaseExecutor, StepOutput
from sim.cost.base import CostModel
from sim.speculative import SpeculativeModel


class CostModelExecutor(BaseExecutor):
    """Predicts each step's duration with a cost model; measures nothing."""

    def __init__(self, cost_model: CostModel, token_id: int = 0, speculation: SpeculativeModel | None = None) -> None:
        self.cost_model = cost_model
        self.token_id = token_id  # simulated outputs carry no content; EOS never fires in the simulator
        self.speculation = speculation  # accepted drafts and draft cost of speculative decodes

    def execute(self, batch: Batch) -> StepOutput:
        duration = self.cost_model.step_time(batch.features)
        if not batch.features.num_draft_tokens:
            n = sum(1 for ch in batch.chunks if ch.samples)
            return StepOutput([self.token_id] * n, duration)
        spec = self.speculation
        if spec is None:
            raise RuntimeError("the batch verifies draft tokens but the simulator has no acceptance model (spec)")
        counts = [1 + spec.accepted(ch.num_draft_tokens) for ch in batch.chunks if ch.samples]
        return StepOutput([self.token_id] * sum(counts), duration + spec.draft_time(batch), counts)
