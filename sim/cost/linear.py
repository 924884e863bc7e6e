"""Linear (fitted) step time: t = c0 + a·prefill tokens + b·decode seqs + c·attention pairs + e·KV tokens read
+ g·cached context tokens of prefill chunks + h·draft tokens verified (speculative decoding)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from core.batch import StepFeatures
from core.checks import check_float, check_keys
from sim.cost.base import decode_steps

TARGET = "sim.cost.linear.LinearCostModel"


@dataclass(frozen=True)
class LinearCostModel:
    """Coefficients in seconds, all >= 0 (a calibration fits them by non-negative least squares)."""

    c0_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_attention_pair_s: float = 0.0
    per_kv_token_read_s: float = 0.0
    # per token of cached context a prefill chunk attends to (a chunk after a cached prefix or an earlier chunk
    # reads that KV; on the CPU engine it also takes the masked attention path)
    per_prefill_context_token_s: float = 0.0
    per_draft_token_s: float = 0.0  # per draft token a speculative decode verifies (its position, the proposer's work)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_float(getattr(self, f.name), f"cost_model.{f.name}", 0.0))

    def step_time(self, f: StepFeatures) -> float:
        return (self.c0_s + self.per_prefill_token_s * f.num_prefill_tokens + self.per_decode_seq_s * f.num_decode_seqs
                + self.per_attention_pair_s * f.attention_pairs + self.per_kv_token_read_s * f.kv_tokens_read
                + self.per_prefill_context_token_s * (f.prefill_kv_tokens - f.num_prefill_tokens)
                + self.per_draft_token_s * f.num_draft_tokens)

    def decode_step_times(self, first: StepFeatures, num_steps: int) -> list[float]:
        """``step_time`` of a run of decode steps (``sim.cost.base.DecodeCostModel``): the terms in
        ``step_time``'s order, the one that varies (KV tokens read) as an array, so each float is the scalar's."""
        kv, _ = decode_steps(first, num_steps)
        head = (self.c0_s + self.per_prefill_token_s * first.num_prefill_tokens
                + self.per_decode_seq_s * first.num_decode_seqs + self.per_attention_pair_s * first.attention_pairs)
        t = head + self.per_kv_token_read_s * kv
        t = t + self.per_prefill_context_token_s * (first.prefill_kv_tokens - first.num_prefill_tokens)
        t = t + self.per_draft_token_s * first.num_draft_tokens
        return t.tolist()

    def to_dict(self) -> dict[str, Any]:
        return {"_target_": TARGET, **asdict(self)}

    def to_file(self, path: str | Path) -> Path:
        """YAML (a ready ``conf/cost_model`` option, ``_target_`` included) or JSON when the suffix is .json."""
        path = Path(path)
        text = json.dumps(self.to_dict(), indent=2) if path.suffix == ".json" else yaml.safe_dump(self.to_dict(),
                                                                                                sort_keys=False)
        path.write_text(text)
        return path

    @classmethod
    def from_mapping(cls, cfg: dict[str, Any]) -> LinearCostModel:
        cfg = dict(cfg)
        target = cfg.pop("_target_", TARGET)
        if target != TARGET:
            raise ValueError(f"cost_model._target_={target!r}; expected {TARGET!r}")
        check_keys("cost_model", cfg, [f.name for f in fields(cls)])
        return cls(**cfg)

    @classmethod
    def from_file(cls, path: str | Path) -> LinearCostModel:
        path = Path(path)
        text = path.read_text()
        cfg = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a mapping of coefficients, got {type(cfg).__name__}")
        return cls.from_mapping(cfg)
