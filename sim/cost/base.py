"""The cost-model interface, and the step shapes the estimate tool and tests price."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from core.batch import StepFeatures
from core.specs import HardwareSpec, ModelSpec


@runtime_checkable
class CostModel(Protocol):
    """Predicts how long one engine step takes from its shape."""

    def step_time(self, f: StepFeatures) -> float:
        """Seconds."""
        ...


@runtime_checkable
class DecodeCostModel(CostModel, Protocol):
    """Optional capability of a cost model: price a run of pure-decode steps at once (``core.fast_forward``)."""

    def decode_step_times(self, first: StepFeatures, num_steps: int) -> list[float]:
        """``step_time`` of each of ``num_steps`` decode steps, step m having the features
        ``core.fast_forward.decode_features(first, m)`` (kv_tokens_read grows by num_decode_seqs, max_context_len by
        1 per step), bit-identical to calling
        ``step_time`` on each: the same expression, evaluated in the same order, over a numpy array."""
        ...


@runtime_checkable
class StagedCostModel(CostModel, Protocol):
    """Optional capability of a cost model: price a step stage by stage, for pipeline stages (``sim.pipeline``) and
    for attention data-parallel ranks meeting at the MoE layers (``group_step_time``; ``lockstep_step_time`` is the
    one implementation)."""

    pp: int
    overhead_s: float

    def stage_times(self, f: StepFeatures, moe_tokens: int | None = None) -> list[float]:
        """Seconds each of the ``pp`` stages takes for the step, its send to the next stage included, no overhead;
        ``moe_tokens``: the tokens meeting at the MoE layers (default: the step's own)."""
        ...

    def group_step_time(self, features: Sequence[StepFeatures]) -> float:
        """One lockstep step of the dp ranks, ``features`` one rank's batch each (``lockstep_step_time``)."""
        ...


def lockstep_step_time(cost: StagedCostModel, features: Sequence[StepFeatures]) -> float:
    """The step of dp attention-data-parallel ranks in lockstep: every rank's tokens meet at the MoE layers, so each
    rank pays its own attention and dense layers plus the MoE layers of all ranks' tokens; the step lasts as long as
    the slowest rank's (an idle rank's empty batch adds no time), plus the overhead."""
    total = sum(f.num_batched_tokens for f in features)
    if total == 0:
        return cost.overhead_s
    return max(sum(cost.stage_times(f, total)) for f in features if f.num_batched_tokens) + cost.overhead_s


def decode_steps(first: StepFeatures, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(kv_tokens_read, max_context_len) of each step of a decode run starting with ``first`` (int64 arrays)."""
    m = np.arange(num_steps, dtype=np.int64)
    return first.kv_tokens_read + m * first.num_decode_seqs, first.max_context_len + m


def _plain(cfg: Mapping[str, Any]) -> dict[str, Any]:
    try:  # a Hydra DictConfig: resolve interpolations and unwrap nested containers
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    return dict(cfg)


def as_model_spec(m: ModelSpec | Mapping[str, Any]) -> ModelSpec:
    return m if isinstance(m, ModelSpec) else ModelSpec.from_config(_plain(m))


def as_hardware_spec(h: HardwareSpec | Mapping[str, Any]) -> HardwareSpec:
    return h if isinstance(h, HardwareSpec) else HardwareSpec.from_mapping(_plain(h))


def decode_features(batch_size: int, context: int) -> StepFeatures:
    """``batch_size`` decodes, each attending to ``context`` tokens (its new token included)."""
    return StepFeatures(num_seqs=batch_size, num_batched_tokens=batch_size, num_decode_seqs=batch_size,
                        kv_tokens_read=batch_size * context, max_context_len=context, max_decode_context=context,
                        min_decode_context=context)


def prefill_features(num_tokens: int, cached: int = 0) -> StepFeatures:
    """One prefill chunk of ``num_tokens`` after ``cached`` tokens already in the KV cache."""
    n, c = num_tokens, cached
    return StepFeatures(num_seqs=1, num_batched_tokens=n, num_prefill_seqs=1, num_prefill_tokens=n,
                        attention_pairs=n * c + n * (n + 1) // 2, prefill_kv_tokens=c + n, max_context_len=c + n)
