"""vLLM's async scheduling (``scheduler.async_scheduling`` of vllm_v1, applied by core.replica): the step is decided
while the previous one runs, so a request queued during a step, or a seat freed by a request finishing in it,
reaches the batch after next; an idle replica schedules at once. Hand-timed runs with 10 ms steps."""

from __future__ import annotations

import pytest

from core.metrics import request_metrics
from core.request import Request
from policies.schedulers.vllm_v1 import VLLMv1Scheduler
from tests.helpers import run_requests

STEP = 0.01


def run(requests, on: bool, **limits):
    result, _ = run_requests(requests, lambda: VLLMv1Scheduler(async_scheduling=on), step_time=lambda f: STEP,
                             **limits)
    return {s.id: s for s in result.states}


def run_stamped(requests, on: bool, stamp: bool = True):
    result, _ = run_requests(requests, lambda: VLLMv1Scheduler(async_scheduling=on), step_time=lambda f: STEP,
                             stamp_receipt=stamp)
    return {s.id: s for s in result.states}


def test_a_request_queued_during_a_step_joins_the_batch_after_next():
    reqs = [Request(id="a", arrival_s=0.0, prompt_len=8, max_new_tokens=6),
            Request(id="b", arrival_s=0.015, prompt_len=8, max_new_tokens=2)]
    sync, lag = run(reqs, False), run(reqs, True)
    # a's steps: [0, .01], [.01, .02], ...; b arrives in the second
    assert sync["b"].first_scheduled_s == pytest.approx(0.02) and sync["b"].first_token_s == pytest.approx(0.03)
    assert lag["b"].first_scheduled_s == pytest.approx(0.03) and lag["b"].first_token_s == pytest.approx(0.04)
    assert lag["a"].token_times == sync["a"].token_times  # the running request decodes every step either way


@pytest.mark.parametrize("on", [False, True])
def test_the_receipt_is_the_end_of_the_step_in_flight(on):
    """metrics.latency_from=receipt: the loop takes a request in at its first scheduling pass (vLLM's queued_ts),
    the end of the step running when it arrived, or its arrival at an idle replica; TTFT and E2E count from there.
    b arrives in a's long decode (a fast-forward in the simulator), c at an idle replica."""
    reqs = [Request(id="a", arrival_s=0.0, prompt_len=8, max_new_tokens=40),
            Request(id="b", arrival_s=0.2351, prompt_len=8, max_new_tokens=3),
            Request(id="c", arrival_s=5.0, prompt_len=8, max_new_tokens=2)]
    stamped, plain = run_stamped(reqs, on), run_stamped(reqs, on, stamp=False)
    assert stamped["a"].received_s == 0.0 and stamped["c"].received_s == 5.0
    assert stamped["b"].received_s == pytest.approx(0.24)
    b = stamped["b"]
    assert request_metrics(b).ttft_s == pytest.approx(b.first_token_s - 0.24)
    assert request_metrics(b).e2e_s == pytest.approx(b.finish_s - 0.24)
    assert b.first_token_s == pytest.approx(0.26 if on else 0.25)  # async: behind the step the receipt found
    assert all(s.received_s is None for s in plain.values())  # off by default: latencies from the arrival
    assert request_metrics(plain["b"]).ttft_s == pytest.approx(b.first_token_s - 0.2351)
    assert [s.token_times for s in plain.values()] == [s.token_times for s in stamped.values()]  # timing unchanged


def test_an_idle_replica_schedules_at_once():
    reqs = [Request(id="a", arrival_s=0.0, prompt_len=8, max_new_tokens=2),
            Request(id="b", arrival_s=0.1, prompt_len=8, max_new_tokens=2)]
    lag = run(reqs, True)
    assert lag["a"].first_scheduled_s == 0.0 and lag["b"].first_scheduled_s == pytest.approx(0.1)


def test_a_freed_seat_is_reused_one_step_later():
    """Two seats: c finishes at the end of step 2 (prefill token + 1 decode); b waits for its seat."""
    reqs = [Request(id="a", arrival_s=0.0, prompt_len=8, max_new_tokens=10),
            Request(id="c", arrival_s=0.0, prompt_len=8, max_new_tokens=2),
            Request(id="b", arrival_s=0.0, prompt_len=8, max_new_tokens=2)]
    sync, lag = run(reqs, False, max_num_seqs=2), run(reqs, True, max_num_seqs=2)
    assert sync["c"].finish_s == lag["c"].finish_s == pytest.approx(0.02)
    assert sync["b"].first_scheduled_s == pytest.approx(0.02)
    assert lag["b"].first_scheduled_s == pytest.approx(0.03)


def test_the_last_seat_holder_finishing_leaves_nothing_in_flight():
    """One seat: when its holder finishes, the step-ahead batch was empty, so the next request starts at once."""
    reqs = [Request(id="a", arrival_s=0.0, prompt_len=8, max_new_tokens=3),
            Request(id="b", arrival_s=0.0, prompt_len=8, max_new_tokens=2)]
    sync, lag = run(reqs, False, max_num_seqs=1), run(reqs, True, max_num_seqs=1)
    assert lag["b"].first_scheduled_s == sync["b"].first_scheduled_s == pytest.approx(0.03)
