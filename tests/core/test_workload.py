"""Synthetic, closed-loop and prefix-sharing workloads; length and arrival distributions; config building."""

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from core.interfaces import Workload
from core.prompt import block_hashes, materialize
from core.request import Request, RequestState, Status
from core.workload import ClosedLoopWorkload, MultiTurnWorkload, SharedPrefixWorkload, SyntheticWorkload
from core.workload.arrivals import make_arrivals
from core.workload.lengths import make_length
from experiments.build import build_workload

CONF = Path(__file__).resolve().parents[2] / "conf" / "workload"
SHAREGPT = "../shared/data/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def _rng(seed=0):
    return np.random.default_rng(seed)


def _finished(req: Request, n_out: int | None = None, status=Status.FINISHED) -> RequestState:
    n = req.max_new_tokens if n_out is None else n_out
    return RequestState(request=req, status=status, output_token_ids=[0] * n)


def _gaps(spec, n):
    it = make_arrivals(spec).times(_rng())
    t = np.array([next(it) for _ in range(n + 1)])
    assert t[0] == 0.0
    return np.diff(t)


# ---- lengths


def test_fixed_and_uniform_lengths():
    assert (make_length(7, "x").sample(_rng(), 100) == 7).all()
    u = make_length({"kind": "uniform", "low": 3, "high": 5}, "x").sample(_rng(), 5000)
    assert set(u.tolist()) == {3, 4, 5}


def test_lognormal_mean_median_and_clip():
    mean = make_length({"kind": "lognormal", "mean": 200, "sigma": 0.4}, "x").sample(_rng(), 100_000)
    assert abs(mean.mean() - 200) < 2  # E = exp(mu + sigma^2/2)
    med = make_length({"kind": "lognormal", "median": 200, "sigma": 0.8}, "x").sample(_rng(), 100_000)
    assert abs(np.median(med) - 200) < 3
    clipped = make_length({"kind": "lognormal", "mean": 200, "sigma": 2.0, "min": 50, "max": 300}, "x")
    x = clipped.sample(_rng(), 10_000)
    assert x.min() == 50 and x.max() == 300


def test_empirical_lengths_come_from_the_column():
    col = np.loadtxt(Path(__file__).resolve().parents[3] / "shared/data/traces/"
                     "sharegpt_8k_filtered_stats_llama2_tokenizer.csv", delimiter=",", skiprows=1, usecols=0)
    x = make_length({"kind": "empirical", "path": SHAREGPT, "column": "num_prefill_tokens"}, "p").sample(_rng(), 2000)
    assert set(x.tolist()) <= set(col.astype(int).tolist())
    clipped = make_length({"kind": "empirical", "path": SHAREGPT, "column": "num_prefill_tokens", "max": 100}, "p")
    assert clipped.sample(_rng(), 2000).max() <= 100


@pytest.mark.parametrize("spec, words", [
    ({"kind": "zipf"}, ["prompt_len.kind", "allowed"]),
    ({"kind": "lognormal", "sigma": 0.5}, ["mean", "median"]),
    ({"kind": "lognormal", "mean": 10, "median": 10, "sigma": 0.5}, ["exactly one"]),
    ({"kind": "fixed", "value": 0}, ["prompt_len.value", ">= 1"]),
    ({"kind": "uniform", "low": 5, "high": 2}, ["prompt_len.high"]),
    ({"kind": "fixed", "value": 3, "sigma": 1}, ["unknown keys", "sigma"]),
    ({"kind": "empirical", "path": SHAREGPT, "column": "nope"}, ["no column 'nope'"]),
    ({"kind": "empirical", "path": "no/such.csv", "column": "x"}, ["no such file"]),
])
def test_bad_length_specs_name_the_key(spec, words):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        make_length(spec, "prompt_len")
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize("cell, words", [
    ("inf", [":3:", "'len'", "not a finite number"]),
    ("nan", [":3:", "'len'", "not a finite number"]),
    ("2.5", [":3:", "'len'", "not a whole number", "'2.5'"]),
])
def test_a_bad_empirical_cell_names_its_line(tmp_path, cell, words):
    f = tmp_path / "lens.csv"
    f.write_text(f"len\n12.0\n{cell}\n")
    with pytest.raises(ValueError) as e:
        make_length({"kind": "empirical", "path": str(f), "column": "len"}, "prompt_len")
    assert str(e.value).startswith(f"{f}:") and all(w in str(e.value) for w in words)


# ---- arrivals


def test_poisson_mean_gap_and_cv():
    g = _gaps({"kind": "poisson", "rate_rps": 4.0}, 40_000)
    assert abs(g.mean() - 0.25) < 0.25 * 0.02
    assert abs(g.std() / g.mean() - 1.0) < 0.03


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_rate_and_cv(cv):
    g = _gaps({"kind": "gamma", "rate_rps": 10.0, "cv": cv}, 60_000)
    assert abs(g.mean() - 0.1) < 0.1 * 0.04
    assert abs(g.std() / g.mean() - cv) < 0.06 * cv


def test_fixed_rate_is_exact():
    it = make_arrivals({"kind": "fixed", "rate_rps": 8.0}).times(_rng())
    assert [next(it) for _ in range(5)] == [0.0, 0.125, 0.25, 0.375, 0.5]


def test_trace_timestamps_as_arrivals():
    a = make_arrivals({"kind": "trace", "path": "../shared/data/traces/AzureLLMInferenceTrace_conv.csv", "limit": 3,
                       "time_scale": 0.5})
    assert list(a.times(_rng())) == pytest.approx([0.0, 4.314579 / 2, 4.541877 / 2])


@pytest.mark.parametrize("spec", [{"kind": "poisson"}, {"kind": "poisson", "rate_rps": 0},
                                  {"kind": "gamma", "rate_rps": 1, "cv": -1}, {"kind": "poisson", "rate_rps": 1,
                                                                               "cv": 2}, {"kind": "burst"}])
def test_bad_arrival_specs(spec):
    with pytest.raises(ValueError, match="arrival"):
        make_arrivals(spec)


# ---- synthetic open loop

ARR = {"kind": "poisson", "rate_rps": 4.0}
SYNTH = "core.workload.SyntheticWorkload"
PLEN = {"kind": "lognormal", "mean": 128, "sigma": 0.5, "max": 512}


def test_synthetic_is_deterministic_sorted_and_bounded():
    mk = lambda seed, **kw: list(SyntheticWorkload(ARR, PLEN, 16, seed=seed, **kw).initial())
    a, b = mk(1, num_requests=50, warmup_requests=5), mk(1, num_requests=50, warmup_requests=5)
    c = mk(2, num_requests=50)
    assert a == b and a != c and len(a) == 50
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a, a[1:], strict=False))
    assert [r.warmup for r in a] == [True] * 5 + [False] * 45
    assert len({r.id for r in a}) == 50
    d = mk(1, num_requests=1000, duration_s=3.0)
    assert d[-1].arrival_s <= 3.0 and 4 < len(d) < 25


def test_synthetic_lengths_do_not_depend_on_rate():
    fast = SyntheticWorkload({"kind": "poisson", "rate_rps": 40}, PLEN, PLEN, num_requests=30, seed=3)
    slow = SyntheticWorkload({"kind": "gamma", "rate_rps": 1, "cv": 2}, PLEN, PLEN, num_requests=30, seed=3)
    lens = lambda w: [(r.prompt_len, r.max_new_tokens) for r in w.initial()]
    assert lens(fast) == lens(slow)


def test_synthetic_tenants_and_unique_content():
    reqs = list(SyntheticWorkload(ARR, 64, 4, num_requests=200, num_tenants=3).initial())
    assert {r.tenant for r in reqs} == {"tenant0", "tenant1", "tenant2"}
    hashes = [set(block_hashes(r, 16)) for r in reqs[:20]]
    assert all(not (hashes[i] & hashes[j]) for i in range(20) for j in range(i))


# ---- closed loop


def _drive(wl, service_s=1.0):
    """A tiny event loop: every request takes ``service_s``; returns (requests in issue order, max in flight)."""
    pending = sorted(wl.initial(), key=lambda r: r.arrival_s)
    issued, in_flight, peak, events = list(pending), 0, 0, [(r.arrival_s + service_s, r) for r in pending]
    in_flight = peak = len(events)
    while events:
        events.sort(key=lambda e: (e[0], e[1].id))
        t, r = events.pop(0)
        in_flight -= 1
        nxt = wl.on_finish(_finished(r), t)
        if nxt is not None:
            assert nxt.arrival_s >= t
            issued.append(nxt)
            events.append((nxt.arrival_s + service_s, nxt))
            in_flight += 1
            peak = max(peak, in_flight)
    return issued, peak


def test_closed_loop_on_finish_semantics():
    wl = ClosedLoopWorkload(num_clients=3, prompt_len=32, output_len=4, num_requests=10, think_time_s=0.5,
                            num_tenants=3, warmup_requests=2)
    first = list(wl.initial())
    assert [r.arrival_s for r in first] == [0.0, 0.0, 0.0] and [r.tenant for r in first] == ["tenant0", "tenant1",
                                                                                              "tenant2"]
    nxt = wl.on_finish(_finished(first[1]), now=2.0)
    assert nxt.arrival_s == 2.5 and nxt.tenant == "tenant1"  # the same client, after its think time
    with pytest.raises(ValueError, match="not issued"):
        wl.on_finish(_finished(first[1]), now=3.0)  # ended twice
    issued, peak = _drive(wl)
    assert len(issued) == 10 and peak == 3 and len({r.id for r in issued}) == 10
    assert sum(r.warmup for r in issued) == 2


def test_closed_loop_rejected_client_moves_on_and_duration_bound():
    wl = ClosedLoopWorkload(num_clients=2, prompt_len=8, output_len=2, duration_s=5.0, think_time_s=1.0,
                            think="exponential", stagger_s=0.25)
    first = list(wl.initial())
    assert [r.arrival_s for r in first] == [0.0, 0.25]
    assert wl.on_finish(_finished(first[0], 0, Status.REJECTED), 0.0) is not None
    issued, _ = _drive(wl)
    assert all(r.arrival_s <= 5.0 for r in issued) and len(issued) > 2
    again, _ = _drive(wl)
    assert [(r.id, r.arrival_s, r.prompt_len) for r in again] == [(r.id, r.arrival_s, r.prompt_len) for r in issued]


# ---- shared prefix and multi-turn


@pytest.mark.parametrize("prefix_len", [96, 100])
def test_shared_prefix_sharing_is_exact(prefix_len):
    wl = SharedPrefixWorkload(ARR, num_groups=3, prefix_len=prefix_len, suffix_len={"kind": "uniform", "low": 1,
                              "high": 40}, output_len=4, num_requests=60, num_tenants=2, assignment="round_robin")
    reqs = list(wl.initial())
    groups = [reqs[g::3] for g in range(3)]
    assert [r.tenant for r in reqs[:4]] == ["tenant0", "tenant1", "tenant0", "tenant0"]
    bs = 4  # engine block size dividing both prefix lengths, so the whole prefix is in full blocks
    for grp in groups:
        hs = [block_hashes(r, bs) for r in grp]
        toks = [materialize(r, 32000) for r in grp[:4]]
        assert all(h[:prefix_len // bs] == hs[0][:prefix_len // bs] for h in hs)
        assert all(t[:prefix_len] == toks[0][:prefix_len] for t in toks)
        # the suffixes are unique: no block past the prefix is shared within the group
        tails = [set(h[prefix_len // bs:]) for h in hs]
        assert all(not (tails[i] & tails[j]) for i in range(len(tails)) for j in range(i))
    alls = [{h for r in grp for h in block_hashes(r, bs)} for grp in groups]
    assert not (alls[0] & alls[1]) and not (alls[0] & alls[2]) and not (alls[1] & alls[2])
    # groups 0 and 2 are both tenant0 but have different prompts; same ids under another tenant never match
    r = groups[0][0]
    other = Request(r.id, r.arrival_s, r.prompt_len, 1, hash_ids=r.hash_ids, tokens_per_hash_id=r.tokens_per_hash_id,
                    tenant="tenant9")
    assert not set(block_hashes(r, bs)) & set(block_hashes(other, bs))


def test_shared_prefix_zipf_popularity():
    wl = SharedPrefixWorkload(ARR, num_groups=4, prefix_len=32, suffix_len=8, output_len=2, num_requests=2000,
                              zipf_s=1.5)
    first = [r.hash_ids[0] for r in wl.initial()]
    counts = [first.count(g * 2) for g in range(4)]  # 32 tokens / 16 per id: group g's ids start at 2g
    assert counts == sorted(counts, reverse=True) and counts[0] > 2 * counts[1]


def test_multi_turn_prompts_extend_the_previous_turn():
    wl = MultiTurnWorkload(ARR, user_len={"kind": "uniform", "low": 5, "high": 30}, output_len={"kind": "uniform",
                           "low": 3, "high": 20}, num_turns=3, num_sessions=4, system_prompt_len=20,
                           think_time_s=0.5)
    firsts = list(wl.initial())
    assert len(firsts) == 4
    bs = 4  # divides the 20-token system prompt
    sys_hashes = [block_hashes(r, bs)[:5] for r in firsts]
    assert all(h == sys_hashes[0] for h in sys_hashes)
    assert not set(block_hashes(firsts[0], bs)[5:]) & set(block_hashes(firsts[1], bs)[5:])
    turn, n_out = firsts[0], 7
    for t in range(1, 3):
        nxt = wl.on_finish(_finished(turn, n_out), now=10.0 * t)
        assert nxt.id == f"s0t{t}" and nxt.arrival_s == 10.0 * t + 0.5
        assert 5 <= nxt.prompt_len - turn.prompt_len - n_out <= 30
        prev, cur = materialize(turn, 1000), materialize(nxt, 1000)
        assert cur[:len(prev)] == prev  # exact token-level prefix, partial last id included
        hp = block_hashes(turn, 1)
        assert block_hashes(nxt, 1)[:len(hp)] == hp
        turn = nxt
    assert wl.on_finish(_finished(turn), now=40.0) is None  # 3 turns done


def test_multi_turn_session_ends_on_rejection_or_length():
    wl = MultiTurnWorkload(ARR, user_len=10, output_len=5, num_turns=5, num_sessions=2, max_prompt_len=40)
    a, b = list(wl.initial())
    assert wl.on_finish(_finished(a, 0, Status.REJECTED), 1.0) is None
    b2 = wl.on_finish(_finished(b), 1.0)
    assert b2.prompt_len == 25
    b3 = wl.on_finish(_finished(b2), 2.0)
    assert b3.prompt_len == 40
    assert wl.on_finish(_finished(b3), 3.0) is None  # 55 > max_prompt_len


# ---- configs


def _load(name, **over):
    root = {"seed": 7, "model": {"max_model_len": 2048}}  # what workload configs interpolate (profile_*: the context)
    cfg = OmegaConf.merge(OmegaConf.create(root), OmegaConf.create({"workload": OmegaConf.load(CONF / name)}),
                          OmegaConf.create({"workload": over}))
    return cfg.workload


@pytest.mark.parametrize("name", sorted(p.name for p in CONF.glob("*.yaml") if p.name != "requests.yaml"))
def test_every_config_builds_and_yields(name):
    wl = build_workload(_load(name))
    assert isinstance(wl, Workload) and wl.seed == 7
    reqs = list(wl.initial())
    assert reqs and all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:], strict=False))


def test_requests_config_needs_a_path(tmp_path):
    with pytest.raises(ValueError, match="path"):
        build_workload(_load("requests.yaml"))
    f = tmp_path / "r.jsonl"
    f.write_text('{"id": "a", "arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 2}\n')
    assert [r.id for r in build_workload(_load("requests.yaml", path=str(f))).initial()] == ["a"]


@pytest.mark.parametrize("cfg, words", [
    ({"_target_": "core.workload.NoSuch"}, ["workload._target_", "NoSuch"]),
    ({"_target_": "nosuchpkg.Thing"}, ["workload._target_", "nosuchpkg"]),
    ({}, ["_target_"]),
    ({"_target_": "SyntheticWorkload", "arrival": ARR, "prompt_len": 8, "output_len": 8}, ["workload._target_"]),
    ({"_target_": SYNTH, "arrival": ARR, "prompt_len": 8, "output_len": 8, "num_requests": 2, "rate": 3},
     ["workload.rate", "unknown key", "allowed", "num_requests"]),
    ({"_target_": SYNTH, "arrival": ARR, "prompt_len": 8}, ["workload", "missing", "output_len"]),
    ({"_target_": SYNTH, "arrival": ARR, "prompt_len": 8, "output_len": 8}, ["num_requests", "duration_s"]),
    ({"_target_": SYNTH, "arrival": ARR, "prompt_len": 8, "output_len": 8, "num_requests": 0},
     ["workload.num_requests", "allowed"]),
    ({"_target_": "builtins.dict"}, ["does not implement Workload"]),
])
def test_build_workload_errors(cfg, words):
    """Bad workload configs fail through Hydra's instantiate with a message naming the key."""
    with pytest.raises(ValueError) as e:
        build_workload(cfg)
    assert all(w in str(e.value) for w in words)


def test_trace_arrivals_need_no_count():
    arr = {"kind": "trace", "path": "../shared/data/traces/AzureLLMInferenceTrace_conv.csv", "limit": 7}
    reqs = list(SyntheticWorkload(arr, 16, 4).initial())
    assert len(reqs) == 7 and reqs[0].arrival_s == 0.0
