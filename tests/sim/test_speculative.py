"""Speculative decoding in the simulator: the acceptance model against its formula, the draft cost by hand, the
adaptive draft-length policy's choices, and request accounting / KV invariants under random workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batch import Batch, Chunk, StepFeatures
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, Status
from experiments.build import CONF_DIR
from experiments.run import run
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.lpm import LPMScheduler
from policies.schedulers.orca import OrcaScheduler
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.vllm_prefill_first import VLLMPrefillFirstScheduler
from policies.speculation.adaptive import AdaptiveDraftLength
from policies.speculation.fixed import FixedDraftLength
from sim.clock import run_virtual
from sim.executor import CostModelExecutor
from sim.speculative import SpeculativeModel, expected_tokens
from tests.helpers import ListWorkload


def cfg_with(*overrides, name="config"):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


class TokensCost:
    """1 ms per batched token: easy to price by hand."""

    def step_time(self, f: StepFeatures) -> float:
        return 1e-3 * f.num_batched_tokens


@pytest.mark.parametrize(("alpha", "k", "want"), [(0.5, 3, 1.875), (0.0, 4, 1.0), (1.0, 4, 5.0), (0.8, 1, 1.8)])
def test_expected_tokens_formula(alpha, k, want):
    assert expected_tokens(alpha, k) == pytest.approx(want)


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 2), (0.7, 4), (0.9, 8)])
def test_sampled_acceptance_matches_the_formula(alpha, k):
    model = SpeculativeModel(alpha, seed=1)
    mean = np.mean([1 + model.accepted(k) for _ in range(40000)])
    assert mean == pytest.approx(expected_tokens(alpha, k), rel=0.02)


def test_bad_acceptance_rate_is_refused():
    for bad in (-0.1, 1.5, "high", True):
        with pytest.raises(ValueError, match="spec.acceptance_rate"):
            SpeculativeModel(bad)


def _decoding(rid: str, context: int, drafts: int) -> Chunk:
    st_ = RequestState(Request(rid, 0.0, context - 1, 50))
    st_.output_token_ids.append(0)
    st_.num_computed_tokens = context - 1
    return Chunk.next(st_, 1, drafts)


def test_draft_model_cost_by_hand():
    """Two decodes at context 10 with 3 and 1 drafts: the draft's first pass covers the step's 2 decode tokens
    (2 ms), then passes for draft 2 and 3 over the decodes still drafting (1 each: 1 ms + 1 ms)."""
    batch = Batch([_decoding("a", 10, 3), _decoding("b", 10, 1)])
    assert batch.features.num_draft_tokens == 4 and batch.features.num_batched_tokens == 6
    assert batch.features.kv_tokens_read == (10 + 3) + (10 + 1)
    model = SpeculativeModel(0.5, draft_cost=TokensCost())
    assert model.draft_time(batch) == pytest.approx(4e-3)
    assert SpeculativeModel(0.5).draft_time(batch) == 0.0  # n-gram drafting is free


def test_only_decodes_carry_drafts():
    st_ = RequestState(Request("p", 0.0, 8, 4))
    with pytest.raises(ValueError, match="only a decode chunk"):
        Chunk.next(st_, 8, 2)


def test_adaptive_policy_speculates_at_small_batches_and_high_acceptance():
    pol = AdaptiveDraftLength(max_k=8, prior_acceptance=0.8, prior_weight=10, draft_cost=0.0, saturation_batch=64)
    st_ = RequestState(Request("x", 0.0, 4, 64))
    small, large = pol.num_draft_tokens(st_, 1), pol.num_draft_tokens(st_, 256)
    assert small > 0 and large == 0
    # by hand at batch 1: value(k) = (1 - .8^(k+1)) / .2 / (1 + k/64); k=8 maximises it among 0..8
    values = [(1 - 0.8 ** (k + 1)) / 0.2 / (1 + k / 64) for k in range(9)]
    assert small == int(np.argmax(values))
    st_.num_draft_proposed, st_.num_draft_accepted = 1000, 50  # measured: drafts are almost never accepted
    assert pol.num_draft_tokens(st_, 1) == 1  # free drafts at batch 1: (1 + .058) / (1 + 1/64) > 1 still pays
    costly = AdaptiveDraftLength(max_k=8, prior_acceptance=0.8, prior_weight=10, draft_cost=0.1, saturation_batch=64)
    assert costly.num_draft_tokens(st_, 1) == 0  # a draft model's passes: (1 + .058) / 1.116 < 1


SCHEDULERS = [SarathiScheduler, OrcaScheduler, VLLMPrefillFirstScheduler, PriorityScheduler, LPMScheduler]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SCHEDULERS), st.integers(0, 6), st.floats(0, 1), st.integers(8, 40), st.booleans(),
       st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.floats(0, 0.05)), min_size=1, max_size=12),
       st.integers(0, 2**16))
def test_speculative_runs_lose_nothing_and_leak_nothing(sched, k, alpha, num_blocks, caching, reqs, seed):
    kv = KVCacheManager(num_blocks, 4, LRUEviction(), caching)
    replica = Replica(0, sched(), kv, SchedulerLimits(48, 8, 4096), speculation=FixedDraftLength(k))
    requests = [Request(f"r{i}", t, p, n, hash_ids=(i % 3,) * 2, tokens_per_hash_id=20)
                for i, (p, n, t) in enumerate(reqs)]
    ex = CostModelExecutor(TokensCost(), speculation=SpeculativeModel(alpha, seed=seed))
    result = run_virtual(ServingLoop([replica], [ex], RoundRobinRouter(), ListWorkload(requests)))
    kv.check_invariants()
    assert kv.num_used_blocks == 0
    assert len(result.states) == len(requests)
    for s in result.states:
        assert s.status in (Status.FINISHED, Status.REJECTED), s.status
        if s.status is Status.FINISHED:
            assert s.num_output_tokens == s.request.max_new_tokens
            assert 0 <= s.num_draft_accepted <= s.num_draft_proposed
            assert list(s.token_times) == sorted(s.token_times)
        else:
            assert s.reason
    assert all(r.features.num_batched_tokens <= 48 for r in result.steps)


def test_sim_run_with_speculation_is_reproducible_and_reports_acceptance(tmp_path):
    over = ["spec=ngram", "spec.acceptance_rate=0.6", "workload.num_requests=20", "output.plots=false"]
    m1 = run(cfg_with(*over), tmp_path / "a")
    run(cfg_with(*over), tmp_path / "b")
    for name in ("requests.csv", "tokens.csv", "steps.csv", "metrics.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert m1["num_completed"] == 20 and m1["draft_tokens_proposed"] > 0
    assert m1["draft_acceptance_alpha"] == pytest.approx(0.6, abs=0.06)  # the configured alpha, measured back
    assert m1["draft_acceptance_rate"] < m1["draft_acceptance_alpha"]  # drafts after a rejection count as lost
    plain = json.loads(run(cfg_with("workload.num_requests=20", "output.plots=false"), tmp_path / "c") and
                       (tmp_path / "c" / "metrics.json").read_text())
    assert plain["draft_acceptance_alpha"] is None and plain["draft_tokens_proposed"] == 0
    assert plain["output_tokens"] == m1["output_tokens"]


def test_full_acceptance_yields_k_plus_one_tokens_per_verify(tmp_path):
    run(cfg_with("spec=ngram", "spec.acceptance_rate=1.0", "spec.num_speculative_tokens=3", "workload.num_requests=5",
                 "output.plots=false"), tmp_path)
    rows = (tmp_path / "tokens.csv").read_text().splitlines()[1:]
    events = [int(r.split(",")[-1]) for r in rows]
    assert max(events) == 4 and events.count(4) > len(events) // 2


def test_bad_spec_config_names_the_key():
    with pytest.raises(ValueError, match="spec.method"):
        run(cfg_with("spec=ngram", "spec.method=magic", "workload.num_requests=2", "output.plots=false"), "/tmp/x")
    with pytest.raises(ValueError, match="spec.draft_model='tiny': vocabulary"):
        run(cfg_with("spec=draft", "spec.draft_model=tiny", "model=llama3_8b", "hardware=h100",
                     "cost_model=roofline", "workload.num_requests=2", "output.plots=false"), "/tmp/x")


def test_calibration_grid_has_verify_shapes_and_the_fit_prices_drafts():
    from experiments.calibration.grid import config_grid
    from experiments.config import RunConfig
    from sim.cost.base import decode_features
    from sim.fit import fit_linear

    cfg = cfg_with("spec=ngram", "spec.num_speculative_tokens=3", name="calibrate")
    shapes, _, grid = config_grid(RunConfig.from_config(cfg), cfg.calibrate.grid)
    verify = [s for s in shapes if s.group == "verify"]
    assert grid["verify_drafts"] == [3] and verify and all(s.drafts == 3 for s in verify)
    off = cfg_with(name="calibrate")
    assert not [s for s in config_grid(RunConfig.from_config(off), off.calibrate.grid)[0]
                if s.group == "verify"]  # spec off: none
    # steps priced with a known per-draft cost: the fit recovers it
    truth = {"c0_s": 1e-3, "per_decode_seq_s": 2e-4, "per_kv_token_read_s": 1e-7, "per_draft_token_s": 5e-4}
    steps = []
    for b in (1, 4, 16):
        for ctx in (64, 512):
            for k in (0, 2, 4):
                f = decode_features(b, ctx)
                steps.append(StepFeatures(**{**{n: getattr(f, n) for n in StepFeatures.names()},
                                             "num_batched_tokens": b * (1 + k), "num_draft_tokens": b * k,
                                             "kv_tokens_read": b * (ctx + k)}))
    y = [truth["c0_s"] + truth["per_decode_seq_s"] * f.num_decode_seqs + truth["per_kv_token_read_s"] * f.kv_tokens_read
         + truth["per_draft_token_s"] * f.num_draft_tokens for f in steps]
    model, rep = fit_linear(steps, y)
    assert model.per_draft_token_s == pytest.approx(5e-4, rel=1e-6)
    assert set(rep.groups) == {"decode", "verify"}


def test_policies_are_a_config_group_and_k_one_key(tmp_path):
    m = run(cfg_with("spec=ngram", "spec/policy=adaptive", "workload.num_requests=8", "output.plots=false"),
            tmp_path / "adaptive")
    assert m["draft_tokens_proposed"] > 0
    cfg = cfg_with("spec=ngram", "spec.num_speculative_tokens=2")
    assert cfg.spec.policy.k == 2
    m = run(cfg, tmp_path / "k2")
    rows = (tmp_path / "k2" / "steps.csv").read_text().splitlines()
    col = rows[0].split(",").index("num_draft_tokens")
    seqs = rows[0].split(",").index("num_decode_seqs")
    assert all(int(r.split(",")[col]) <= 2 * int(r.split(",")[seqs]) for r in rows[1:])


class _Asks:
    def __init__(self, k) -> None:
        self.k = k

    def num_draft_tokens(self, state, num_running):
        return self.k


@pytest.mark.parametrize("k", [-3, 2.5, None])
def test_a_draft_count_that_is_not_a_non_negative_int_is_refused_naming_the_policy(k):
    """-3 was clamped to 0 and 2.5 truncated to 2 without a word; None failed in int()."""
    replica = Replica(0, SarathiScheduler(), KVCacheManager(32, 4, LRUEviction()), SchedulerLimits(48, 8, 4096),
                      speculation=_Asks(k))
    ex = CostModelExecutor(TokensCost(), speculation=SpeculativeModel(0.7, seed=0))
    loop = ServingLoop([replica], [ex], RoundRobinRouter(), ListWorkload([Request("r0", 0.0, 4, 6)]))
    with pytest.raises(RuntimeError, match=rf"_Asks\.num_draft_tokens returned {k!r}; allowed: an integer >= 0"):
        run_virtual(loop)


def test_a_numpy_draft_count_is_taken():
    replica = Replica(0, SarathiScheduler(), KVCacheManager(32, 4, LRUEviction()), SchedulerLimits(48, 8, 4096),
                      speculation=_Asks(np.int64(2)))
    ex = CostModelExecutor(TokensCost(), speculation=SpeculativeModel(1.0, seed=0))
    result = run_virtual(ServingLoop([replica], [ex], RoundRobinRouter(), ListWorkload([Request("r0", 0.0, 4, 7)])))
    assert result.states[0].status is Status.FINISHED and result.states[0].num_draft_proposed > 0
