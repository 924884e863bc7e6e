"""core.shapes: batches of chosen shapes admitted through the KV manager's own admit / allocate, released after."""

import pytest

from core.batch import Batch, StepFeatures
from core.kv_cache import KVCacheManager
from core.request import Request, RequestState, Status
from core.shapes import ShapedBatch, admit_chunk, shape_blocks
from policies.eviction.lru import LRUEviction

BS = 16


def pool_with_history(num_blocks: int = 64) -> tuple[KVCacheManager, RequestState]:
    """A pool that already holds a running request and some evictable prefix-cache blocks."""
    kv = KVCacheManager(num_blocks, BS, LRUEviction())
    done = RequestState(Request("done", 0.0, 40, 1), block_hashes=[11, 12])
    assert kv.admit(done, 40, 0.0)
    done.num_computed_tokens = 40
    kv.register_computed(done, 1.0)
    kv.free(done, 2.0)  # its two full blocks stay cached, evictable
    live = RequestState(Request("live", 0.0, 20, 4))
    assert kv.admit(live, 20, 3.0)
    kv.check_invariants()
    assert len(kv.eviction) == 2 and kv.num_used_blocks == 2
    return kv, live


def test_features_are_the_hand_computed_ones():
    kv, _ = pool_with_history()
    shape = ShapedBatch(prefills=[(100, 30), (0, 17)], decodes=[20, 20, 50], name="s")
    batch = shape.admit(kv)
    # prefill (c=100, n=30): n*c + n(n+1)/2 pairs, c + n KV; prefill (0, 17): 17*18/2 pairs; decode at t: t KV read
    # (the decodes' longest and shortest contexts: 50 and 20)
    assert batch.features == StepFeatures(
        num_seqs=5, num_batched_tokens=30 + 17 + 3, num_prefill_seqs=2, num_prefill_tokens=47, num_decode_seqs=3,
        attention_pairs=30 * 100 + 30 * 31 // 2 + 17 * 18 // 2, kv_tokens_read=20 + 20 + 50,
        prefill_kv_tokens=130 + 17, max_context_len=130, max_decode_context=50, min_decode_context=20)
    assert [(ch.start, ch.num_tokens, ch.samples, ch.is_decode) for ch in batch.chunks] == [
        (100, 30, True, False), (0, 17, True, False), (19, 1, True, True), (19, 1, True, True), (49, 1, True, True)]
    assert [ch.state.id for ch in batch.chunks] == ["s-p0", "s-p1", "s-d0", "s-d1", "s-d2"]
    assert all(ch.state.status is Status.RUNNING for ch in batch.chunks)


def test_release_returns_refcounts_to_the_baseline_and_the_shape_reruns():
    kv, live = pool_with_history()
    baseline = [b.ref_count for b in kv.blocks]
    free0, cached0 = kv.num_free_blocks, sum(b.hash is not None for b in kv.blocks)
    shape = ShapedBatch(prefills=[(40, 9)], decodes=[33, 2], name="r")
    assert shape.num_blocks(BS) == shape_blocks([(40, 9)], [33, 2], BS) == 4 + 3 + 1
    first = None
    for _ in range(3):
        batch = shape.admit(kv)
        kv.check_invariants()
        assert kv.num_free_blocks == free0 - shape.num_blocks(BS)
        for ch in batch.chunks:  # room for every chunk, exactly as many blocks as its tokens need
            assert kv.num_blocks_held(ch.state.id) == kv.blocks_for(ch.end)
        first = first or batch.features
        assert batch.features == first
        shape.release(kv)
        kv.check_invariants()
        assert [b.ref_count for b in kv.blocks] == baseline
        assert (kv.num_free_blocks, sum(b.hash is not None for b in kv.blocks)) == (free0, cached0)
        assert all(kv.num_blocks_held(st.id) == 0 and st.status is Status.WAITING for st in shape.states)
    assert kv.num_blocks_held(live.id) == 2


def test_a_pool_too_small_raises_and_holds_nothing():
    kv = KVCacheManager(5, BS, LRUEviction())
    shape = ShapedBatch(decodes=[33, 33])  # 3 blocks each
    with pytest.raises(RuntimeError, match="KV pool too small"):
        shape.admit(kv)
    kv.check_invariants()
    assert kv.num_used_blocks == 0 and all(st.status is Status.WAITING for st in shape.states)


def test_same_blocks_as_admitting_the_whole_request_at_once():
    """admit (computed tokens) + allocate (chunk) takes the blocks one admit of the whole would take."""
    a, b = KVCacheManager(32, BS, LRUEviction()), KVCacheManager(32, BS, LRUEviction())
    shaped = ShapedBatch(prefills=[(37, 20)], decodes=[70])
    shaped.admit(a)
    for st in shaped.states:
        twin = RequestState(st.request)
        assert b.admit(twin, twin.num_tokens, 0.0)
        assert a.block_table(st.id) == b.block_table(twin.id)


def test_admit_chunk_grows_a_running_request_step_by_step():
    """A prefill then decodes of one request (as the engine warm-up runs them): blocks are taken as it grows."""
    kv = KVCacheManager(8, BS, LRUEviction())
    state = RequestState(Request("w", 0.0, 31, 3))
    computed, shapes = 0, []
    for token in (5, 6, 7):
        chunk = admit_chunk(kv, state, computed, state.num_tokens - computed)
        shapes.append((chunk.start, chunk.num_tokens, chunk.is_decode, list(kv.block_table("w"))))
        state.output_token_ids.append(token)
        computed = chunk.end
    assert shapes == [(0, 31, False, [0, 1]), (31, 1, True, [0, 1]), (32, 1, True, [0, 1, 2])]
    assert Batch([admit_chunk(kv, state, computed, 1)]).features.kv_tokens_read == 34
    kv.free(state, 0.0)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


@pytest.mark.parametrize("prefills,decodes", [([(0, 0)], []), ([(-1, 4)], []), ([], [1])])
def test_impossible_shapes_are_refused(prefills, decodes):
    with pytest.raises(ValueError, match="shape"):
        ShapedBatch(prefills, decodes)
