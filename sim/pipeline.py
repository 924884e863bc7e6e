"""Parallel replicas in the simulator: pipeline stages with micro-batches in flight, and attention data-parallel
ranks stepping in lockstep.

Pipeline parallelism (``parallel.pp``): a replica's ``pp`` stages run one micro-batch each at a time, in order. As in
vLLM's pipeline-parallel virtual engines (and Vidur's replica stages), the replica has ``pp`` schedulers, each with
1/pp of the KV pool, each with at most one micro-batch in flight; a scheduler's next batch is scheduled when its
previous one leaves the last stage. ``Pipeline`` keeps when each stage is next free: a micro-batch that starts at
``now`` enters stage 0 at ``max(now + overhead, free[0])``, leaves stage k at ``max(arrival, free[k]) + stage_k``
(its send to stage k + 1 included) and the step lasts until it leaves the last stage. Micro-batches reserve the
stages in the order they start, which is the order they reach every stage (a FIFO pipeline), so reserving at
the start is exact. In steps.csv each virtual engine is a replica row of its own (replica = r·pp + v); a row's
``duration_s`` beyond the sum of its stage times (``Pipeline.wait_s``) is time spent waiting for a busy stage, and
the stages' idle time (the bubble) is ``Pipeline.idle_s``.

Data-parallel attention with experts (``parallel.dp``, vLLM's ``--data-parallel-size --enable-expert-parallel``): a
replica's dp ranks each schedule their own batch from their own queue and KV pool, and meet at every MoE layer, so
they step together (``core.loop`` runs a group of replicas as one process): ``LockstepExecutor`` prices the step
of all ranks' batches at once (``RooflineCostModel.group_step_time``: the slowest rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from core.batch import Batch
from core.interfaces import BaseExecutor, StepOutput


@dataclass
class Pipeline:
    """The stages of one replica: when each is next free, and how busy they have been."""

    num_stages: int
    now: Callable[[], float] = field(default=lambda: 0.0)  # the loop's clock (set when the loop is built)
    free: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    wait_s: float = 0.0  # micro-batches' time waiting for a busy stage
    end_s: float = 0.0

    def __post_init__(self) -> None:
        self.free = [0.0] * self.num_stages
        self.busy_s = [0.0] * self.num_stages

    def run(self, start: float, stage_s: Sequence[float], overhead_s: float = 0.0) -> float:
        """A micro-batch starting at ``start``: reserves each stage in turn; returns the time it leaves the last."""
        t = start + overhead_s
        for k, s in enumerate(stage_s):
            begin = max(t, self.free[k])
            self.wait_s += begin - t
            t = self.free[k] = begin + s
            self.busy_s[k] += s
        self.end_s = max(self.end_s, t)
        return t

    def idle_s(self, span_s: float | None = None) -> list[float]:
        """Each stage's idle time over ``span_s`` (default: until the last micro-batch left): the bubble."""
        span = self.end_s if span_s is None else span_s
        return [span - b for b in self.busy_s]


class PipelineExecutor(BaseExecutor):
    """One virtual engine of a pipeline-parallel replica: its steps go through the replica's shared ``Pipeline``.
    The step's duration depends on the other virtual engines' micro-batches, so no decode run is predicted."""

    def __init__(self, cost_model, pipeline: Pipeline, token_id: int = 0) -> None:
        self.cost_model, self.pipeline, self.token_id = cost_model, pipeline, token_id

    def execute(self, batch: Batch) -> StepOutput:
        f, cm = batch.features, self.cost_model
        now = self.pipeline.now()
        if f.num_batched_tokens == 0:
            return StepOutput([], cm.overhead_s)
        end = self.pipeline.run(now, cm.stage_times(f), cm.overhead_s)
        return StepOutput([self.token_id] * sum(1 for ch in batch.chunks if ch.samples), end - now)


class LockstepExecutor:
    """The dp ranks of one replica priced as one step (``core.loop``'s replica groups): every rank's batch lasts the
    slowest rank's time. An idle rank's dummy batch (vLLM runs one so the collectives meet) adds no time: the
    busy ranks' steps are longer."""

    def __init__(self, cost_model, token_id: int = 0) -> None:
        self.cost_model, self.token_id = cost_model, token_id

    def execute_group(self, batches: Sequence[Batch]) -> list[StepOutput]:
        duration = self.cost_model.group_step_time([b.features for b in batches])
        return [StepOutput([self.token_id] * sum(1 for ch in b.chunks if ch.samples), duration) for b in batches]
