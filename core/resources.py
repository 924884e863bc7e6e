"""What this machine can hold: a config's memory estimate is checked before anything is built, so a pool or a
replica count that cannot fit is refused at start, naming the key, instead of running for minutes and then
exhausting memory."""

from __future__ import annotations

import os

from core.kv_cache import BLOCK_BYTES_IDLE, BLOCK_BYTES_USED

REPLICA_BYTES = 64 * 1024  # a replica's own objects (scheduler, queues, view, policy state), order of magnitude


def available_memory_bytes() -> int | None:
    """Memory a new allocation can get now: /proc/meminfo's MemAvailable, else free physical pages; None if
    neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def block_bookkeeping_bytes() -> int:
    """Host memory of one KV block's bookkeeping once it has been used (a long run with prefix caching uses every
    block: cached blocks stay until evicted, and never-used blocks are taken before any is evicted)."""
    return BLOCK_BYTES_IDLE + BLOCK_BYTES_USED


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"
