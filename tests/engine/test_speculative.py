"""Speculative decoding on the engine: greedy outputs are token-identical to transformers under every scheduler,
chunk size, prefix caching on/off and forced preemption, whatever the drafts; acceptance follows the drafts'
quality (an oracle's drafts are all accepted, wrong ones never); KV blocks of rejected drafts go back to the pool;
rejection sampling keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch

from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, SamplingParams, Status
from engine.executor import build_engine_executor
from engine.sampler import Sampler
from engine.speculative import NgramProposer
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.orca import OrcaScheduler
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from policies.speculation.fixed import FixedDraftLength
from sim.clock import run_virtual
from tests.engine.test_serving import BLOCK, WHOLE, assert_matches_hf, setup  # noqa: F401  (module fixture)
from tests.helpers import ListWorkload


class OracleProposer:
    """Drafts from the known greedy outputs: ``right`` of every ``period`` drafts are correct, the rest wrong."""

    def __init__(self, expected: dict[str, list[int]], vocab: int, right: int = 1, period: int = 1) -> None:
        self.expected, self.vocab, self.right, self.period = expected, vocab, right, period

    def release(self, request_id):
        pass

    def propose(self, chunks, tokens):
        out = {}
        for ch in chunks:
            done = len(ch.state.output_token_ids)
            truth = self.expected[ch.state.id][done:] + [0] * ch.num_draft_tokens
            out[ch.state.id] = [t if i % self.period < self.right else (t + 1) % self.vocab
                                for i, t in enumerate(truth[:ch.num_draft_tokens])]
        return out


def serve(setup, scheduler, budget, proposer, k=3, num_blocks=64, prefix_caching=True):  # noqa: F811
    spec, model, reqs, _ = setup
    kv = KVCacheManager(num_blocks, BLOCK, LRUEviction(), prefix_caching)
    replica = Replica(0, scheduler, kv, SchedulerLimits(budget, 8, spec.max_model_len),
                      speculation=FixedDraftLength(k))
    executor = build_engine_executor(spec, kv_manager=kv, model=model)
    executor.proposer = proposer
    result = run_virtual(ServingLoop([replica], [executor], RoundRobinRouter(), ListWorkload(reqs)))
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    return {s.id: s for s in result.states}, result


@pytest.mark.parametrize("budget", [2, 7, WHOLE])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks of 4 tokens forces preemption
def test_ngram_drafts_keep_greedy_outputs_identical(setup, budget, prefix_caching, num_blocks):  # noqa: F811
    states, res = serve(setup, SarathiScheduler(), budget, NgramProposer(1, 3), num_blocks=num_blocks,
                        prefix_caching=prefix_caching)
    assert_matches_hf(states, setup[3])
    assert any(s.features.num_draft_tokens for s in res.steps)


@pytest.mark.parametrize("scheduler", [OrcaScheduler(), VLLMPrefillFirstScheduler(), PriorityScheduler()],
                         ids=lambda s: type(s).__name__)
def test_every_scheduler_budgets_drafts(setup, scheduler):  # noqa: F811
    states, res = serve(setup, scheduler, 32, NgramProposer(), num_blocks=14)
    assert_matches_hf(states, setup[3])
    assert all(s.features.num_batched_tokens <= 32 for s in res.steps)


def test_an_oracle_is_always_accepted_and_saves_steps(setup):  # noqa: F811
    spec, _, reqs, expected = setup
    states, res = serve(setup, SarathiScheduler(), WHOLE, OracleProposer(expected, spec.vocab_size), k=3)
    assert_matches_hf(states, expected)
    for s in states.values():
        assert s.num_draft_accepted == s.num_draft_proposed > 0
    # 6 new tokens: the prefill samples 1, then verify steps yield 4 (3 drafts, all accepted) and 1 (drafts capped
    # at the 1 remaining output minus 1 = 0 drafts: a plain decode)
    decode_steps = [s for s in res.steps if s.features.num_decode_seqs]
    assert len(decode_steps) <= 2 * len(reqs)


def test_wrong_drafts_are_all_rejected_and_partial_ones_partly(setup):  # noqa: F811
    spec, _, _, expected = setup
    states, _ = serve(setup, SarathiScheduler(), WHOLE, OracleProposer(expected, spec.vocab_size, right=0), k=2)
    assert_matches_hf(states, expected)
    assert all(s.num_draft_accepted == 0 < s.num_draft_proposed for s in states.values())
    # first draft right, second wrong: exactly one of every two drafts accepted where two were verified
    states, _ = serve(setup, SarathiScheduler(), WHOLE, OracleProposer(expected, spec.vocab_size, 1, 2), k=2)
    assert_matches_hf(states, expected)
    assert all(0 < s.num_draft_accepted < s.num_draft_proposed for s in states.values())


def test_rejected_draft_blocks_return_to_the_pool(setup):  # noqa: F811
    spec, model, _, _ = setup
    kv = KVCacheManager(16, BLOCK, LRUEviction(), False)
    req = Request("a", 0.0, 4, 20, prompt_token_ids=(1, 2, 3, 4))
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(64, 8, spec.max_model_len),
                      speculation=FixedDraftLength(7))
    executor = build_engine_executor(spec, kv_manager=kv, model=model)
    executor.proposer = NgramProposer()
    replica.add(req, 0.0)
    state = replica.waiting[0]
    while not state.status.terminal:
        batch = replica.schedule(0.0)
        out = executor.execute(batch)
        replica.apply(batch, out.tokens, 0.0, out.num_tokens)
        if not state.status.terminal:  # the table holds the computed tokens only: draft-only blocks were freed
            assert kv.num_blocks_held("a") == -(-state.num_computed_tokens // BLOCK)
            kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_greedy_verify_is_the_longest_matching_prefix_plus_the_targets_token():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 2, 9]):
        logits[row, tok] = 5.0
    state = RequestState(Request("x", 0.0, 1, 8))
    sampler = Sampler()
    assert sampler.verify(logits, [3, 7, 2], state) == [3, 7, 2, 9]
    assert sampler.verify(logits, [3, 1, 2], state) == [3, 7]
    assert sampler.verify(logits, [0, 7, 2], state) == [3]
    assert sampler.verify(logits[:1], [], state) == [3]


def test_rejection_sampling_keeps_the_target_distribution():
    """A one-hot draft x is accepted with probability p(x); otherwise the token is drawn from p without x: the
    first emitted token is distributed as p whatever x is."""
    p = torch.tensor([0.1, 0.3, 0.6])
    logits = p.log().repeat(2, 1)
    state = RequestState(Request("x", 0.0, 1, 8, sampling=SamplingParams(temperature=1.0, seed=3)))
    sampler = Sampler()
    n = 20000
    for draft in (0, 1, 2):
        first = torch.tensor([sampler.verify(logits, [draft], state)[0] for _ in range(n)])
        freq = torch.bincount(first, minlength=3).float() / n
        assert torch.allclose(freq, p, atol=0.015), (draft, freq)


def test_ngram_lookup():
    prop = NgramProposer(1, 3)
    assert prop.lookup([5, 6, 7, 8, 5, 6, 7], 2) == [8, 5]  # trigram 5 6 7 seen before, followed by 8 5
    assert prop.lookup([5, 6, 7, 8, 9, 6, 7], 3) == [8, 9, 6]  # bigram 6 7
    assert prop.lookup([1, 2, 3], 2) == [3, 3]  # nothing repeats: padded with the last token (rejected later)
    assert prop.lookup([4, 4], 3) == [4, 4, 4]
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)


def test_a_finished_request_drops_drafts_past_its_last_token(setup):  # noqa: F811
    spec, model, _, expected = setup
    states, _ = serve(setup, SarathiScheduler(), WHOLE, OracleProposer(expected, spec.vocab_size), k=8)
    assert all(len(s.output_token_ids) == s.request.max_new_tokens and s.status is Status.FINISHED
               for s in states.values())


def _draft_proposer(setup, executor, num_blocks=64, noise=0.0):  # noqa: F811
    import copy

    from engine.executor import build_draft_proposer

    spec, model, _, _ = setup
    draft = copy.deepcopy(model)
    if noise:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean())
    return build_draft_proposer(spec, executor.runner, num_blocks, model=draft)


def serve_draft(setup, budget, num_blocks=64, prefix_caching=True, noise=0.0, draft_blocks=64, k=3):  # noqa: F811
    spec, model, reqs, _ = setup
    kv = KVCacheManager(num_blocks, BLOCK, LRUEviction(), prefix_caching)
    replica = Replica(0, SarathiScheduler(), kv, SchedulerLimits(budget, 8, spec.max_model_len),
                      speculation=FixedDraftLength(k))
    executor = build_engine_executor(spec, kv_manager=kv, model=model)
    executor.proposer = _draft_proposer(setup, executor, draft_blocks, noise)
    result = run_virtual(ServingLoop([replica], [executor], RoundRobinRouter(), ListWorkload(reqs)))
    kv.check_invariants()
    executor.proposer.kv.check_invariants()
    assert kv.num_used_blocks == 0 and executor.proposer.kv.num_used_blocks == 0  # every shadow released
    return {s.id: s for s in result.states}


@pytest.mark.parametrize(("budget", "num_blocks", "prefix_caching"), [(WHOLE, 64, True), (5, 64, False),
                                                                       (7, 14, True)])
def test_a_draft_equal_to_the_target_is_always_accepted(setup, budget, num_blocks, prefix_caching):  # noqa: F811
    states = serve_draft(setup, budget, num_blocks, prefix_caching)
    assert_matches_hf(states, setup[3])
    assert all(s.num_draft_accepted == s.num_draft_proposed > 0 for s in states.values())


def test_a_perturbed_draft_is_partly_accepted(setup):  # noqa: F811
    """More weight noise, fewer accepted drafts; outputs identical at every level."""
    rates = []
    for noise in (0.1, 0.5, 2.0, 8.0):
        states = serve_draft(setup, WHOLE, noise=noise)
        assert_matches_hf(states, setup[3])
        rates.append(sum(s.num_draft_accepted for s in states.values())
                     / sum(s.num_draft_proposed for s in states.values()))
    assert rates[0] > rates[-1]
    assert any(0 < r < 1 for r in rates), rates


def test_a_full_draft_pool_pads_and_outputs_stay_identical(setup):  # noqa: F811
    states = serve_draft(setup, WHOLE, draft_blocks=6)  # room for one or two shadows at a time
    assert_matches_hf(states, setup[3])
