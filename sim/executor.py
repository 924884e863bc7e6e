"""The simulator's executor: step time from a cost model (times a calibration's step noise), placeholder tokens."""

from __future__ import annotations

from core.batch import Batch, StepFeatures
from core.fast_forward import decode_features
from core.host_tier import copy_seconds
from core.interfaces import BaseExecutor, DecodeForecast, StepOutput
from core.links import Link
from sim.cost.base import CostModel, DecodeCostModel
from sim.noise import StepNoise
from sim.speculative import SpeculativeModel


class CostModelExecutor(BaseExecutor):
    """Predicts each step's duration with a cost model; measures nothing.

    It predicts runs of decode steps too (``predicts_decodes``, for ``core.fast_forward``; not with speculative
    decoding): a cost model is a pure function of the step's features, and every sampled token is ``token_id``. A
    cost model that declares ``sim.cost.base.DecodeCostModel`` prices the run vectorised; any other is called once
    per step (still exact).

    With ``noise`` (``sim.noise.StepNoise``) the forward pass of the replica's i-th step takes the cost model's time
    times the noise's i-th factor for its kind. Steps are counted as they run: ``execute`` takes one, a decode run
    prices ahead and ``decodes_taken`` takes the steps it started, so fast-forward gives every step the factor it
    gets step by step.
    """

    def __init__(self, cost_model: CostModel, token_id: int = 0, speculation: SpeculativeModel | None = None,
                 host_link: Link | None = None, host_block_bytes: float = 0.0, noise: StepNoise | None = None) -> None:
        self.cost_model = cost_model
        self.token_id = token_id  # simulated outputs carry no content; EOS never fires in the simulator
        self._vectorised = isinstance(cost_model, DecodeCostModel)
        self.speculation = speculation  # accepted drafts and draft cost of speculative decodes
        # a speculative decode's tokens per step are drawn, so its steps are not a predictable decode run
        self.predicts_decodes = speculation is None
        # host KV tier: a step's block copies run before its forward pass, serialised with it (core.host_tier)
        self.host_link, self.host_block_bytes = host_link, host_block_bytes
        self.copy_s = 0.0  # priced time of the steps' block copies (part of their step durations)
        self.noise = noise
        self._step = 0  # steps taken so far (the index of the next step's noise factor)
        self._priced = 0  # steps the decode run in progress has priced ahead (from _step on)

    def execute(self, batch: Batch) -> StepOutput:
        duration = self.cost_model.step_time(batch.features)
        if self.noise is not None:
            duration *= self.noise.factor(self._step, batch.features.kind)
        self._step += 1
        self._priced = 0  # a run that priced steps but never began (Replica.start_decode_run) took none
        if batch.copies:
            if self.host_link is None:
                raise RuntimeError("the batch copies KV blocks to or from a host tier; the simulator has no host link")
            copy_s = copy_seconds(batch.copies, self.host_link, self.host_block_bytes)
            self.copy_s += copy_s
            duration += copy_s
        if not batch.features.num_draft_tokens:
            n = sum(1 for ch in batch.chunks if ch.samples)
            return StepOutput([self.token_id] * n, duration)
        spec = self.speculation
        if spec is None:
            raise RuntimeError("the batch verifies draft tokens but the simulator has no acceptance model (spec)")
        counts = [1 + spec.accepted(ch.num_draft_tokens) for ch in batch.chunks if ch.samples]
        return StepOutput([self.token_id] * sum(counts), duration + spec.draft_time(batch), counts)

    def forecast_decodes(self, first: StepFeatures, num_steps: int) -> DecodeForecast:
        cm = self.cost_model
        if self._vectorised:
            durations = cm.decode_step_times(first, num_steps)
        else:
            durations = [cm.step_time(decode_features(first, m)) for m in range(num_steps)]
        if self.noise is not None:
            factors = self.noise.factors(self._step + self._priced, num_steps, "decode")
            durations = [d * f for d, f in zip(durations, factors.tolist(), strict=True)]
        self._priced += num_steps
        return DecodeForecast(durations, self.token_id)

    def decodes_taken(self, num_steps: int) -> None:
        self._step += num_steps
        self._priced = 0
