"""The SchedulerView a replica hands its scheduler is a view: the Protocol's members, no KV cache manager."""

import ast
from pathlib import Path

import pytest

from core import interfaces
from core.batch import Batch, Chunk
from core.interfaces import SchedulerView
from core.kv_cache import KVCacheManager
from core.replica import Replica, ReplicaSchedulerView, SchedulerLimits
from core.request import Request
from policies.eviction.lru import LRUEviction

CORE = Path(interfaces.__file__).parent


def protocol_members(proto) -> set[str]:
    return {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)


def test_interfaces_import_only_batch_request_and_checks():
    tree = ast.parse((CORE / "interfaces.py").read_text())
    core_imports = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("core")}
    assert core_imports == {"core.batch", "core.checks", "core.request"}  # core.checks imports nothing of core


def test_replica_view_has_the_protocol_members_and_no_kv():
    kv = KVCacheManager(16, 4, LRUEviction())
    view = ReplicaSchedulerView(Replica(0, object(), kv, SchedulerLimits()), 0.0)
    members = protocol_members(SchedulerView)
    assert members >= {"now", "waiting", "running", "limits", "preempted", "blocked", "block_size",
                       "num_free_blocks", "lookup", "admit", "allocate", "preempt"}
    for name in members:
        assert hasattr(view, name), name
    assert not hasattr(view, "kv") and not hasattr(view, "_replica")
    with pytest.raises(AttributeError):
        view.kv = kv  # slots: nothing else can be hung on the view
    assert (view.block_size, view.num_free_blocks) == (4, 16)


class GreedyScheduler:
    """Admits everything it can with room for ``room`` tokens, then runs ``run`` tokens of each request."""

    def __init__(self, room: int, run: int) -> None:
        self.room, self.run = room, run

    def schedule(self, view: SchedulerView) -> Batch:
        chunks = []
        for state in list(view.waiting):
            if view.admit(state, self.room):
                chunks.append(Chunk.next(state, self.run))
        return Batch(chunks)


def test_view_admit_allocate_preempt_move_requests_and_blocks():
    kv = KVCacheManager(8, 4, LRUEviction())
    rep = Replica(0, GreedyScheduler(8, 8), kv, SchedulerLimits())
    a, b = rep.add(Request("a", 0.0, 8, 2), 0.0), rep.add(Request("b", 0.0, 8, 2), 0.0)
    batch = rep.schedule(0.0)
    assert [ch.state for ch in batch.chunks] == [a, b] and kv.num_free_blocks == 4
    rep.apply(batch, [1, 1], 1.0)
    view = ReplicaSchedulerView(rep, 1.0)  # the replica's queues and KV pool, as its scheduler sees them
    assert view.num_free_blocks == 4
    assert view.allocate(a, 1) and view.num_free_blocks == 3
    view.preempt(b)
    assert list(view.waiting) == [b] and list(view.running) == [a] and view.preempted == ["b"]
    assert view.num_free_blocks == 5 and kv.num_blocks_held("b") == 0
    kv.check_invariants()


def test_a_batch_beyond_the_admitted_blocks_is_refused():
    kv = KVCacheManager(8, 4, LRUEviction())
    rep = Replica(0, GreedyScheduler(4, 6), kv, SchedulerLimits())
    rep.add(Request("a", 0.0, 8, 2), 0.0)
    with pytest.raises(RuntimeError, match="without KV blocks"):
        rep.schedule(0.0)
