"""Tensor-parallel ranks as processes (nano-vllm's shape): rank 0 is the run's own process and drives (scheduler,
KV manager, sampling); ranks 1 .. tp-1 are child processes that build their shard (engine.tp) and loop on the
step inputs rank 0 broadcasts, running the same forward pass and collectives. gloo on CPU, NCCL on CUDA.

Nothing outlives the run and nothing hangs: a rank that dies (crash, kill) is seen by rank 0 within a poll
interval (its watchdog aborts an NCCL group so a pending collective fails; gloo fails on the closed socket) and the
step raises naming the rank and its exit code; a rank whose parent died exits on its own; ``close`` (also at
garbage collection and interpreter exit) tells the ranks to stop, then terminates any that do not.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import threading
import time
import weakref
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.runner import RunnerArgs, build_runner

STARTUP_TIMEOUT_S = 300.0  # ranks load (or seed) the whole model before cutting their shard
POLL_S = 0.1  # how often rank 0's watchdog and each rank's parent check look
STOP_TIMEOUT_S = 5.0  # a rank told to stop gets this long before it is terminated
# collectives wait while the run is idle (a server between requests): a dead peer is caught by the watchdogs, not
# by this timeout
IDLE_TIMEOUT = timedelta(days=7)


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_threads(args: RunnerArgs) -> int:
    """Torch threads of ranks 1 .. tp-1: ``num_threads``; on CPU, where the ranks share the cores, 1 unless set."""
    return args.num_threads or (1 if args.device == "cpu" else torch.get_num_threads())


def _start_method(args: RunnerArgs) -> str:
    """fork where it is safe: CPU ranks on one thread start at once, torch already imported (a forked child must
    not enter an OpenMP region the parent's thread pool was in: with one thread torch never does). Else spawn
    (CUDA cannot be forked into; a fresh interpreter imports torch: seconds)."""
    return "fork" if args.device == "cpu" and _rank_threads(args) == 1 else "spawn"


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def _follow(args: RunnerArgs, blocks: list[int], rank: int, port: int, parent: int) -> None:
    """A rank process: build the shard and a runner per replica (KV pools of ``blocks`` blocks), join the group,
    run every broadcast step on its replica's runner until rank 0 sends None."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(_rank_threads(args))
    device = args.rank_device(rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    runners = [build_runner(args, rank)]
    for n in blocks[1:]:
        runners.append(build_runner(replace(args, num_blocks=n), rank, runners[0].model))
    runners[0].warmup_kernels()
    store = dist.TCPStore("127.0.0.1", port, args.tp, False, timedelta(seconds=STARTUP_TIMEOUT_S))
    store.add("ready", 1)
    dist.init_process_group(_backend(device), store=store, rank=rank, world_size=args.tp, timeout=IDLE_TIMEOUT)
    try:
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            if msg[0] is None:
                break
            replica, inputs = msg[0]
            runners[replica].follow(inputs)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _dead(procs: list, size: int) -> str | None:
    """The first rank that exited, as a message; None while all run."""
    for rank, p in enumerate(procs, 1):
        if p.exitcode is not None:
            return f"tensor-parallel rank {rank} of {size} (pid {p.pid}) exited with code {p.exitcode}"
    return None


def _watch(procs: list, closed: threading.Event, backend: str) -> None:
    """Rank 0's watchdog: a dead rank aborts an NCCL group, so a collective waiting for it fails at once (gloo fails
    on the closed socket by itself). Holds no reference to the Workers, which its owner may drop."""
    while not closed.wait(POLL_S):
        if _dead(procs, len(procs) + 1) is not None:
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if backend == "nccl" and abort is not None:
                with contextlib.suppress(Exception):
                    abort()
            return


def _stop(procs: list, wait: bool) -> None:
    """End the rank processes: give each STOP_TIMEOUT_S to exit when ``wait`` (told to stop), then terminate, then
    kill (the finaliser of a Workers never closed: at once); then leave the process group."""
    for p in procs:
        p.join(timeout=STOP_TIMEOUT_S if wait else 0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=STOP_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class Workers:
    """Rank 0's side: start ranks 1 .. tp-1 (``__init__``: they build their shards while rank 0 builds its own),
    ``join`` the group, ``broadcast`` each step's inputs, ``close``."""

    def __init__(self, args: RunnerArgs, blocks: list[int] | None = None) -> None:
        """``blocks``: the KV pool of each replica the ranks serve (default one, ``args.num_blocks``)."""
        if dist.is_initialized():
            gc.collect()  # an earlier engine's Workers, dropped but in a reference cycle, leaves the group
        if dist.is_initialized():
            raise RuntimeError("parallel.tp > 1: one tensor-parallel engine per process (a process group is "
                               "already set up here)")
        self.size, self.backend = args.tp, _backend(args.device)
        self.store = dist.TCPStore("127.0.0.1", 0, args.tp, True, timedelta(seconds=STARTUP_TIMEOUT_S),
                                   wait_for_workers=False)
        ctx = mp.get_context(_start_method(args))
        blocks = blocks or [args.num_blocks]
        self.procs = [ctx.Process(target=_follow, args=(args, blocks, r, self.store.port, os.getpid()), daemon=True,
                                  name=f"twinserve-tp-rank{r}") for r in range(1, args.tp)]
        for p in self.procs:
            p.start()
        self._finalizer = weakref.finalize(self, _stop, self.procs, False)
        self.joined = False
        self._closed = threading.Event()

    def join(self) -> None:
        """Wait (at most STARTUP_TIMEOUT_S) until every rank has built its shard, then form the group (once)."""
        if self.joined:
            return
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.store.add("ready", 0) < self.size - 1:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks not ready after {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S / 5)
        dist.init_process_group(self.backend, store=self.store, rank=0, world_size=self.size, timeout=IDLE_TIMEOUT)
        self.joined = True
        threading.Thread(target=_watch, args=(self.procs, self._closed, self.backend), daemon=True).start()

    def dead(self) -> str | None:
        return _dead(self.procs, self.size)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise if a rank exited (waiting up to ``wait_s`` for one that is dying: a failed collective)."""
        deadline = time.monotonic() + wait_s
        while (msg := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 5)
        if msg is not None:
            self.close()
            raise RuntimeError(f"{msg}; the run stops (its rank 0 cannot step without it)")

    def broadcast(self, replica: int, inputs) -> None:
        """Send one step of replica ``replica`` (its engine.runner.HostInputs) to every rank (after checking they
        all still run)."""
        self.check()
        dist.broadcast_object_list([(replica, inputs)], src=0)

    def close(self) -> None:
        """Tell the ranks to stop, wait for them (terminating stragglers), leave the group. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        healthy = dist.is_initialized() and self.dead() is None
        if healthy:
            with contextlib.suppress(Exception):
                dist.broadcast_object_list([None], src=0)
        self._finalizer.detach()
        _stop(self.procs, healthy)
