"""What a serving system spends per step besides the forward pass: the server terms, composed with any cost model.

A cost model prices the forward pass of a step. A server also schedules the step, launches it, and turns its
sampled tokens into output (detokenise, stream), and on a CPU box that work competes with the forward pass for
the same cores. vLLM v1 (async scheduling) overlaps part of it with the forward. Named coefficients, each of which a
fit may set to zero (``ServerTerms()`` adds nothing, and ``with_server_terms`` then returns the model itself):

    host    = per_step_s + per_running_seq_s x sequences in the step + per_output_token_s x tokens it samples
    step    = forward + host - overlap x min(host, forward)

``overlap`` in [0, 1]: the fraction of the host work hidden behind the forward pass (1: as long as the forward
lasts, the host work is free). The fourth server term, the per-request front-end time (HTTP, tokenisation), is not
a step's: it is ``frontend_delay_s`` of a calibration file, which the serving loop adds between a request's arrival
and its dispatch. Tokens sampled by a step: one per decode, one per prefill chunk (a chunk that does not finish its
prompt samples none; the features do not tell those apart, so a split prompt's earlier chunks count one too).

``ServerCostModel`` is the one place the terms are applied: ``sim.cost.calibrated.load_calibration`` wraps the file's
model in it when the file has a ``server_terms`` section, whatever the model (linear, roofline, profiled).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from core.batch import StepFeatures
from core.checks import check_float, check_keys
from sim.cost.base import CostModel, DecodeCostModel


@dataclass(frozen=True)
class ServerTerms:
    """Seconds (``overlap``: a fraction in [0, 1]); all default to 0: no server work besides the forward pass."""

    per_step_s: float = 0.0  # scheduling + launch, per step
    per_running_seq_s: float = 0.0  # scheduling + launch growing with the requests in the step
    per_output_token_s: float = 0.0  # output processing (detokenise, stream) per sampled token
    overlap: float = 0.0  # fraction of the host work that runs during the forward pass (vLLM v1 async scheduling)

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_float(getattr(self, f.name), f"server_terms.{f.name}", 0.0))
        if self.overlap > 1.0:
            raise ValueError(f"server_terms.overlap={self.overlap!r}; allowed: a fraction in [0, 1]")

    @property
    def zero(self) -> bool:
        return all(getattr(self, f.name) == 0.0 for f in fields(self))

    def host_s(self, f: StepFeatures) -> float:
        """The step's host work (scheduling, launch, output processing), before any overlap."""
        return (self.per_step_s + self.per_running_seq_s * f.num_seqs
                + self.per_output_token_s * (f.num_decode_seqs + f.num_prefill_seqs))

    def compose(self, forward_s: float, f: StepFeatures) -> float:
        """The step's duration: forward + host - overlap x min(host, forward)."""
        host = self.host_s(f)
        return forward_s + host - self.overlap * min(host, forward_s)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any] | None) -> ServerTerms:
        cfg = dict(cfg or {})
        check_keys("server_terms", cfg, [f.name for f in fields(cls)])
        return cls(**cfg)


class ServerCostModel:
    """A cost model's forward pass plus the server terms (see the module docstring)."""

    def __init__(self, forward: CostModel, terms: ServerTerms) -> None:
        self.forward, self.terms = forward, terms

    def step_time(self, f: StepFeatures) -> float:
        return self.terms.compose(self.forward.step_time(f), f)

    def decode_step_times(self, first: StepFeatures, num_steps: int) -> list[float]:
        """``step_time`` of a decode run (``sim.cost.base.DecodeCostModel``): the host work is the same every step
        (same sequences, one token each), so ``compose``'s expression over the forward times' array."""
        if isinstance(self.forward, DecodeCostModel):
            fwd = np.asarray(self.forward.decode_step_times(first, num_steps), dtype=float)
        else:
            from core.fast_forward import decode_features

            fwd = np.array([self.forward.step_time(decode_features(first, m)) for m in range(num_steps)], dtype=float)
        host = self.terms.host_s(first)
        return (fwd + host - self.terms.overlap * np.minimum(host, fwd)).tolist()

    def __getattr__(self, name: str) -> Any:  # the wrapped model's own attributes (its coverage report) stay readable
        if name in ("forward", "terms"):
            raise AttributeError(name)
        return getattr(self.forward, name)


def with_server_terms(model: CostModel, terms: ServerTerms | Mapping[str, Any] | None) -> CostModel:
    """``model`` with the server terms; the model itself when there are none (or all are zero)."""
    terms = terms if isinstance(terms, ServerTerms) else ServerTerms.from_mapping(terms)
    return model if terms.zero else ServerCostModel(model, terms)
