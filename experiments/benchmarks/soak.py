"""`twinserve bench_soak`: the server's memory over a long session of short requests (goal: RSS growth per request
under 200 bytes after warm-up), against ``backend=sim`` (no model, the cost model's step times on the wall clock).

A server that kept every request and step for one write at the end grew by a few KB a request; one that journals
them (``core.journal``) keeps live requests only. This sends ``--requests`` short completions (a few prompt tokens,
``--max-tokens`` outputs) from ``--concurrency`` keep-alive clients, samples the server process's resident set
(/proc/<pid>/status VmRSS) every ``--every`` requests, and reports the growth after ``--warmup`` requests: (last -
first sample) / requests between them, and the least-squares slope over all samples after warm-up (less sensitive
to one allocator step). At the end the server is stopped (SIGTERM) and its run files checked: every request
FINISHED and written. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def drive(url: str, pid: int, n: int, concurrency: int, max_tokens: int, every: int) -> list[tuple[int, int]]:
    """Send ``n`` requests; return (requests done, server RSS) samples."""
    import aiohttp

    samples: list[tuple[int, int]] = [(0, rss_bytes(pid))]
    done, next_id, failures = 0, 0, []
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, next_id
        while next_id < n:
            next_id += 1
            async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    failures.append(r.status)
            done += 1
            if done % every == 0:
                samples.append((done, rss_bytes(pid)))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed (HTTP {sorted(set(failures))})")
    return samples


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--warmup", type=int, default=10_000, help="requests before the first sample that counts")
    p.add_argument("--every", type=int, default=5_000, help="sample the server's RSS every this many requests")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--out", default=None, help="the server's run directory (default: a temporary one)")
    a = p.parse_args(argv)
    if not 0 <= a.warmup < a.requests:
        raise SystemExit(f"--warmup must be in [0, --requests={a.requests}), got {a.warmup}")
    from experiments.serving.server.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out) if a.out else Path(tmp) / "served"
        server = ServerProcess(None, out, "backend=sim", "scheduler.max_num_seqs=64", "kv.num_blocks=1024",
                               "serve.max_waiting=4096", "serve.flush_interval_s=5", "output.tokens=all")
        t0 = time.perf_counter()
        try:
            samples = asyncio.run(drive(server.url, server.proc.pid, a.requests, a.concurrency, a.max_tokens, a.every))
        finally:
            wall = time.perf_counter() - t0
            rc = server.stop(timeout=600)
        metrics = json.loads((out / "metrics.json").read_text())
    after = [(k, r) for k, r in samples if k >= a.warmup]
    ks, rs = np.array([k for k, _ in after], dtype=float), np.array([r for _, r in after], dtype=float)
    result = {
        "requests": a.requests, "wall_s": wall, "requests_per_s": a.requests / wall,
        "rss_start_mb": samples[0][1] / 2**20, "rss_at_warmup_mb": rs[0] / 2**20, "rss_end_mb": rs[-1] / 2**20,
        "growth_b_per_request": (rs[-1] - rs[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else float("nan"),
        "slope_b_per_request": float(np.polyfit(ks, rs, 1)[0]) if len(ks) > 2 else float("nan"),
        "server_rc": rc, "run_status": metrics.get("run_status"),
        "finished_written": metrics.get("counts_by_status", {}).get("FINISHED"),
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    print("samples (requests, RSS MB):", " ".join(f"{k}:{r / 2**20:.1f}" for k, r in samples))
    return result


if __name__ == "__main__":
    main()
