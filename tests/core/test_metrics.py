"""Metric definitions against hand-computed values and independent references."""

import json
import math
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.metrics import (
    SLO,
    ITLPool,
    SampleSet,
    bucket_labels,
    itl_samples,
    output_events,
    percentile,
    prefix_cost_coeffs,
    prefix_work,
    request_metrics,
    stats,
    summarize,
)
from core.request import Request, RequestState, Status
from core.specs import ModelSpec


def mk(rid="r", arrival=0.0, sched=None, times=(), status=Status.FINISHED, prompt=40, cached=0, warmup=False,
       finish=None, deadline=None) -> RequestState:
    req = Request(rid, arrival, prompt, max(1, len(times)), warmup=warmup, ttft_deadline_s=deadline)
    s = RequestState(req, status=status, output_token_ids=[1] * len(times), num_cached_tokens=cached,
                     first_scheduled_s=sched, token_times=list(times))
    s.first_token_s = times[0] if times else None
    s.finish_s = finish if finish is not None else (times[-1] if times else None)
    return s


def test_request_metrics_by_hand():
    m = request_metrics(mk(arrival=1.0, sched=1.5, times=(2.0, 2.25, 2.75, 3.0)))
    assert m.ttft_s == 1.0 and m.e2e_s == 2.0 and m.queue_s == 0.5 and m.prefill_span_s == 0.5
    assert m.tpot_s == pytest.approx(1 / 3)
    assert itl_samples(output_events((2.0, 2.25, 2.75, 3.0))) == [0.25, 0.5, 0.25] and m.max_stall_s == 0.5


def test_multi_token_events_split_their_gap():
    times = (1.0, 2.0, 2.0, 2.0, 3.0)
    assert output_events(times) == [(1.0, 1), (2.0, 3), (3.0, 1)]
    m = request_metrics(mk(sched=0.5, times=times))
    assert itl_samples(output_events(times)) == pytest.approx((1 / 3, 1 / 3, 1 / 3, 1.0)) and m.max_stall_s == 1.0
    assert m.tpot_s == pytest.approx((3.0 - 1.0) / 4)


def test_single_token_and_unfinished_requests():
    one = request_metrics(mk(arrival=0.0, sched=0.1, times=(0.5,)))
    assert one.tpot_s is None and one.max_stall_s == 0.0 and  one.e2e_s == 0.5
    rej = request_metrics(mk(status=Status.REJECTED, finish=0.0))
    assert (rej.ttft_s, rej.e2e_s, rej.max_stall_s, rej.queue_s) == (None, None, None, None)
    late = request_metrics(mk(sched=1.0, times=(2.0, 3.0), status=Status.TIMED_OUT, finish=5.0))
    assert late.ttft_s == 2.0 and late.e2e_s is None and late.tpot_s is None


def test_percentile_methods_on_a_known_list():
    x = [15, 20, 35, 40, 50]
    assert [percentile(x, p) for p in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]  # nearest rank
    assert percentile(x, 40, "linear") == pytest.approx(29.0)  # 20 + 0.6 * (35 - 20)
    assert percentile(x, 0) == 15 and percentile([], 50) is None
    assert percentile(list(range(1, 101)), 7) == 7  # 7 * 100 / 100 must not round up to rank 8
    with pytest.raises(ValueError, match="percentile_method"):
        percentile(x, 50, "midpoint")


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60), st.floats(0, 100))
def test_nearest_rank_matches_numpy_inverted_cdf(xs, p):
    p = round(p, 3)
    assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p, method="inverted_cdf")))
    assert percentile(xs, p, "linear") == pytest.approx(float(np.percentile(xs, p)))


def test_stats_empty_is_json_safe():
    s = stats([])
    assert s == {"count": 0, "mean": None, "min": None, "max": None, "p50": None, "p90": None, "p99": None}
    out = summarize([])
    assert out["num_requests"] == 0 and out["ttft_s"]["count"] == 0 and out["goodput_rps"] is None
    json.dumps(out, allow_nan=False)


def _run():
    return [
        mk("a", 0.0, 0.0, (0.5, 0.6, 0.7), cached=32),                       # meets
        mk("b", 1.0, 1.0, (1.2, 1.3, 2.3), cached=0),                        # stall 1.0 > 0.5
        mk("c", 2.0, 2.5, (4.0, 4.1)),                                       # TTFT 2.0 > 1.0
        mk("d", 3.0, 3.0, (3.1,)),                                           # meets (single token)
        mk("e", 4.0, status=Status.REJECTED, finish=4.0),
        mk("f", 5.0, 5.0, (5.5,), status=Status.TIMED_OUT, finish=6.0),
        mk("w", 0.0, 0.0, (90.0, 99.0), warmup=True),                        # excluded everywhere
    ]


def test_summary_counts_goodput_and_slo_attainment():
    out = summarize(_run(), slo={"ttft_s": 1.0, "max_stall_s": 0.5})
    assert (out["num_requests"], out["num_completed"], out["num_rejected"], out["num_timed_out"],
            out["num_warmup"]) == (6, 4, 1, 1, 1)
    assert out["counts_by_status"] == {"WAITING": 0, "RUNNING": 0, "PREEMPTED": 0, "FINISHED": 4, "REJECTED": 1,
                                       "TIMED_OUT": 1, "CANCELLED": 0}
    assert out["duration_s"] == 6.0  # first arrival 0 -> timeout of f at 6
    assert out["num_slo_met"] == 2 and out["slo_attainment"] == pytest.approx(2 / 6)
    assert out["goodput_rps"] == pytest.approx(2 / 6) and out["throughput_rps"] == pytest.approx(4 / 6)
    assert out["throughput_tok_s"] == pytest.approx((3 + 3 + 2 + 1) / 6)
    assert out["ttft_s"]["count"] == 4 and out["ttft_s"]["max"] == 2.0 and out["ttft_s"]["p50"] == pytest.approx(0.2)
    assert out["tpot_s"]["count"] == 3  # d has one token
    assert out["itl_s"]["count"] == 2 + 2 + 1 and out["itl_s"]["max"] == pytest.approx(1.0)
    assert out["max_stall_s"]["count"] == 4 and out["queue_s"]["max"] == 0.5
    assert out["stall_threshold_s"] == 0.5 and out["stall_share_over_threshold"] == pytest.approx(1 / 4)
    assert out["percentile_method"] == "nearest_rank"
    no_warmup = summarize(_run()[:-1], slo={"ttft_s": 1.0, "max_stall_s": 0.5})
    assert no_warmup == {**out, "num_warmup": 0}  # warmup changes nothing else


def test_cancelled_requests_stay_in_every_denominator():
    """A cancelled request (even one that streamed tokens) is counted, never completed, and dilutes every rate."""
    run = [*_run()[:-1], mk("g", 6.0, 6.0, (6.1, 6.2), status=Status.CANCELLED, finish=7.0)]
    out = summarize(run, slo={"ttft_s": 1.0, "max_stall_s": 0.5})
    base = summarize(_run()[:-1], slo={"ttft_s": 1.0, "max_stall_s": 0.5})
    assert out["num_requests"] == 7 and out["num_cancelled"] == 1 and base["num_cancelled"] == 0
    assert out["counts_by_status"]["CANCELLED"] == 1 and sum(out["counts_by_status"].values()) == 7
    assert out["num_completed"] == 4 and out["duration_s"] == 7.0  # first arrival 0 -> cancellation at 7
    assert out["slo_attainment"] == pytest.approx(2 / 7) and out["goodput_rps"] == pytest.approx(2 / 7)
    assert out["throughput_rps"] == pytest.approx(4 / 7) and out["ttft_s"] == base["ttft_s"]
    assert out["request_hit_rate"] == pytest.approx(1 / 7)
    assert request_metrics(run[-1]).e2e_s is None


def test_per_request_deadline_and_tpot_slo():
    s = [mk("a", 0.0, 0.0, (0.5, 0.6)), mk("b", 0.0, 0.0, (0.5, 0.6), deadline=0.4)]
    assert summarize(s, slo=SLO(ttft_s=1.0))["num_slo_met"] == 1
    assert summarize(s, slo=SLO(tpot_s=0.05))["num_slo_met"] == 0
    with pytest.raises(ValueError, match="slo.ttft_s"):
        SLO(ttft_s=-1)
    with pytest.raises(ValueError, match="unknown keys"):
        SLO.from_mapping({"ttft": 1})


def test_prefix_metrics_by_hand():
    # two 40-token requests sharing 32 tokens: the second gets 32 cached
    s = [mk("a", 0.0, 0.0, (1.0,), prompt=40, cached=0), mk("b", 0.5, 0.5, (1.5,), prompt=40, cached=32)]
    out = summarize(s, prefix_cost=(1.0, 1.0))
    c = lambda n: n + n * (n + 1) / 2
    assert out["request_hit_rate"] == 0.5 and out["token_reuse_rate"] == pytest.approx(32 / 80)
    assert out["prefill_work_saved"] == pytest.approx(c(32) / (2 * c(40)))  # 560 / 1720
    assert (out["prefix_cost_a"], out["prefix_cost_b"]) == (1.0, 1.0)
    assert summarize(s)["prefill_work_saved"] == pytest.approx(0.4)  # a=1, b=0: token count
    g = out["groups"]["prefix"]
    assert g["hit"]["num_requests"] == 1 and g["hit"]["ttft_s"]["max"] == 1.0
    assert g["miss"]["ttft_s"]["max"] == 1.0 and g["miss"]["num_completed"] == 1


def test_rejected_requests_count_in_prefix_denominators():
    s = [mk("a", 0.0, 0.0, (1.0,), prompt=40, cached=32), mk("b", 0.0, status=Status.REJECTED, finish=0.0, prompt=60)]
    out = summarize(s)
    assert out["request_hit_rate"] == 0.5 and out["token_reuse_rate"] == pytest.approx(32 / 100)


def test_prefix_work_and_model_coeffs():
    assert prefix_work(4, 2.0, 3.0) == 2 * 4 + 3 * 10
    assert list(prefix_work(np.array([0, 1, 2]), 1.0, 1.0)) == [0, 2, 5]
    spec = ModelSpec("m", num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                     vocab_size=10)
    a, b = prefix_cost_coeffs(spec)
    assert a == 2 * 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16) and b == 4 * 2 * 8


def test_prompt_len_buckets():
    assert bucket_labels([256, 1024]) == ["[0,256)", "[256,1024)", "[1024,inf)"]
    s = [mk("a", 0, 0, (1.0,), prompt=255), mk("b", 0, 0, (2.0,), prompt=256), mk("c", 0, 0, (3.0,), prompt=5000)]
    g = summarize(s, prompt_len_edges=[256, 1024])["groups"]["prompt_len"]
    assert [g[k]["ttft_s"]["max"] for k in g] == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="prompt_len_edges"):
        summarize(s, prompt_len_edges=[10, 5])


PMETHODS = ["nearest_rank", "linear"]
req_st = st.tuples(st.floats(0.0, 5.0), st.integers(1, 3000), st.booleans(), st.sampled_from(list(Status)[3:]))


@given(st.lists(req_st, min_size=0, max_size=30), st.sampled_from(["nearest_rank", "linear"]))
def test_group_stats_come_from_the_group_samples(rows, method):
    states = [mk(f"r{i}", 0.0, 0.0, (ttft, ttft + 0.1), status=status, prompt=n, cached=16 if hit else 0,
                 finish=ttft + 0.1) for i, (ttft, n, hit, status) in enumerate(rows)]
    out = summarize(states, percentile_method=method, prompt_len_edges=[100, 1000])
    done = [(s, s.first_token_s) for s in states if s.status is Status.FINISHED]
    groups = {"hit": lambda s: s.num_cached_tokens > 0, "miss": lambda s: s.num_cached_tokens == 0}
    np_method = "inverted_cdf" if method == "nearest_rank" else "linear"
    for name, member in groups.items():
        x = [t for s, t in done if member(s)]
        got = out["groups"]["prefix"][name]["ttft_s"]
        assert got["count"] == len(x)
        for p in (50, 90, 99):
            want = float(np.percentile(x, p, method=np_method)) if x else None
            assert got[f"p{p}"] == (pytest.approx(want) if x else None)
    lens = [(s.request.prompt_len, t) for s, t in done]
    for label, (lo, hi) in zip(out["groups"]["prompt_len"], [(0, 100), (100, 1000), (1000, math.inf)], strict=True):
        x = [t for n, t in lens if lo <= n < hi]
        assert out["groups"]["prompt_len"][label]["ttft_s"]["mean"] == (pytest.approx(np.mean(x)) if x else None)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300), st.floats(0, 100))
def test_nearest_rank_is_numpys_inverted_cdf_away_from_rounding_ties(values, p):
    """numpy's inverted_cdf is the nearest-rank definition; only where p * n / 100 is an integer up to rounding
    does numpy's floating-point q * n pick the next rank (p=99.9, n=1000), which ours does not."""
    n = len(values)
    if abs(p * n / 100 - round(p * n / 100)) < 1e-6:
        return
    assert percentile(values, p) == float(np.percentile(values, p, method="inverted_cdf"))


def test_nearest_rank_at_a_rounding_tie_keeps_the_definition():
    x = np.arange(1000, dtype=float)
    assert percentile(x, 99.9) == 998.0  # 999 of 1000 values (99.9%) are <= 998
    assert float(np.percentile(x, 99.9, method="inverted_cdf")) == 999.0  # numpy's rounding picks the next one


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300), st.floats(0, 100))
def test_linear_is_numpys_linear(values, p):
    assert percentile(values, p, "linear") == float(np.percentile(values, p, method="linear"))


@given(st.lists(st.integers(0, 40), min_size=0, max_size=400), st.integers(1, 50), st.sampled_from(PMETHODS))
def test_sample_set_is_the_samples(draws, batch, method):
    """A SampleSet (distinct values and counts, merged batch by batch) gives the stats of the plain sample list."""
    values = [d * 0.013 + 0.001 for d in draws]  # few distinct values, many repeats
    ss = SampleSet()
    with patch("core.metrics._MERGE_SAMPLES", 7):  # merge often: the union path
        for lo in range(0, len(values), batch):
            ss.add(np.array(values[lo:lo + batch]))
    got, want = ss.stats(method, (0, 1, 50, 90, 99, 99.9, 100)), stats(values, method, (0, 1, 50, 90, 99, 99.9, 100))
    assert got.pop("mean") == (pytest.approx(want.pop("mean"), rel=1e-12) if values else want.pop("mean"))
    assert got == want and len(ss) == len(values)


def _timed_states(seed: int, n: int = 40) -> list[RequestState]:
    """Requests with multi-token events, several prompt buckets, hits and misses, warmup and every end status."""
    rng = np.random.default_rng(seed)
    states = []
    for i in range(n):
        steps = rng.integers(0, 3, int(rng.integers(0, 30))) * 0.01  # 0: several tokens in one event
        times = (float(rng.random()) + np.cumsum(steps)).tolist()
        status = [Status.FINISHED, Status.FINISHED, Status.TIMED_OUT, Status.CANCELLED][i % 4]
        states.append(mk(f"r{i}", 0.0, 0.0, tuple(times), status=status if times else Status.REJECTED,
                         prompt=int(rng.integers(1, 3000)), cached=16 * (i % 3 == 0), warmup=i % 7 == 0))
    return states


@pytest.mark.parametrize("seed", range(4))
def test_folded_requests_give_the_same_metrics(seed):
    """Folding each request's token times into an ITL pool as it ends (output.tokens=none) changes no metric,
    leaves no token times behind, and keeps each request's max stall and last token."""
    from core.output import dumps_metrics

    want = summarize(_timed_states(seed), prompt_len_edges=[100, 1000])
    states = _timed_states(seed)
    stalls = [request_metrics(s).max_stall_s for s in states]
    last = [s.token_times[-1] if s.token_times else None for s in states]
    pool = ITLPool([100, 1000])
    order = np.random.default_rng(seed).permutation(len(states))
    with patch("core.metrics._CHUNK_TOKENS", 50):  # several fold batches
        for i in order[: len(order) // 2]:
            pool.fold(states[i])
        pool.flush()
        for i in order[len(order) // 2:]:
            pool.fold(states[i])  # the last ones still pending: summarize flushes them
    got = summarize(states, prompt_len_edges=[100, 1000], itl_pool=pool)
    assert dumps_metrics(got) == dumps_metrics(want)
    assert all(not s.token_times and s.folded is not None for s in states)
    assert [request_metrics(s).max_stall_s for s in states] == stalls and [s.last_token_s for s in states] == last


def test_folded_requests_need_their_pool():
    states = _timed_states(0, 8)
    pool = ITLPool([100, 1000])
    for s in states:
        pool.fold(s)
    pool.flush()
    with pytest.raises(ValueError, match="folded into an ITL pool"):
        summarize(states)
    with pytest.raises(ValueError, match="groups prompts by"):
        summarize(states, itl_pool=pool)  # the default edges differ from the pool's
