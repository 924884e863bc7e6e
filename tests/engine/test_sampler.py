"""Sampler: greedy, top-k, top-p support, temperature distribution, seeded reproducibility, per-request
params (greedy rows batched, seeded requests independent of their batch)."""

from __future__ import annotations

import pytest
import torch

from core.request import Request, RequestState
from engine.sampler import Sampler, SamplingParams, adjust

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


# ---- per-request params ---------------------------------------------------------------------------------------
def _states(*samplings: SamplingParams | None, prefix: str = "r") -> list[RequestState]:
    return [RequestState(Request(f"{prefix}{i}", 0.0, 4, 8, sampling=s)) for i, s in enumerate(samplings)]


def test_default_rows_take_the_batched_path_unchanged():
    """Rows without their own params: the same draws as a call without states (one generator stream)."""
    logits = torch.randn(12, 50, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=0.8, top_k=10)
    a, b = Sampler(params, seed=2), Sampler(params, seed=2)
    states = _states(*[None] * 12)
    for _ in range(3):
        assert torch.equal(a(logits), b(logits, states))


def test_greedy_rows_unchanged_by_random_rows():
    logits = torch.randn(9, 50, generator=torch.Generator().manual_seed(8))
    hot = SamplingParams(temperature=2.0)
    mix = [None, hot, None, SamplingParams(temperature=1.0, seed=4), SamplingParams(), hot,
           SamplingParams(temperature=0.0, seed=9), SamplingParams(temperature=1.0, top_p=0.5), None]
    out = Sampler(seed=1)(logits, _states(*mix))
    greedy = [i for i, p in enumerate(mix) if p is None or p.greedy]
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert out.dtype == torch.int64 and out.shape == (9,)
    # a random default with greedy requests: the greedy rows are argmax too
    out = Sampler(SamplingParams(temperature=1.0), seed=1)(logits, _states(*[SamplingParams()] * 4, *[None] * 5))
    assert torch.equal(out[:4], logits[:4].argmax(-1))


def test_seeded_request_draws_the_same_alone_and_batched():
    """A request with a seed gets the same tokens step after step whatever shares its steps (other seeded
    requests, unseeded random rows, greedy rows, a different engine seed)."""
    gen = torch.Generator().manual_seed(9)
    steps = [torch.randn(6, 50, generator=gen) for _ in range(5)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=30, seed=1234)
    alone_sampler, alone = Sampler(seed=0), _states(seeded, prefix="a")[0]
    solo = [alone_sampler(step[2:3], [alone]).item() for step in steps]
    batched_sampler = Sampler(SamplingParams(temperature=1.0), seed=5)
    batch = _states(None, SamplingParams(temperature=1.0, seed=99), seeded, SamplingParams(temperature=0.5),
                    SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, top_k=30, seed=77), prefix="b")
    mixed = [batched_sampler(step, batch)[2].item() for step in steps]
    assert mixed == solo
    # sanity: the draws are random (another seed differs), not the argmax
    other = _states(SamplingParams(temperature=1.0, top_p=0.9, top_k=30, seed=4321), prefix="c")[0]
    sampler = Sampler()
    assert [sampler(step[2:3], [other]).item() for step in steps] != solo
    assert solo != [step[2].argmax().item() for step in steps]


def test_seeded_generators_are_per_request_and_released():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(10))
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler()
    (s,) = _states(params)
    first = [sampler(logits, [s]).item() for _ in range(6)]
    (again,) = _states(params)  # a new request under the same id starts its stream afresh
    assert [sampler(logits, [again]).item() for _ in range(6)] == first
    sampler.release(again.id)
    assert "r0" not in sampler._seeded
    with pytest.raises(ValueError, match="rows"):
        sampler(torch.randn(2, 50), [s])
    with pytest.raises(ValueError, match="seed"):
        Sampler(SamplingParams(temperature=1.0, seed=1))


def test_per_request_top_k_in_a_batch():
    """Unseeded rows with their own params draw from the engine's generator with those params."""
    states = _states(SamplingParams(temperature=1.0, top_k=2), None, SamplingParams(temperature=1.0, top_p=0.5))
    logits = torch.cat([_logits(1)] * 3)
    sampler = Sampler(seed=0)
    rows = torch.stack([sampler(logits, states) for _ in range(400)])
    assert set(rows[:, 0].tolist()) == {1, 3} and set(rows[:, 1].tolist()) == {1} and set(rows[:, 2].tolist()) == {1}


def _reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """OpenAI / vLLM logit adjustments written out per token: bias, then repetition, frequency, presence."""
    row = list(row)
    for t, b in p.logit_bias:
        row[t] += b
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


@pytest.mark.parametrize("p", [SamplingParams(logit_bias=((3, 5.0), (0, -100.0))),
                               SamplingParams(repetition_penalty=1.7), SamplingParams(frequency_penalty=0.8),
                               SamplingParams(presence_penalty=-1.5, frequency_penalty=0.3, repetition_penalty=0.6,
                                              logit_bias=((2, 1.0),))])
def test_penalties_and_bias_match_the_reference(p):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 12, generator=g)
    states = []
    for i in range(3):
        s = RequestState(Request(f"r{i}", 0.0, 3, 8, prompt_token_ids=(1, 5, 5), sampling=p))
        s.output_token_ids = [[], [2, 2, 7], [5, 9, 2, 2, 2]][i]
        states.append(s)
    ref = torch.tensor([_reference(logits[i].tolist(), p, [1, 5, 5], s.output_token_ids)
                        for i, s in enumerate(states)])
    adjusted = torch.stack([adjust(logits[i], p, s) for i, s in enumerate(states)])
    torch.testing.assert_close(adjusted, ref)
    assert not torch.equal(adjusted, logits)  # the adjustment changes something here
    sampler = Sampler()
    assert not sampler.all_greedy(states)  # the model must hand over the full logits
    assert torch.equal(sampler(logits, states), ref.argmax(-1))


def test_logprobs_of_the_raw_distribution():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(6))
    states = [RequestState(Request(f"r{i}", 0.0, 1, 4, sampling=SamplingParams(logprobs=3, logit_bias=((0, 50.0),))))
              for i in range(2)]
    assert Sampler()(logits, states).tolist() == [0, 0]  # the bias picks token 0 ...
    logp = logits.log_softmax(-1)
    for i, s in enumerate(states):
        (lp, alts), = s.logprobs  # ... and its logprob is the model's own
        assert lp == pytest.approx(float(logp[i, 0]))
        assert [t for t, _ in alts] == logp[i].topk(3).indices.tolist()


@pytest.mark.parametrize("kwargs", [{"temperature": 1e-40}, {"temperature": float("nan")},
                                    {"temperature": float("inf")}, {"top_p": float("nan")},
                                    {"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                                    {"repetition_penalty": 0}, {"logit_bias": ((1, 101.0),)}, {"logprobs": 21}])
def test_non_finite_or_out_of_range_params_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_verify_applies_penalties_with_the_drafts_in_the_history():
    """A greedy request with a repetition penalty: verifying drafts gives what one-token steps give, each row
    penalised with the drafts before it."""
    p = SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0, logprobs=1)
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(9))
    state = RequestState(Request("r", 0.0, 2, 8, prompt_token_ids=(1, 2), sampling=p))
    state.output_token_ids = [5]
    want, shadow = [], RequestState(state.request, output_token_ids=[5])
    for i in range(4):  # sequential greedy decodes: row i sees the tokens chosen before it
        want.append(int(adjust(logits[i], p, shadow).argmax()))
        shadow.output_token_ids.append(want[-1])
    drafts = want[:3]
    assert Sampler().verify(logits, drafts, state) == want  # every draft accepted, plus the bonus token
    assert len(state.logprobs) == 4
    wrong = [want[0], (want[1] + 1) % 12, 0]
    assert Sampler().verify(logits, wrong, state) == want[:2]  # stops at the first mismatch with the target's token
