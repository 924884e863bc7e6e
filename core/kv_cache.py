"""Paged KV-cache bookkeeping: a fixed pool of blocks, refcounts, block tables and the prefix cache.

Both backends use this class unchanged; the engine's KV tensors are indexed by exactly these block ids.
A block is in one of three places: in use (refcount > 0), free (refcount 0, no cached content) or
evictable (refcount 0, still holding a cached prefix block; ordered by the EvictionPolicy plugin).

Two prefix-cache modes (``prefix_cache_mode``):

- ``prompt`` (default): a request's full prompt blocks enter the cache once computed (``register_computed``, after
  the step); a block whose content is cached already stays private (the first copy is kept).
- ``vllm``: vLLM v1's block pool. Every full block enters the cache, generated tokens' blocks too, as soon as the
  step that computes it is scheduled (``admit`` / ``allocate``): a request admitted later in the same step hits it.
  Copies of one content all stay cached; a lookup takes the one cached first. With ``lru`` eviction the evictable
  blocks then leave in vLLM's order: its free queue evicts from the front and a freed request's blocks are
  appended tail first, which is LRU's order (key = the time a block became evictable, ties in freeing order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from numbers import Integral

from core.checks import check_choice, check_int
from core.host_tier import HostTier
from core.interfaces import Block, EvictionPolicy  # Block lives with the EvictionPolicy that reads it
from core.prompt import extend_block_hashes
from core.request import RequestState

# Host memory per block: a never-used block costs its list slot; a used one a Block object, its place in a block
# table, and once cached its prefix-cache entry and eviction-policy entry (measured with tracemalloc on a 100k pool:
# ~190 B in a table, ~340 B cached and evictable under LRU, ~390 B under cost-aware eviction).
# ``core.resources`` sizes a config with these before building it.
BLOCK_BYTES_USED = 400
BLOCK_BYTES_IDLE = 8

PROMPT, VLLM = "prompt", "vllm"
PREFIX_CACHE_MODES = (PROMPT, VLLM)


class _Blocks(Sequence[Block]):
    """The pool's blocks by id, each created the first time it is used: a never-used block is free with default
    fields, so a million-block pool costs one list slot per block until its blocks are taken."""

    __slots__ = ("_items", "_size")

    def __init__(self, items: list[Block | None], size: int) -> None:
        self._items, self._size = items, size

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._items)))]
        blk = self._items[i]
        if blk is None:
            i = range(len(self._items))[i]
            blk = self._items[i] = Block(i, size=self._size)
        return blk

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(len(self._items)))

    def made(self) -> Iterator[Block]:
        """The blocks created so far (every other block is free, refcount 0, no hash)."""
        return (b for b in self._items if b is not None)


class KVCacheManager:
    """Allocates blocks to requests and shares full blocks (prompt blocks; in vllm mode every block) through chained
    hashes (core.prompt)."""

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy,
                 enable_prefix_caching: bool = True, host: HostTier | None = None,
                 prefix_cache_mode: str = PROMPT) -> None:
        check_int(num_blocks, "kv.num_blocks", 1)
        check_int(block_size, "kv.block_size", 1)
        check_choice(prefix_cache_mode, "kv.prefix_cache_mode", PREFIX_CACHE_MODES)
        if prefix_cache_mode == VLLM and host is not None:
            raise ValueError("kv.prefix_cache_mode=vllm does not support the host KV tier: set kv.host_blocks=0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction = eviction
        self.enable_prefix_caching = enable_prefix_caching
        self._items: list[Block | None] = [None] * num_blocks  # Blocks are created on first use (_take)
        self.blocks = _Blocks(self._items, block_size)
        # Free blocks: the never-used ids [_fresh, num_blocks) first, in id order, then the freed ones (FIFO) --
        # the order of one deque that starts as 0..n-1 and gets freed ids appended.
        self._fresh = 0
        self._free: deque[int] = deque()
        # Blocks an allocation can take (never-used + free + evictable), kept as a count: the schedulers and the
        # decode fast-forward read it for every allocation, and len(eviction) is a Python call.
        self._num_free = num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id (in vllm mode: the copy cached first)
        self._copies: dict[int, list[int]] = {}  # vllm mode: block hash -> later cached copies, in caching order
        self.prefix_cache_mode = prefix_cache_mode
        # vllm mode: blocks are published (and generated tokens' blocks hashed) when their step is scheduled
        self.publishes_on_schedule = prefix_cache_mode == VLLM and enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}  # request id -> how many of its blocks are in the prefix cache
        self.host = host  # host KV tier (swap preemption, prefix spill); None: off

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks in the request's table (0 if it holds none): room for ``num_blocks_held * block_size`` tokens."""
        return len(self._tables.get(request_id, ()))

    def _hits(self, state: RequestState) -> list[int]:
        """Block ids of the longest cached prefix; the last token is always recomputed (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        limit = (state.num_tokens - 1) // self.block_size
        hashes = self._hashes(state, limit)
        limit = min(len(hashes), limit)
        hits = []
        for h in hashes[:limit]:
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def lookup(self, state: RequestState) -> int:
        """Tokens of ``state`` that a prefix-cache hit would skip now (no side effects); with a host tier, also
        the blocks it would copy back: a swapped-out request's computed tokens, or prefix blocks cached there."""
        if self.host is None:
            return len(self._hits(state)) * self.block_size
        if self.host.swapped(state.id) is not None:
            return state.num_computed_tokens
        hits = self._hits(state)
        return (len(hits) + len(self._host_hits(state, len(hits)))) * self.block_size

    def _host_hits(self, state: RequestState, num_device_hits: int) -> list[int]:
        """Host block ids continuing the device prefix hit (same limit: the last token is recomputed)."""
        if not self.enable_prefix_caching:
            return []
        limit = min(len(state.block_hashes), (state.num_tokens - 1) // self.block_size)
        return self.host.hits(state.block_hashes[num_device_hits:limit])

    # ---- allocation ----------------------------------------------------------------------------------------
    def admit(self, state: RequestState, num_new_tokens: int, now: float, fit_tokens: int = 0) -> bool:
        """First allocation of a waiting request: take its cached prefix, then blocks for ``num_new_tokens``
        more tokens. Sets ``num_computed_tokens`` to the hit length. All-or-nothing: False, changing nothing, also
        when the pool could not hold ``fit_tokens`` tokens of the request in all (its cached prefix included; vLLM's
        check that a whole prompt fits before its first chunk is admitted)."""
        assert state.id not in self._tables, f"request {state.id} already holds blocks"
        hits = self._hits(state)
        if self.host is not None:
            return self._admit_with_host(state, hits, num_new_tokens, now, fit_tokens)
        cached = len(hits) * self.block_size
        need = self.blocks_for(cached + num_new_tokens) - len(hits)
        if not self._claim(hits, max(need, self.blocks_for(fit_tokens) - len(hits)), now):
            return False
        self._tables[state.id] = hits + self._take(need, now)
        self._registered[state.id] = len(hits)
        state.num_computed_tokens = cached
        if self.publishes_on_schedule:
            self._register(state, min(cached + num_new_tokens, state.num_tokens) // self.block_size, now)
        return True

    def _claim(self, hits: list[int], room: int, now: float) -> bool:
        """Take references on cached ``hits`` if ``room`` more blocks are free besides them; False changes
        nothing."""
        items = self._items
        reclaimed = sum(1 for b in hits if items[b].ref_count == 0)  # evictable hits stop being free
        if room + reclaimed > self._num_free:
            return False
        self._num_free -= reclaimed
        for bid in hits:
            blk = items[bid]
            blk.num_hits += 1
            blk.last_used_s = now
            blk.ref_count += 1
            self.eviction.on_hit(blk, now)
        return True

    def _admit_with_host(self, state: RequestState, hits: list[int], num_new_tokens: int, now: float,
                         fit_tokens: int) -> bool:
        """``admit`` with a host tier: a swapped-out request gets its blocks back (those its device prefix hit
        covers come from the device cache, the rest are copied in); any other request's prefix continues on the
        host, whose blocks are copied in instead of recomputed. The copied blocks are published to the device
        prefix cache as a computed prompt would be."""
        host, bs = self.host, self.block_size
        swapped = host.swapped(state.id)
        if swapped is not None:
            computed = state.num_computed_tokens
            hits = hits[:min(len(swapped), computed // bs)]  # only whole computed blocks may be shared
            copied: list[int] = swapped[len(hits):]
        else:
            copied = self._host_hits(state, len(hits))
            computed = (len(hits) + len(copied)) * bs
        need = self.blocks_for(computed + num_new_tokens) - len(hits)
        host.pin(copied, now)  # taking device blocks may spill to the host: keep these from being evicted
        if not self._claim(hits, max(need, self.blocks_for(fit_tokens) - len(hits)), now):
            host.unpin(copied, now)
            return False
        table = hits + self._take(need, now)
        targets = table[len(hits):len(hits) + len(copied)]
        if swapped is not None:
            host.unpin(copied, now)
            host.swap_in(state.id, targets, len(hits), now)
        else:
            host.load(copied, targets, now)
            stats = host.stats
            stats.admissions += 1
            stats.host_hit_admissions += bool(copied)
            stats.device_missed_blocks += max(0, min(len(state.block_hashes),
                                                     (state.num_tokens - 1) // bs) - len(hits))
        self._tables[state.id] = table
        self._registered[state.id] = len(hits)
        state.num_computed_tokens = computed
        self.register_computed(state, now)
        return True

    def swap_out(self, state: RequestState, now: float) -> bool:
        """Swap preemption: copy the blocks holding the request's computed tokens to the host tier and free its
        device blocks; ``num_computed_tokens`` is kept for the swap-in. False (nothing done) without room."""
        n = self.blocks_for(state.num_computed_tokens)
        if self.host is None or n == 0 or n > self.host.num_free_blocks:
            return False
        blocks = self._tables[state.id][:n]
        self.free(state, now)  # the blocks keep their content until this step's copies have run
        return self.host.swap_out(state.id, blocks, now)

    def allocate(self, state: RequestState, num_new_tokens: int, now: float) -> bool:
        """Grow a running request's table to hold ``num_new_tokens`` more tokens. All-or-nothing."""
        table = self._tables[state.id]
        end = state.num_computed_tokens + num_new_tokens
        need = -(-end // self.block_size) - len(table)
        if need > 0:
            if need > self._num_free:
                return False
            table += self._take(need, now)
        if self.publishes_on_schedule:  # the blocks this step completes (never past the tokens known: drafts)
            self._register(state, min(end, state.num_tokens) // self.block_size, now)
        return True

    def receive(self, state: RequestState, num_tokens: int, now: float) -> list[int] | None:
        """PD disaggregation: a table of fresh blocks for ``num_tokens`` tokens of KV that arrive from another
        replica's pool (this pool's prefix cache is neither read nor written). All-or-nothing: None, changing
        nothing, when the pool cannot hold them now. The table is then the request's, as after ``admit``."""
        assert state.id not in self._tables, f"request {state.id} already holds blocks"
        need = self.blocks_for(num_tokens)
        if need > self._num_free:
            return None
        table = self._tables[state.id] = self._take(need, now)
        self._registered[state.id] = 0
        return table

    def _take(self, n: int, now: float) -> list[int]:
        """``n`` blocks (at most ``_num_free``), each with one reference: never-used ids first (id order), then
        freed ones (FIFO), then cached ones in the eviction policy's order. One pass per source rather than a call
        per block: an admission takes a whole prompt's blocks at once."""
        self._num_free -= n
        items = self._items
        ids = self._take_fresh(n) if self._fresh < self.num_blocks else []
        free = self._free
        while len(ids) < n and free:
            ids.append(free.popleft())
        for bid in ids:
            blk = items[bid]
            blk.ref_count = 1
            blk.last_used_s = now
        if len(ids) < n:
            ids += self._evict(n - len(ids), now)
        return ids

    def _take_fresh(self, n: int) -> list[int]:
        """Up to ``n`` never-used block ids, in id order, their Blocks created."""
        fresh, items = self._fresh, self._items
        ids = list(range(fresh, min(fresh + n, self.num_blocks)))
        self._fresh = fresh + len(ids)
        for bid in ids:
            if items[bid] is None:  # (one read through ``blocks`` exists already)
                items[bid] = Block(bid, size=self.block_size)
        return ids

    def _evict(self, n: int, now: float) -> list[int]:
        """``n`` cached blocks the eviction policy gives up, out of the prefix cache, each with one reference."""
        items, victim, host, uncache = self._items, self.eviction.victim, self.host, self._uncache
        ids = []
        for _ in range(n):
            bid = victim()
            blk = items[bid] if isinstance(bid, Integral) and 0 <= bid < len(items) else None
            if blk is None or blk.ref_count != 0 or blk.hash is None:
                raise RuntimeError(f"eviction {type(self.eviction).__name__}.victim() returned {bid!r}, not the id "
                                   "of an evictable cached block")
            if host is not None:
                host.spill(blk, bid, now)  # the copy runs before this step writes the block
            uncache(blk.hash, bid)
            blk.hash = None
            blk.num_hits = 0
            blk.ref_count = 1
            blk.last_used_s = now
            ids.append(bid)
        return ids

    def register_computed(self, state: RequestState, now: float) -> None:
        """Publish the request's newly completed full prompt blocks to the prefix cache (``prompt`` mode; in
        ``vllm`` mode they were published when their step was scheduled)."""
        if not self.enable_prefix_caching or self.publishes_on_schedule:
            return
        self._register(state, min(state.num_computed_tokens // self.block_size, len(state.block_hashes)), now)

    def _register(self, state: RequestState, done: int, now: float) -> None:
        """Publish the request's blocks up to its ``done``-th to the prefix cache. A content cached already: in
        ``prompt`` mode the block stays private (the first copy is kept), in ``vllm`` mode it is cached as a
        further copy."""
        start = self._registered.get(state.id, done)
        if done <= start:
            return
        hashes = self._hashes(state, done)
        items, cached, on_cached = self._items, self._cached, self.eviction.on_cached  # locals: a loop per block
        table = self._tables[state.id]
        copies = self.publishes_on_schedule
        for i in range(start, done):
            h = hashes[i]
            bid = table[i]
            if h in cached:  # same content computed concurrently by another request
                if not copies:
                    continue
                self._copies.setdefault(h, []).append(bid)
            else:
                cached[h] = bid
            blk = items[bid]
            blk.hash = h
            blk.depth = i
            blk.cached_s = now
            blk.num_hits = 0
            on_cached(blk, now)
        self._registered[state.id] = done

    def _hashes(self, state: RequestState, num_blocks: int) -> Sequence[int]:
        """The request's block hashes; in ``vllm`` mode first extended to its first ``num_blocks`` full blocks of
        prompt + output tokens (the list a request starts with holds its prompt's and may be shared: the first
        extension copies it)."""
        hashes = state.block_hashes
        if self.publishes_on_schedule and len(hashes) < num_blocks \
                and state.num_tokens >= (len(hashes) + 1) * self.block_size:
            if len(hashes) <= state.request.prompt_len // self.block_size:
                hashes = state.block_hashes = list(hashes)
            extend_block_hashes(state.request, hashes, state.output_token_ids, self.block_size, num_blocks)
        return hashes

    def _uncache(self, h: int, bid: int) -> None:
        """Block ``bid``, cached as ``h``, leaves the prefix cache (the next copy of ``h``, if any, takes over)."""
        copies = self._copies.get(h)
        if copies is None:
            del self._cached[h]
            return
        if self._cached[h] == bid:
            self._cached[h] = copies.pop(0)
        else:
            copies.remove(bid)
        if not copies:
            del self._copies[h]

    def trim(self, state: RequestState, num_tokens: int) -> None:
        """Shrink a running request's table to the blocks ``num_tokens`` tokens need (speculative decoding: the
        blocks allocated for drafts the target rejected). Such tail blocks hold no published prefix."""
        table = self._tables[state.id]
        keep = max(-(-num_tokens // self.block_size), self._registered.get(state.id, 0))
        while len(table) > keep:
            bid = table.pop()
            blk = self._items[bid]
            blk.ref_count -= 1
            assert blk.ref_count == 0 and blk.hash is None, f"trimmed block {bid} is shared or cached"
            self._free.append(bid)
            self._num_free += 1

    def free(self, state: RequestState, now: float) -> None:
        """Drop the request's references (and its swapped-out host blocks). Tail blocks go first so that equal-age
        evictions take tails first."""
        if self.host is not None:
            self.host.drop(state.id, now)
        table = self._tables.pop(state.id, None)
        self._registered.pop(state.id, None)
        if table is None:
            return
        items, free, on_free = self._items, self._free, self.eviction.on_free  # locals: a loop per block
        freed = 0
        for bid in reversed(table):
            blk = items[bid]
            refs = blk.ref_count - 1
            blk.ref_count = refs
            if refs == 0:
                freed += 1
                blk.last_used_s = now
                if blk.hash is not None:
                    on_free(blk, now)
                else:
                    free.append(bid)
            else:
                assert refs > 0, f"block {bid} refcount went negative"
        self._num_free += freed

    # ---- invariants (tests and debugging) ------------------------------------------------------------------
    def check_invariants(self) -> None:
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for bid in table:
                refs[bid] += 1
        made = list(self.blocks.made())
        for blk in made:
            assert blk.ref_count == refs[blk.id], f"block {blk.id}: refcount {blk.ref_count}, held {refs[blk.id]}x"
        assert all(r == 0 for r in refs[self._fresh:]), "a never-used block is in a block table"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice on the free list"
        assert all(bid < self._fresh for bid in free), "a never-used block is on the free list"
        for bid in free:
            assert self._items[bid].ref_count == 0 and self._items[bid].hash is None
        n_evictable = sum(1 for b in made if b.ref_count == 0 and b.hash is not None)
        assert n_evictable == len(self.eviction), f"{n_evictable} evictable blocks, policy tracks {len(self.eviction)}"
        n_fresh = self.num_blocks - self._fresh
        assert self._num_free == n_fresh + len(free) + n_evictable, f"free count {self._num_free} is stale"
        assert len(free) + n_fresh + n_evictable + sum(1 for b in made if b.ref_count > 0) == self.num_blocks
        for h, bid in self._cached.items():
            assert self._items[bid].hash == h
        for h, copies in self._copies.items():
            assert h in self._cached and all(self._items[bid].hash == h for bid in copies)
        n_copies = sum(len(c) for c in self._copies.values())
        assert sum(1 for b in made if b.hash is not None) == len(self._cached) + n_copies, "a cached block is unmapped"
        if self.host is not None:
            self.host.check_invariants()
            assert not self._tables.keys() & self.host.swapped_ids, "a request holds device and host blocks"
