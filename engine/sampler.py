"""Next-token sampling: greedy, or temperature with top-k / top-p (nucleus) filtering from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One setting for every request of an engine (per-request parameters can come later)."""

    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0: no limit

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns logits [n, V] into token ids [n] (int64); random draws come from one seeded torch.Generator."""

    def __init__(self, params: SamplingParams | None = None, seed: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.params = params or SamplingParams()
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.greedy:
            return logits.max(dim=-1).indices  # faster than argmax on CPU; same first-maximum rule
        logits = logits.float() / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token once the more likely ones already hold top_p of the mass (the first always stays)
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            drop[:, 0] = False
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
