"""The serving loop on its two clocks: simulated (SimPy) and real time (the server's)."""

import threading
import time

import pytest

from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.realtime import RealTimeClock, run_in_real_time
from core.replica import Replica, SchedulerLimits
from core.request import Request, Status
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from tests.helpers import FormulaExecutor, ListWorkload

STEP_S = 0.02


def make_loop(requests, replicas=2):
    reps = [Replica(i, SarathiScheduler(), KVCacheManager(64, 16, LRUEviction()), SchedulerLimits(64, 8))
            for i in range(replicas)]
    return ServingLoop(reps, [FormulaExecutor(lambda f: STEP_S) for _ in reps], RoundRobinRouter(),
                       ListWorkload(requests), keep_batches=True)


def burst():
    return [Request(f"r{i}", 0.0, 20 + 10 * i, 3 + i) for i in range(5)]


def test_real_time_clock_runs_the_same_steps_as_the_simulated_one():
    sim = run_virtual(make_loop(burst()))
    t0 = time.perf_counter()
    real = run_in_real_time(make_loop(burst()))
    wall = time.perf_counter() - t0
    # the same batches in the same order on each replica (everything arrived at once)
    for i in range(2):
        assert ([s.features for s in sim.steps if s.replica == i]
                == [s.features for s in real.steps if s.replica == i])
    # a predicted step is waited out on the wall clock: a replica's steps never overlap and take STEP_S each
    by_id = {s.id: s for s in sim.states}
    for state in real.states:
        assert state.status is Status.FINISHED
        assert state.finish_s >= by_id[state.id].finish_s - 1e-9  # never earlier than the simulated timeline
        assert state.finish_s == pytest.approx(by_id[state.id].finish_s, abs=0.25)
    for i in range(2):
        starts = [s.start_s for s in real.steps if s.replica == i]
        assert all(b - a >= STEP_S - 1e-6 for a, b in zip(starts, starts[1:], strict=False))
    assert wall >= sim.end_s - 1e-6


def test_requests_submitted_from_another_thread_are_served_and_the_loop_stops():
    loop = make_loop([])
    clock = RealTimeClock()
    done = threading.Event()
    ended = []

    def on_terminal(state, now):
        ended.append(state)
        if len(ended) == 4:
            done.set()

    loop.on_terminal.append(on_terminal)
    thread = threading.Thread(target=clock.run, args=(loop.processes(clock),), daemon=True)
    thread.start()
    futures = [clock.call(lambda r=r: loop.dispatch(r)) for r in
               [Request("a", 0.0, 30, 4), Request("b", 0.0, 10, 2), Request("c", 0.0, 5000, 2),  # c: too long
                Request("d", 0.0, 40, 3)]]
    states = [f.result(timeout=5) for f in futures]
    assert done.wait(timeout=10)
    with pytest.raises(ValueError, match="twice"):
        clock.call(lambda: loop.dispatch(Request("a", 0.0, 30, 4))).result(timeout=5)  # the loop survives it
    clock.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert [s.status for s in states] == [Status.FINISHED, Status.FINISHED, Status.REJECTED, Status.FINISHED]
    assert "max_model_len" in states[2].reason
    assert [len(s.output_token_ids) for s in states] == [4, 2, 0, 3]
    for r in loop.replicas:
        r.kv.check_invariants()
        assert r.kv.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="stopped"):
        clock.call(lambda: None).result(timeout=1)


def test_frontend_delay_adds_to_ttft_and_nothing_else():
    """A request reaches its replica frontend_delay_s after arriving: TTFT grows by exactly that (an idle replica),
    the arrival time and the steps stay the same."""
    def one(delay):
        reps = [Replica(0, SarathiScheduler(), KVCacheManager(64, 16, LRUEviction()), SchedulerLimits(64, 8))]
        loop = ServingLoop(reps, [FormulaExecutor(lambda f: STEP_S)], RoundRobinRouter(),
                           ListWorkload([Request("a", 0.5, 20, 3), Request("b", 3.0, 10, 2)]), frontend_delay_s=delay)
        return {s.id: s for s in run_virtual(loop).states}

    base, late = one(0.0), one(0.25)
    for rid in ("a", "b"):
        assert late[rid].request.arrival_s == base[rid].request.arrival_s
        assert late[rid].first_token_s - base[rid].first_token_s == pytest.approx(0.25)
        assert late[rid].first_scheduled_s == pytest.approx(base[rid].request.arrival_s + 0.25)
