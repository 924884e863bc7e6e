"""Capacity search: bracket expansion + bisection against a step function, and the known capacity of a hand-built
queue (one request per step, fixed step time) run through the simulator."""

import json
import math

import pytest
from hydra import compose, initialize_config_dir

from experiments.build import CONF_DIR
from experiments.studies.capacity import capacity, describe, find_capacity


def threshold(cap: float, calls: list | None = None):
    def measure(rate):
        if calls is not None:
            calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= cap else 0.5, "goodput_rps": min(rate, cap)}
    return measure


@pytest.mark.parametrize("cap,low,high", [(7.3, 1.0, 2.0), (0.3, 1.0, 2.0), (50.0, 40.0, 41.0), (1.5, 1.0, 2.0)])
def test_finds_a_threshold_from_any_bracket(cap, low, high):
    calls = []
    r = find_capacity(threshold(cap, calls), 0.9, low, high, max_expansions=10, iterations=20, rel_tol=0.01)
    assert r.bracketed and r.capacity_rps <= cap and (cap - r.capacity_rps) <= 0.01 * r.capacity_rps + 1e-12
    assert len(calls) == len(set(calls)) == len(r.probes)  # no rate probed twice
    assert [p.rate for p in r.probes] == calls and all(p.met == (p.rate <= cap) for p in r.probes)


def test_bounded_search_reports_what_it_saw():
    r = find_capacity(threshold(1e9), 0.9, 1.0, 2.0, max_expansions=3, iterations=5)
    assert not r.bracketed and r.capacity_rps == 16.0 and len(r.probes) == 5  # 1, 2, then 4, 8, 16
    assert "lower bound" in describe(r)
    none = find_capacity(threshold(1e-9), 0.9, 1.0, 2.0, max_expansions=2, iterations=5)
    assert none.capacity_rps is None and not none.bracketed and "no probed rate" in describe(none)
    limited = find_capacity(threshold(7.3), 0.9, 1.0, 2.0, max_expansions=10, iterations=2, rel_tol=1e-6)
    assert len([p for p in limited.probes if p.phase == "bisect"]) == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"target": 0.0}, "target"), ({"low": 2.0, "high": 1.0}, "low"), ({"low": -1.0}, "low"),
    ({"rel_tol": 0}, "rel_tol"), ({"iterations": -1}, "iterations"), ({"max_expansions": 1.5}, "max_expansions"),
])
def test_bad_settings_fail_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        find_capacity(threshold(1.0), **kwargs)


def test_known_capacity_of_a_hand_built_queue(tmp_path):
    """N requests at a fixed rate r, each one prefill step of T seconds (one sequence per step, one output token):
    above r = 1/T request i waits, TTFT_i = T + i (T - 1/r). With SLO TTFT <= S, K = ceil(target N) - 1 requests
    after the first must meet it, so the capacity is the largest r with T - 1/r <= (S - T) / K:
    r* = 1 / (T - (S - T) / K)."""
    n, step, slo, target = 20, 0.1, 0.27, 0.9
    k = math.ceil(target * n) - 1
    expected = 1.0 / (step - (slo - step) / k)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("capacity", overrides=[
            "backend=sim", "cost_model=linear", f"cost_model.c0_s={step}", "cost_model.per_prefill_token_s=0",
            "cost_model.per_decode_seq_s=0", "cost_model.per_attention_pair_s=0", "cost_model.per_kv_token_read_s=0",
            f"workload.num_requests={n}", "workload.arrival.kind=fixed", "workload.prompt_len=64",
            "workload.output_len=1", "scheduler.max_num_seqs=1", "scheduler.max_num_batched_tokens=64",
            f"slo.ttft_s={slo}", "slo.max_stall_s=null", "capacity.duration_s=null", f"capacity.target={target}",
            "capacity.rel_tol=0.005", "capacity.iterations=20"])
    result = capacity(cfg, tmp_path)
    assert result.bracketed
    assert expected * (1 - 0.005) <= result.capacity_rps <= expected * (1 + 1e-9)
    trace = json.loads((tmp_path / "capacity.json").read_text())
    assert trace["capacity_rps"] == result.capacity_rps and len(trace["probes"]) == len(result.probes)
    rows = (tmp_path / "capacity.csv").read_text().splitlines()
    assert rows[0].startswith("probe,phase,rate,slo_attainment,goodput_rps") and len(rows) == len(result.probes) + 1
    for p in result.probes:  # each probe's attainment is the formula's
        met = n if p.rate <= 1 / step else min(n, math.floor((slo - step) / (step - 1 / p.rate) + 1e-9) + 1)
        assert p.attainment == pytest.approx(met / n)
