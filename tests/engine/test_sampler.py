"""Sampler: greedy, top-k, top-p support, temperature distribution, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingParams

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


def _logits(n: int) -> torch.Tensor:
    return PROBS.log().expand(n, -1).clone()


def test_greedy_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits), logits.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    sampled = Sampler(SamplingParams(temperature=1.5, top_k=1), seed=3)(logits)
    assert torch.equal(sampled, logits.argmax(-1))


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20)
    a, b, c = Sampler(params, seed=5), Sampler(params, seed=5), Sampler(params, seed=6)
    draws_a = [a(logits) for _ in range(3)]
    assert all(torch.equal(x, b(logits)) for x in draws_a)
    assert not all(torch.equal(x, c(logits)) for x in draws_a)


@pytest.mark.parametrize(("top_p", "support"), [(0.5, {1}), (0.7, {1, 3}), (0.79, {1, 3}), (0.81, {1, 3, 2}),
                                                (1.0, {0, 1, 2, 3})])
def test_top_p_restricts_support(top_p, support):
    """Nucleus = the most likely tokens until their mass reaches top_p."""
    tokens = set(Sampler(SamplingParams(temperature=1.0, top_p=top_p), seed=0)(_logits(4000)).tolist())
    assert tokens == support


def test_top_k_restricts_support():
    assert set(Sampler(SamplingParams(temperature=1.0, top_k=2), seed=0)(_logits(2000)).tolist()) == {1, 3}


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_follow_tempered_softmax(temperature):
    n = 20000
    counts = torch.bincount(Sampler(SamplingParams(temperature=temperature), seed=1)(_logits(n)), minlength=4)
    expected = (PROBS.log() / temperature).softmax(-1)
    # 5 sigma of a binomial proportion
    assert torch.all((counts / n - expected).abs() < 5 * (expected * (1 - expected) / n).sqrt())


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
