"""The calibration profile workload: waves of equal requests, phases by decreasing concurrency, lengths up to the
model's context. Checked on a simulated run: what the server saw (arrival, lengths, concurrency) against the plan."""

from collections import Counter

import numpy as np
import pytest

from core.request import RequestState, Status
from core.workload.profile import ProfileWorkload, auto_lengths


def drive(wl: ProfileWorkload, service_s: float = 1.0):
    """Each request finishes `service_s` after it arrives (a server with room for all): (request, finish) pairs."""
    pending = [(r.arrival_s + service_s, r) for r in wl.initial()]
    done = []
    while pending:
        pending.sort(key=lambda x: x[0])
        t, req = pending.pop(0)
        st = RequestState(req)
        st.status = Status.FINISHED
        done.append((req, t))
        nxt = wl.on_finish(st, t)
        if nxt is not None:
            pending.append((nxt.arrival_s + service_s, nxt))
    return done


def test_waves_follow_the_plan_by_decreasing_concurrency():
    wl = ProfileWorkload(output_len=8, concurrency=[1, 4, 2], prompt_lens=[10, 100, 1000], repeats=2, gap_s=0.5,
                         seed=3)
    assert wl.concurrency == [4, 2, 1]
    assert [n for n, _ in wl.waves] == [4] * 6 + [2] * 6 + [1] * 6
    for k in range(0, 18, 3):  # each round visits every length once
        assert sorted(L for _, L in wl.waves[k:k + 3]) == [10, 100, 1000]
    done = drive(wl)
    assert len(done) == wl.num_requests == 4 * 6 + 2 * 6 + 6
    by_arrival = Counter()
    for req, _ in done:
        by_arrival[req.arrival_s] += 1
        assert req.max_new_tokens == 8
    # every wave arrives at one instant (all its clients' previous requests ended together), as many as its N
    waves = sorted(by_arrival.items())
    assert [n for _, n in waves] == [n for n, _ in wl.waves]
    lengths = {}
    for req, _ in done:
        lengths.setdefault(req.arrival_s, set()).add(req.prompt_len)
    assert [next(iter(v)) for _, v in sorted(lengths.items())] == [L for _, L in wl.waves]
    assert all(len(v) == 1 for v in lengths.values())
    # consecutive waves are gap_s + service apart
    starts = [t for t, _ in waves]
    assert np.allclose(np.diff(starts), 1.5)


def test_auto_lengths_span_the_context_and_kv_limit_skips_waves():
    wl = ProfileWorkload(output_len=32, concurrency=[16, 1], prompt_lens="auto", max_model_len=2048,
                         min_prompt_len=16, num_prompt_lens=6, max_kv_tokens=16 * 600)
    assert wl.prompt_lens[0] == 16 and wl.prompt_lens[-1] == 2048 - 32 and len(wl.prompt_lens) == 6
    assert wl.prompt_lens == auto_lengths(16, 2016, 6)
    assert all(16 * (L + 32) > 16 * 600 for n, L in wl.skipped if n == 16)
    assert {L for n, L in wl.waves if n == 16} == {L for L in wl.prompt_lens if 16 * (L + 32) <= 16 * 600}
    assert {L for n, L in wl.waves if n == 1} == set(wl.prompt_lens)


def test_warmup_waves_and_ids():
    wl = ProfileWorkload(output_len=2, concurrency=[2], prompt_lens=[5, 6], warmup_waves=1, id_prefix="x")
    reqs = [r for r, _ in drive(wl)]
    assert sorted(r.id for r in reqs) == ["x0", "x1", "x2", "x3"]
    assert sum(r.warmup for r in reqs) == 2 and all(r.warmup for r in reqs if r.arrival_s == 0)


@pytest.mark.parametrize("kwargs,message", [
    ({"output_len": 0}, "output_len"),
    ({"output_len": 4, "concurrency": []}, "concurrency"),
    ({"output_len": 4, "prompt_lens": "auto"}, "max_model_len"),
    ({"output_len": 4, "prompt_lens": [2000], "max_model_len": 2000}, "exceed max_model_len"),
    ({"output_len": 4, "prompt_lens": [100], "max_kv_tokens": 10}, "max_kv_tokens"),
    ({"output_len": 4, "prompt_lens": [10], "id_prefix": ""}, "id_prefix"),
])
def test_bad_profile_options_fail_naming_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileWorkload(**kwargs)
