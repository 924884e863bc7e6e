"""A host-memory KV tier under the device pool: swapped-out requests and spilled prefix blocks.

The tier is bookkeeping only, as ``KVCacheManager`` is: it owns host block ids and records the block copies a step
must perform (``core.batch.BlockCopy``), in the order they were decided. The replica hands them to the executor
with the step's batch: the simulator prices them on the host link (``HostLink``), the engine performs them on its
host tensor pool. Issue order is the contract: each copy sees the blocks as every earlier copy left them, and all
of them run before the step's forward pass, so a device block freed (and taken again) while scheduling still
holds its old content when its copy reads it.

Host blocks are of two kinds, sharing one pool:
- swapped: the blocks of a preempted request (refcount 1 until it is swapped back in, or ends);
- cached: prefix blocks spilled from the device when the device evicted them (refcount 0, keyed by block hash,
  ordered by the tier's own ``EvictionPolicy``). A swap-out may evict cached host blocks; a spill never evicts
  swapped ones. Block hashes carry the tenant / cache salt, so tenants never share a host block either.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from numbers import Integral

from core.batch import BlockCopy
from core.checks import check_int
from core.interfaces import Block, EvictionPolicy
from core.links import Link


@dataclass(slots=True)
class HostTierStats:
    """Counters of one tier over a run (every admission counts, warmup requests included)."""

    swap_outs: int = 0  # requests swapped out (preempted by swap)
    swap_ins: int = 0  # requests swapped back in
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    spill_blocks: int = 0  # evicted device prefix blocks copied to the host
    spill_dropped: int = 0  # evicted device prefix blocks the host had no room for
    load_blocks: int = 0  # prefix blocks copied back on a host hit
    admissions: int = 0  # prefix lookups at admission (swap-ins excluded)
    host_hit_admissions: int = 0  # ... that loaded at least one block from the host
    device_missed_blocks: int = 0  # cacheable prompt blocks those lookups missed on the device

    def summary(self, bytes_per_block: float) -> dict[str, float | int | None]:
        """The metrics.json ``host_tier`` section: counts, bytes each way, host hit rates."""
        out: dict[str, float | int | None] = asdict(self)
        out["bytes_to_host"] = (self.swap_out_blocks + self.spill_blocks) * bytes_per_block
        out["bytes_to_device"] = (self.swap_in_blocks + self.load_blocks) * bytes_per_block
        out["request_hit_rate"] = self.host_hit_admissions / self.admissions if self.admissions else None
        out["block_hit_rate"] = self.load_blocks / self.device_missed_blocks if self.device_missed_blocks else None
        return out


def copy_seconds(copies: Sequence[BlockCopy], link: Link, bytes_per_block: float) -> float:
    """What the simulator charges a step for its host-tier copies, serialised with the step (added to its duration):
    each direction used pays the link's latency once plus its bytes: a simple, conservative model (a real engine may
    overlap copies with compute on another stream)."""
    out = sum(1 for c in copies if c.to_host)
    return sum(link.seconds(n * bytes_per_block) for n in (out, len(copies) - out) if n)


class HostTier:
    """Host block pool: swapped requests' blocks and spilled prefix blocks, plus the copies decided this step."""

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy, spill: bool = True) -> None:
        check_int(num_blocks, "kv.host_blocks", 1)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction = eviction
        self.spill_enabled = spill  # False: the tier only holds swapped-out requests
        self.blocks = [Block(i, size=block_size) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> host block id
        self._swapped: dict[str, list[int]] = {}  # request id -> its host blocks, in table order
        self._copies: list[BlockCopy] = []
        self.stats = HostTierStats()

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Host blocks a swap-out can take: free plus cached-evictable."""
        return len(self._free) + len(self.eviction)

    def swapped(self, request_id: str) -> list[int] | None:
        """The host blocks of a swapped-out request (None when it is not swapped out)."""
        return self._swapped.get(request_id)

    def hits(self, hashes: Sequence[int]) -> list[int]:
        """Host block ids of the longest run of ``hashes`` cached here (no side effects)."""
        out = []
        for h in hashes:
            hid = self._cached.get(h)
            if hid is None:
                break
            out.append(hid)
        return out

    @property
    def swapped_ids(self) -> set[str]:
        return set(self._swapped)

    def take_copies(self) -> tuple[BlockCopy, ...]:
        """The copies decided since the last call, in issue order; the step that runs them takes them."""
        copies, self._copies = tuple(self._copies), []
        return copies

    @property
    def has_copies(self) -> bool:
        return bool(self._copies)

    # ---- swap ----------------------------------------------------------------------------------------------
    def swap_out(self, request_id: str, device_blocks: Sequence[int], now: float) -> bool:
        """Copy a preempted request's blocks to the host. False (nothing done) when the host cannot hold them."""
        assert request_id not in self._swapped, f"request {request_id} is already swapped out"
        if not device_blocks or len(device_blocks) > self.num_free_blocks:
            return False
        host = [self._take(now) for _ in device_blocks]
        self._copies += [BlockCopy("swap_out", d, h) for d, h in zip(device_blocks, host, strict=True)]
        self._swapped[request_id] = host
        self.stats.swap_outs += 1
        self.stats.swap_out_blocks += len(host)
        return True

    def swap_in(self, request_id: str, device_blocks: Sequence[int], skip: int, now: float) -> None:
        """Copy a swapped request's host blocks ``[skip:]`` into ``device_blocks`` (the first ``skip`` came from
        the device prefix cache) and release all its host blocks."""
        host = self._swapped.pop(request_id)
        assert len(host) - skip == len(device_blocks), "swap-in needs one device block per host block"
        self._copies += [BlockCopy("swap_in", d, h) for d, h in zip(device_blocks, host[skip:], strict=True)]
        self._release(host, now)
        self.stats.swap_ins += 1
        self.stats.swap_in_blocks += len(device_blocks)

    def drop(self, request_id: str, now: float) -> None:
        """A swapped-out request ended (aborted, timed out, rejected): its host blocks are free again."""
        host = self._swapped.pop(request_id, None)
        if host is not None:
            self._release(host, now)

    # ---- prefix spill --------------------------------------------------------------------------------------
    def spill(self, block: Block, device_block: int, now: float) -> None:
        """The device evicts cached ``block``: keep a copy here if room can be made among free and cached host
        blocks (swapped blocks are never evicted for a spill). Already cached here: nothing to copy."""
        if not self.spill_enabled or block.hash in self._cached:
            return
        if not self.num_free_blocks:
            self.stats.spill_dropped += 1
            return
        hid = self._take(now)
        blk = self.blocks[hid]
        blk.ref_count = 0
        blk.hash, blk.depth, blk.cached_s, blk.num_hits, blk.last_used_s = block.hash, block.depth, now, 0, now
        self._cached[block.hash] = hid
        self.eviction.on_cached(blk, now)
        self.eviction.on_free(blk, now)
        self._copies.append(BlockCopy("spill", device_block, hid))
        self.stats.spill_blocks += 1

    def pin(self, host_blocks: Sequence[int], now: float) -> None:
        """Hold cached host blocks while an admission takes device blocks (whose evictions may spill here), so that
        no spill overwrites them before their load is issued."""
        for hid in host_blocks:
            blk = self.blocks[hid]
            if blk.ref_count == 0:
                self.eviction.on_hit(blk, now)
            blk.ref_count += 1

    def unpin(self, host_blocks: Sequence[int], now: float) -> None:
        """Undo ``pin``."""
        self._release(host_blocks, now)

    def load(self, host_blocks: Sequence[int], device_blocks: Sequence[int], now: float) -> None:
        """Copy pinned cached host blocks into device blocks (a host prefix hit); they stay cached here."""
        self._copies += [BlockCopy("load", d, h) for d, h in zip(device_blocks, host_blocks, strict=True)]
        for hid in host_blocks:
            self.blocks[hid].num_hits += 1
        self._release(host_blocks, now)
        self.stats.load_blocks += len(host_blocks)

    # ---- helpers -------------------------------------------------------------------------------------------
    def _take(self, now: float) -> int:
        if self._free:
            hid = self._free.popleft()
        else:
            hid = self.eviction.victim()
            blk = self.blocks[hid] if isinstance(hid, Integral) and 0 <= hid < len(self.blocks) else None
            if blk is None or blk.ref_count != 0 or blk.hash is None:
                raise RuntimeError(f"host eviction {type(self.eviction).__name__}.victim() returned {hid!r}, not "
                                   "the id of an evictable spilled block")
            del self._cached[blk.hash]
            blk.hash = None
        blk = self.blocks[hid]
        blk.ref_count, blk.last_used_s = 1, now
        return hid

    def _release(self, host_blocks: Sequence[int], now: float) -> None:
        for hid in host_blocks:
            blk = self.blocks[hid]
            blk.ref_count -= 1
            assert blk.ref_count >= 0, f"host block {hid} refcount went negative"
            if blk.ref_count == 0:
                blk.last_used_s = now
                if blk.hash is not None:
                    self.eviction.on_free(blk, now)
                else:
                    self._free.append(hid)

    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for host in self._swapped.values():
            for hid in host:
                refs[hid] += 1
        for blk in self.blocks:
            assert blk.ref_count == refs[blk.id], f"host block {blk.id}: refcount {blk.ref_count}, held {refs[blk.id]}x"
            assert blk.ref_count == 0 or blk.hash is None, f"host block {blk.id} is both swapped and cached"
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is twice on the free list"
        for hid in free:
            assert self.blocks[hid].ref_count == 0 and self.blocks[hid].hash is None
        n_cached = sum(1 for b in self.blocks if b.hash is not None)
        assert n_cached == len(self._cached) == len(self.eviction), \
            f"{n_cached} cached host blocks, map {len(self._cached)}, policy {len(self.eviction)}"
        assert len(free) + n_cached + sum(refs) == self.num_blocks, "a host block is lost"
        for h, hid in self._cached.items():
            assert self.blocks[hid].hash == h
