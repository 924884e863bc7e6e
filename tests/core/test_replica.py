"""Replica step loop: hand-computed chunked-prefill timelines, rejections, timeouts."""

import pytest

from core.request import Request, Status
from policies.schedulers.sarathi import SarathiScheduler
from tests.helpers import run_requests

C0, PER_TOKEN, PER_DECODE = 0.010, 0.001, 0.002


def step_time(f):
    return C0 + PER_TOKEN * f.num_prefill_tokens + PER_DECODE * f.num_decode_seqs


def chunk_scenario(budget):
    """A and B (2-token prompts) start at t=0 and decode; C (7-token prompt) arrives at t=0.010."""
    reqs = [Request("A", 0.0, 2, 12), Request("B", 0.0, 2, 12), Request("C", 0.010, 7, 2)]
    res, _ = run_requests(reqs, SarathiScheduler, step_time=step_time, max_num_batched_tokens=budget, max_num_seqs=8)
    return {s.id: s for s in res.states}, res


def max_gap(state):
    t = state.token_times
    return max(b - a for a, b in zip(t, t[1:], strict=False))


def test_chunked_prefill_timeline_by_hand():
    states, res = chunk_scenario(budget=4)
    # step 1: A, B prefill 2+2 tokens -> 10 + 4 = 14 ms; both get their first token at 0.014
    assert states["A"].first_token_s == pytest.approx(0.014)
    # rounds 2-4: 2 decodes + 2 prefill tokens of C = 10 + 2 + 4 = 16 ms; round 5: 2 decodes + C's last
    # token (7 = 2+2+2+1: the chunk does not divide the prompt) = 10 + 1 + 4 = 15 ms
    assert states["C"].first_token_s == pytest.approx(0.014 + 3 * 0.016 + 0.015)
    assert states["C"].first_token_s - states["C"].request.arrival_s == pytest.approx(0.067)
    durations = [s.duration_s for s in res.steps[:5]]
    assert durations == pytest.approx([0.014, 0.016, 0.016, 0.016, 0.015])
    # the decoding requests' largest gap is one mixed round
    assert max_gap(states["A"]) == pytest.approx(0.016)


def test_smaller_chunks_trade_prefill_latency_for_shorter_stalls():
    small, _ = chunk_scenario(budget=4)
    big, _ = chunk_scenario(budget=8)
    # budget 8: C gets 6 tokens then 1 -> rounds of 10+6+4 = 20 ms and 10+1+4 = 15 ms
    assert big["C"].first_token_s == pytest.approx(0.014 + 0.020 + 0.015)
    assert max_gap(big["A"]) == pytest.approx(0.020)
    assert max_gap(small["A"]) < max_gap(big["A"])
    assert small["C"].first_token_s > big["C"].first_token_s


def test_attention_pairs_and_kv_reads_by_hand():
    _, res = chunk_scenario(budget=4)
    # C's chunks (n, cached context c): (2,0) (2,2) (2,4) (1,6) -> pairs n*c + n(n+1)/2 = 3 + 7 + 11 + 7 = 28
    assert sum(s.features.attention_pairs for s in res.steps[1:5]) == 28 == 7 * 8 // 2
    # step 2: A and B decode with 2 cached tokens each -> each reads c + 1 = 3 KV tokens
    assert res.steps[1].features.kv_tokens_read == 6
    assert res.steps[1].features.num_decode_seqs == 2 and res.steps[1].features.num_prefill_tokens == 2


def test_prompt_longer_than_model_or_pool_is_rejected_with_reason():
    reqs = [Request("ok", 0.0, 10, 5), Request("long", 0.0, 100, 5), Request("pool", 0.0, 70, 5)]
    res, reps = run_requests(reqs, SarathiScheduler, num_blocks=4, block_size=16, max_model_len=80)
    by_id = {s.id: s for s in res.states}
    assert by_id["ok"].status is Status.FINISHED
    assert by_id["long"].status is Status.REJECTED and "max_model_len" in by_id["long"].reason
    assert by_id["pool"].status is Status.REJECTED and "KV blocks" in by_id["pool"].reason
    reps[0].kv.check_invariants()


def test_timeouts_end_requests_and_free_blocks():
    reqs = [Request(f"r{i}", 0.0, 50, 10) for i in range(6)]
    res, reps = run_requests(reqs, SarathiScheduler, step_time=lambda f: 0.1, request_timeout_s=3.0,
                         max_num_batched_tokens=64, max_num_seqs=2)
    statuses = [s.status for s in res.states]
    assert Status.TIMED_OUT in statuses and Status.FINISHED in statuses
    assert all(s.status.terminal for s in res.states)
    assert reps[0].kv.num_used_blocks == 0


def test_prompt_ids_outside_the_vocabulary_are_rejected():
    reqs = [Request("bad", 0.0, 3, 2, prompt_token_ids=(1, 99, 2)),
            Request("ok", 0.0, 3, 2, prompt_token_ids=(1, 2, 3))]
    res, _ = run_requests(reqs, SarathiScheduler, vocab_size=50)
    by_id = {s.id: s for s in res.states}
    assert by_id["bad"].status is Status.REJECTED and "vocabulary" in by_id["bad"].reason
    assert by_id["ok"].status is Status.FINISHED


def test_a_rejection_never_ends_before_its_arrival():
    """The idle-replica rejection runs at the clock's time, which SimPy can land one ulp before the arrival it
    was asked to reach; finish_s is clamped like first_scheduled_s."""
    import math

    from core.batch import Batch
    from core.kv_cache import KVCacheManager
    from core.replica import Replica, SchedulerLimits
    from policies.eviction.lru import LRUEviction

    class Nothing:  # schedules nothing: the waiting request is stuck on an idle replica
        def schedule(self, view):
            return Batch([])

    ended = []
    rep = Replica(0, Nothing(), KVCacheManager(8, 16, LRUEviction()), SchedulerLimits(),
                  on_terminal=lambda state, now: ended.append(state))
    arrival = 0.3
    rep.add(Request("r", arrival, 4, 2), arrival)
    early = math.nextafter(arrival, 0.0)
    rep.schedule(early)
    (state,) = ended
    assert state.status is Status.REJECTED and "idle replica" in state.reason
    assert state.finish_s == arrival > early
    rep.kv.check_invariants()


class _FixedRouter:
    def __init__(self, choice):
        self.choice = choice

    def route(self, request, replicas):
        return self.choice


@pytest.mark.parametrize(("choice", "message"), [
    (2, "router _FixedRouter returned replica 2 of 2"),
    (-1, "router _FixedRouter returned replica -1 of 2"),
    (0.0, r"router _FixedRouter returned 0\.0 \(float\); it must return the index of a replica, an int in 0\.\.1"),
    (None, r"router _FixedRouter returned None \(NoneType\)"),
])
def test_a_router_choice_that_is_not_a_replica_index_is_refused_naming_the_router(choice, message):
    with pytest.raises(RuntimeError, match=message):
        run_requests([Request("A", 0.0, 4, 2)], SarathiScheduler, replicas=2, router=_FixedRouter(choice),
                     max_num_batched_tokens=64, max_num_seqs=8)


def test_a_numpy_integer_is_a_replica_index():
    import numpy as np

    res, reps = run_requests([Request("A", 0.0, 4, 2)], SarathiScheduler, replicas=2,
                             router=_FixedRouter(np.int64(1)), max_num_batched_tokens=64, max_num_seqs=8)
    assert res.states[0].status is Status.FINISHED and res.states[0].replica == 1


class _Twice(SarathiScheduler):
    def schedule(self, view):
        batch = super().schedule(view)
        batch.chunks.append(batch.chunks[0])
        return batch


class _Finished(SarathiScheduler):
    """Schedules the first request it ever ran again once it has finished."""

    first = None

    def schedule(self, view):
        batch = super().schedule(view)
        if self.first is None and batch.chunks:
            self.first = batch.chunks[0].state
        elif self.first is not None and self.first.status.terminal:
            from core.batch import Chunk

            batch.chunks.append(Chunk(self.first, self.first.num_computed_tokens, 1, True, True))
        return batch


@pytest.mark.parametrize(("scheduler", "message"), [
    (_Twice, "_Twice: request A scheduled twice in one batch"),
    (_Finished, "_Finished: request A scheduled while FINISHED, not RUNNING"),
])
def test_a_batch_with_a_request_twice_or_a_finished_one_says_which(scheduler, message):
    reqs = [Request("A", 0.0, 4, 2), Request("B", 0.0, 4, 8)]
    with pytest.raises(RuntimeError, match=message):
        run_requests(reqs, scheduler, max_num_batched_tokens=64, max_num_seqs=8)


class _TooLong(SarathiScheduler):
    """Turns a decode into a 3-token chunk."""

    def schedule(self, view):
        from core.batch import Chunk

        batch = super().schedule(view)
        batch.chunks[:] = [Chunk(c.state, c.start, 3, True, False) if c.is_decode else c for c in batch.chunks]
        return batch


class _ReturnsList(SarathiScheduler):
    def schedule(self, view):
        return super().schedule(view).chunks


@pytest.mark.parametrize(("scheduler", "message"), [
    (_TooLong, r"_TooLong: request A scheduled 3 tokens from token 4; it has 1 left to compute"),
    (_ReturnsList, r"_ReturnsList\.schedule returned list, not a core\.batch\.Batch"),
])
def test_a_chunk_past_the_sequence_or_a_non_batch_is_refused_naming_the_scheduler(scheduler, message):
    with pytest.raises(RuntimeError, match=message):
        run_requests([Request("A", 0.0, 4, 4)], scheduler, max_num_batched_tokens=64, max_num_seqs=8)


class _DropsWaiting(SarathiScheduler):
    """Takes the newest waiting request out of the queue itself, without admitting or rejecting it."""

    def schedule(self, view):
        if len(view.waiting) > 1:
            view.waiting.pop()
        return super().schedule(view)


def test_a_request_a_scheduler_drops_from_its_queue_fails_the_run_instead_of_vanishing():
    """It used to end as a complete run with the request neither finished, rejected nor timed out."""
    reqs = [Request("A", 0.0, 4, 4), Request("B", 0.0, 4, 4), Request("C", 0.5, 4, 4)]
    with pytest.raises(RuntimeError, match=r"1 requests in no replica's queue, e\.g\. \['B \(WAITING\)'\]: "
                                           r"scheduler _DropsWaiting removed them"):
        run_requests(reqs, _DropsWaiting, max_num_batched_tokens=64, max_num_seqs=8)
