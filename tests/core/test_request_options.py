"""Request-level options in the replica: per-request EOS / ignore_eos, min_tokens, stop token ids, and abort
(CANCELLED) of waiting, preempted and running requests. A scripted executor emits chosen tokens."""

from __future__ import annotations

import pytest

from core.batch import Batch
from core.interfaces import BaseExecutor, StepOutput
from core.kv_cache import KVCacheManager
from core.loop import ServingLoop
from core.replica import Replica, SchedulerLimits
from core.request import Request, RequestState, SamplingParams, Status
from policies.eviction.lru import LRUEviction
from policies.routers.round_robin import RoundRobinRouter
from policies.schedulers.sarathi import SarathiScheduler
from sim.clock import run_virtual
from tests.helpers import ListWorkload

EOS = 2


class ScriptExecutor(BaseExecutor):
    """Request ``rid``'s k-th output token is ``scripts[rid][k]`` (1 past the script's end); 10 ms per step."""

    def __init__(self, scripts: dict[str, list[int]] | None = None) -> None:
        self.scripts = scripts or {}

    def tokens(self, batch: Batch) -> list[int]:
        out = []
        for ch in batch.chunks:
            if ch.samples:
                script, k = self.scripts.get(ch.state.id, []), ch.state.num_output_tokens
                out.append(script[k] if k < len(script) else 1)
        return out

    def execute(self, batch: Batch) -> StepOutput:
        return StepOutput(self.tokens(batch), 0.01)


def _replica(num_blocks: int = 64, ended: list | None = None, **limits) -> Replica:
    limits = {"eos_token_ids": frozenset({EOS}), **limits}
    on_terminal = (lambda s, now: ended.append((s.id, s.status))) if ended is not None else None
    return Replica(0, SarathiScheduler(), KVCacheManager(num_blocks, 4, LRUEviction()), SchedulerLimits(**limits),
                   on_terminal)


def _run(requests: list[Request], scripts: dict[str, list[int]], **limits) -> dict[str, RequestState]:
    rep = _replica(**limits)
    loop = ServingLoop([rep], [ScriptExecutor(scripts)], RoundRobinRouter(), ListWorkload(requests))
    res = run_virtual(loop)
    rep.kv.check_invariants()
    assert rep.kv.num_used_blocks == 0
    return {s.id: s for s in res.states}


def test_eos_ends_a_request_unless_ignored_per_request_or_by_default():
    script = [5, EOS, 7, 7]
    scripts = {rid: script for rid in ("default", "ignore", "stop")}
    reqs = [Request("default", 0.0, 3, 4), Request("ignore", 0.0, 3, 4, ignore_eos=True),
            Request("stop", 0.0, 3, 4, ignore_eos=False)]
    out = _run(reqs, scripts)  # replica default: stop at EOS
    assert out["default"].output_token_ids == [5, EOS] and out["default"].status is Status.FINISHED
    assert out["ignore"].output_token_ids == script
    assert out["stop"].output_token_ids == [5, EOS]
    out = _run(reqs, scripts, ignore_eos=True)  # replica default: ignore EOS
    assert out["default"].output_token_ids == script
    assert out["ignore"].output_token_ids == script
    assert out["stop"].output_token_ids == [5, EOS]
    assert all(s.status is Status.FINISHED for s in out.values())


def test_min_tokens_defers_a_stop_token():
    """A stop token ends the request only once at least min_tokens other tokens precede it; earlier ones are kept
    as ordinary outputs."""
    script = [EOS, EOS, 5, EOS, 7, 7]
    reqs = [Request(f"m{k}", 0.0, 3, 6, min_tokens=k) for k in (0, 1, 2, 3, 6)]
    out = _run(reqs, {r.id: script for r in reqs})
    assert out["m0"].output_token_ids == [EOS]
    assert out["m1"].output_token_ids == [EOS, EOS]
    assert out["m2"].output_token_ids == [EOS, EOS, 5, EOS]
    assert out["m3"].output_token_ids == [EOS, EOS, 5, EOS]
    assert out["m6"].output_token_ids == script  # min_tokens = max_new_tokens: never stops early


def test_stop_token_ids_end_a_request_even_with_ignore_eos():
    script = [5, EOS, 9, 8, 7, 7]
    reqs = [Request("a", 0.0, 3, 6, stop_token_ids=(8, 9)), Request("b", 0.0, 3, 6, stop_token_ids=(8,)),
            Request("c", 0.0, 3, 6, ignore_eos=False, stop_token_ids=(8,)),
            Request("d", 0.0, 3, 6, stop_token_ids=(8,), min_tokens=4)]
    out = _run(reqs, {r.id: script for r in reqs}, ignore_eos=True)
    assert out["a"].output_token_ids == [5, EOS, 9]
    assert out["b"].output_token_ids == [5, EOS, 9, 8]
    assert out["c"].output_token_ids == [5, EOS]
    assert out["d"].output_token_ids == script


def test_stop_set_is_computed_once_at_add():
    rep = _replica()
    plain = rep.add(Request("p", 0.0, 3, 4), 0.0)
    assert plain.stop_token_ids is rep.limits.eos_token_ids  # shared: no per-request set for the common case
    assert rep.add(Request("i", 0.0, 3, 4, ignore_eos=True), 0.0).stop_token_ids == frozenset()
    assert rep.add(Request("s", 0.0, 3, 4, stop_token_ids=(7, 8)), 0.0).stop_token_ids == {EOS, 7, 8}
    assert rep.add(Request("x", 0.0, 3, 4, ignore_eos=True, stop_token_ids=[7]), 0.0).stop_token_ids == {7}


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"min_tokens": 5}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"stop_token_ids": (3, -1)}, "stop_token_ids"), ({"stop_token_ids": ("a",)}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"sampling": {"temperature": 1.0}}, "sampling")])
def test_bad_request_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Request("r", 0.0, 3, 4, **kwargs)


def test_request_options_defaults_and_normalisation():
    r = Request("r", 0.0, 3, 4, stop_token_ids=[5, 6], sampling=SamplingParams(0.7, 0.9, 20, seed=3))
    assert r.stop_token_ids == (5, 6) and hash(r) == hash(Request("r", 0.0, 3, 4, stop_token_ids=(5, 6),
                                                                  sampling=SamplingParams(0.7, 0.9, 20, seed=3)))
    d = Request("d", 0.0, 3, 4)
    assert (d.sampling, d.ignore_eos, d.min_tokens, d.stop_token_ids) == (None, None, 0, ())
    for bad in ({"seed": True}, {"seed": 2**64}, {"seed": 1.0}):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(**bad)
    assert Status.CANCELLED.terminal


# ---- abort -----------------------------------------------------------------------------------------------------
def test_abort_waiting_request_ends_it_at_once():
    ended: list = []
    rep = _replica(ended=ended, max_num_seqs=1)
    a, b = rep.add(Request("a", 0.0, 3, 4), 0.0), rep.add(Request("b", 0.0, 3, 4), 0.0)
    batch = rep.schedule(0.0)  # max_num_seqs=1: a runs, b waits
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    assert rep.abort("b", 0.005, "client disconnected") is b  # while a's step is in flight
    assert b.status is Status.CANCELLED and b.finish_s == 0.005 and b.reason == "client disconnected"
    assert list(rep.waiting) == [] and ended == [("b", Status.CANCELLED)]
    rep.apply(batch, ScriptExecutor().tokens(batch), 0.01)
    assert rep.abort("b", 0.02, "again") is None and rep.abort("nope", 0.02, "?") is None
    rep.kv.check_invariants()


def test_abort_running_request_ends_it_at_the_next_schedule():
    """The abort lands between execute and apply: apply still sees the request with its blocks, the next
    schedule() ends it (CANCELLED, blocks freed, on_terminal once), and it is never scheduled again."""
    ended: list = []
    rep = _replica(ended=ended)
    a, b = rep.add(Request("a", 0.0, 6, 8), 0.0), rep.add(Request("b", 0.0, 6, 8), 0.0)
    batch = rep.schedule(0.0)
    tokens = ScriptExecutor().tokens(batch)  # the step is "in flight"
    assert rep.abort("a", 0.004, "client disconnected") is a
    assert rep.abort("a", 0.005, "twice") is a  # the first abort's reason wins
    assert a.status is Status.RUNNING and rep.kv.num_blocks_held("a") > 0 and not ended
    rep.apply(batch, tokens, 0.01)
    assert a.num_output_tokens == 1 and a.status is Status.RUNNING
    batch = rep.schedule(0.01)
    assert a.status is Status.CANCELLED and a.finish_s == 0.01 and a.reason == "client disconnected"
    assert ended == [("a", Status.CANCELLED)] and rep.kv.num_blocks_held("a") == 0
    assert [ch.state.id for ch in batch.chunks] == ["b"] and rep.running == [b]
    assert rep.abort("a", 0.02, "late") is None
    while rep.waiting or rep.running:
        rep.apply(batch, ScriptExecutor().tokens(batch), 0.02)
        batch = rep.schedule(0.02)
    assert b.status is Status.FINISHED and b.num_output_tokens == 8
    rep.kv.check_invariants()
    assert rep.kv.num_used_blocks == 0 and ended == [("a", Status.CANCELLED), ("b", Status.FINISHED)]


def test_abort_of_a_request_that_the_step_in_flight_finishes():
    ended: list = []
    rep = _replica(ended=ended)
    a = rep.add(Request("a", 0.0, 3, 1), 0.0)
    batch = rep.schedule(0.0)
    assert rep.abort("a", 0.005, "client disconnected") is a
    rep.apply(batch, [7], 0.01)  # its last token: it ends FINISHED, the abort is dropped
    assert a.status is Status.FINISHED and ended == [("a", Status.FINISHED)]
    assert rep.schedule(0.01).empty and ended == [("a", Status.FINISHED)]
    assert rep.kv.num_used_blocks == 0


def test_abort_with_another_terminal_status():
    """A server that saw a stop string ends the request as FINISHED; a non-terminal status is refused."""
    rep = _replica()
    a = rep.add(Request("a", 0.0, 3, 8), 0.0)
    batch = rep.schedule(0.0)
    rep.apply(batch, [5], 0.01)
    assert rep.finish_early("a", 0.01, "stop string") is a
    rep.schedule(0.01)
    assert a.status is Status.FINISHED and a.reason == "stop string" and a.finish_s == 0.01
    with pytest.raises(ValueError, match="terminal"):
        rep.end_early("a", 0.02, Status.WAITING, "x")


def test_aborts_during_a_run_free_every_block_and_counts_add_up():
    """A loop under KV pressure (preemptions); a listener cancels requests of every kind as the server would:
    waiting, preempted and running ones."""
    reqs = [Request(f"r{i}", 0.002 * i, 10 + 3 * i, 12) for i in range(16)]
    rep = _replica(num_blocks=20, max_num_batched_tokens=32, max_num_seqs=6, ignore_eos=True)
    loop = ServingLoop([rep], [ScriptExecutor()], RoundRobinRouter(), ListWorkload(reqs))
    cancelled_as: dict[str, Status] = {}
    ended: list[str] = []
    loop.on_terminal.append(lambda s, now: ended.append(s.id))

    def on_step(i, batch, record):
        now = loop.clock.now
        candidates = [s for s in rep.waiting if s.status is Status.PREEMPTED][:1]
        if len(loop.steps) % 5 == 0:
            candidates += [*list(rep.waiting)[-1:], *rep.running[:1]]
        for s in candidates:
            if s.id not in cancelled_as:
                cancelled_as[s.id] = s.status
                assert rep.abort(s.id, now, "test") is s

    loop.on_step.append(on_step)
    res = run_virtual(loop)
    states = {s.id: s for s in res.states}
    assert set(cancelled_as.values()) == {Status.WAITING, Status.PREEMPTED, Status.RUNNING}
    assert all(s.status.terminal for s in res.states) and sorted(ended) == sorted(states)  # each ends once
    n_cancelled = sum(s.status is Status.CANCELLED for s in res.states)
    n_finished = sum(s.status is Status.FINISHED for s in res.states)
    assert n_cancelled + n_finished == len(reqs) and n_cancelled >= 3
    assert all(states[rid].status in (Status.CANCELLED, Status.FINISHED) for rid in cancelled_as)
    assert all(s.num_output_tokens == 12 for s in res.states if s.status is Status.FINISHED)
    rep.kv.check_invariants()
    assert rep.kv.num_used_blocks == 0 and not (rep.waiting or rep.running)
