"""The engine's core.interfaces.Executor: runs the model on a batch and reports the measured step time."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from core.arithmetic import check_group_size
from core.batch import Batch, Chunk
from core.checks import check_choice
from core.interfaces import BaseExecutor, StepOutput
from core.specs import ModelSpec, QuantSpec
from engine.attention import allocate_kv_caches
from engine.host_pool import HostKVPool
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from engine.options import EngineOptions
from engine.runner import ModelRunner, RunnerArgs, build_runner, resolve_kernels
from engine.sampler import Sampler, SamplingParams
from engine.speculative import DraftModelProposer, Proposer
from engine.workers import Workers

if TYPE_CHECKING:
    from core.kv_cache import KVCacheManager


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# How a step is timed. ``thread``: the CPU time of the calling thread. On a CPU engine with one torch thread every
# operator runs on that thread, so its CPU time is the step's compute time without the time other processes held
# the core: on a shared machine the wall clock of a step swings by tens of percent with the neighbours' load, the
# thread's CPU time far less. Anything else (a GPU, several torch threads, the server) needs ``wall``.
STOPWATCHES = {"wall": time.perf_counter, "thread": time.thread_time}
FAILED_RANK_WAIT_S = 3.0  # a collective failed: how long to wait for the rank behind it to be seen exiting


class EngineExecutor(BaseExecutor):
    """execute(batch) -> StepOutput(tokens, duration_s): measured time of input prep + forward + sampling.

    Block tables come from the replica's KVCacheManager (the scheduler allocated them before the step).
    """

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, clock: str = "wall",
                 proposer: Proposer | None = None, host_pool: HostKVPool | None = None) -> None:
        self.clock = check_choice(clock, "engine_clock", STOPWATCHES)
        self.proposer = proposer  # speculative decoding: fills in the drafts the scheduler budgeted
        self.stopwatch = STOPWATCHES[clock]  # the loop adds schedule() time read on the same stopwatch
        if kv_manager.block_size != runner.block_size:
            raise ValueError(f"KV manager block_size={kv_manager.block_size} != runner block_size="
                             f"{runner.block_size}")
        if kv_manager.num_blocks > runner.kv_caches[0].k.shape[0]:
            raise ValueError(f"KV manager has {kv_manager.num_blocks} blocks, the KV cache tensors only "
                             f"{runner.kv_caches[0].k.shape[0]}")
        self.runner, self.kv_manager = runner, kv_manager
        self.host_pool = host_pool  # host KV tier tensors (None: no host tier)
        self.copy_s = 0.0  # measured time of the steps' block copies (part of their step durations)
        self.copied_blocks = 0

    def execute(self, batch: Batch) -> StepOutput:
        _sync(self.runner.device)
        t0 = self.stopwatch()
        if batch.copies:
            self._copy(batch)
        if batch.features.num_draft_tokens:
            if self.proposer is None:
                raise RuntimeError("the batch verifies draft tokens but the engine has no draft proposer (spec.method)")
            drafts = self.proposer.propose([ch for ch in batch.chunks if ch.num_draft_tokens], self._sequence)
            tokens, counts = self._run(self.runner.speculate, batch, self.kv_manager.block_table, drafts)
        else:
            tokens, counts = self._run(self.runner.execute, batch, self.kv_manager.block_table), None
        _sync(self.runner.device)
        return StepOutput(tokens, self.stopwatch() - t0, counts)

    def _run(self, step, *args):
        """A tensor-parallel step whose collective failed because a rank died raises naming that rank."""
        try:
            return step(*args)
        except RuntimeError:
            if self.runner.workers is not None:
                self.runner.workers.check(wait_s=FAILED_RANK_WAIT_S)
            raise

    def close(self) -> None:
        """End the tensor-parallel ranks (a no-op on one device); the executor cannot step afterwards."""
        if self.runner.workers is not None:
            self.runner.workers.close()

    def _copy(self, batch: Batch) -> None:
        """The step's host-tier block copies, before its forward pass; their time counts in the step and is also
        kept apart (``copy_s``)."""
        if self.host_pool is None:
            raise RuntimeError("the batch copies KV blocks to or from a host tier but the engine has no host pool")
        t0 = self.stopwatch()
        self.host_pool.apply(batch.copies)
        _sync(self.runner.device)
        self.copy_s += self.stopwatch() - t0
        self.copied_blocks += len(batch.copies)

    def _sequence(self, chunk: Chunk) -> list[int]:
        """A request's prompt + outputs so far (what a proposer drafts from)."""
        return self.runner.tokens_of(chunk.state)

    def warmup(self, steps: int = 2, cuda_graphs: bool = False, prompt_len: int = 32) -> None:
        """Untimed prefill + decode passes (allocator, kernel and thread-pool warm-up) before a measured run, then
        (``cuda_graphs``, on CUDA with the triton kernels) the decode graphs' capture. The passes: one
        request's whole prompt, then its decodes. Its blocks come from a scratch KV manager over the first blocks of
        the KV tensors (they hold nothing yet), admitted as a replica admits (core.shapes.admit_chunk); the replica's
        KV manager is not touched, so no block stays held there and its free list keeps its order."""
        from core.kv_cache import KVCacheManager
        from core.request import Request, RequestState
        from core.shapes import admit_chunk
        from policies.eviction.lru import LRUEviction

        bs = self.runner.block_size
        n = min(prompt_len, self.runner.spec.max_model_len - steps - 1, self.kv_manager.num_blocks * bs - steps - 1)
        if steps <= 0 or n < 1:
            return
        kv = KVCacheManager(self.kv_manager.blocks_for(n + steps), bs, LRUEviction(), enable_prefix_caching=False)
        state = RequestState(Request("__warmup__", 0.0, n, steps, prompt_token_ids=tuple(range(n))))
        computed = 0
        for _ in range(steps):
            chunk = admit_chunk(kv, state, computed, state.num_tokens - computed)
            state.output_token_ids.extend(self.runner.execute(Batch([chunk]), kv.block_table))
            computed = chunk.end
        self.release(state.id)
        self.runner.warmup_kernels()
        if cuda_graphs and self.runner.can_capture_graphs:
            self.runner.capture_graphs()

    def release(self, request_id: str) -> None:
        """Call when a request reaches a terminal status (drops its cached prompt tokens, its draft state)."""
        self.runner.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)


def build_engine_executors(spec: ModelSpec, options: EngineOptions, quant: QuantSpec,
                           kv_managers: list[KVCacheManager], seed: int = 0,
                           clock: str = "wall", tp: int = 1, ep: int = 1) -> list[EngineExecutor]:
    """One executor per replica; the replicas share one model. ``quant``: W4A16 weights (weight_bits 4) and int8 KV
    (kv_bits 8), checked by ``EngineOptions.check_quant``, and against the model by ``check_group_size``. ``tp`` /
    ``ep`` (``parallel``): one replica over tp ranks (build_engine_executor)."""
    options.check_quant(quant)
    check_group_size(spec, quant.weight_bits, quant.group_size, tp, max(1, tp // ep))
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    kernels, sampling = resolve_kernels(options.kernels, options.device), options.sampling
    model, executors, workers = None, [], None
    for i, kv in enumerate(kv_managers):
        ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels, device=options.device,
                                   dtype=options.torch_dtype, quant="w4a16" if quant.weight_bits == 4 else None,
                                   group_size=quant.group_size, kv_dtype="int8" if quant.kv_bits == 8 else "auto",
                                   seed=seed, sampling=sampling, model=model, clock=clock,
                                   host_blocks=kv.host.num_blocks if kv.host is not None else 0,
                                   cpu_gemm=options.cpu_gemm, greedy_screen=options.greedy_screen, tp=tp, ep=ep,
                                   num_threads=options.num_threads, workers=workers, replica=i,
                                   replica_blocks=[k.num_blocks for k in kv_managers])
        model, workers = ex.runner.model, ex.runner.workers
        ex.warmup(options.warmup_steps, options.cuda_graphs)
        executors.append(ex)
    return executors


def build_engine_executor(spec: ModelSpec, *, kv_manager: KVCacheManager, kernels: str = "auto",
                          device: str = "cpu", dtype: torch.dtype | None = None, quant: str | None = None,
                          group_size: int = 128, kv_dtype: str = "auto", seed: int = 0,
                          sampling: SamplingParams | None = None, model: LlamaForCausalLM | None = None,
                          clock: str = "wall", host_blocks: int = 0, cpu_gemm: str = "auto",
                          greedy_screen: bool = True, tp: int = 1, ep: int = 1,
                          num_threads: int | None = None, workers: Workers | None = None, replica: int = 0,
                          replica_blocks: list[int] | None = None) -> EngineExecutor:
    """One replica's executor, with KV tensors for the manager's pool (and a host pool of ``host_blocks`` blocks
    for the manager's host tier, if it has one). Pass ``model`` to share one set of weights
    between replicas (each executor gets its own KV cache tensors); otherwise the model is loaded from
    ``spec.path`` or random-initialised from ``seed``. ``cpu_gemm``: kernels.cpu_gemm.CPU_GEMMS; ``greedy_screen``:
    LlamaForCausalLM.use_greedy_screen. ``tp`` > 1: this process is rank 0 of ``tp`` tensor-parallel ranks
    (``ep``: the experts' parallel degree), the others started here (engine.workers; ``close`` ends them) with
    a runner for each of ``replica_blocks`` (the KV pools of the replicas), or given as ``workers`` with this
    executor's ``replica`` and the shared (sharded) ``model``."""
    args = RunnerArgs(spec, kv_manager.num_blocks, kv_manager.block_size, kernels, device, dtype, quant, group_size,
                      kv_dtype, seed, sampling, cpu_gemm, greedy_screen, num_threads, tp, ep)
    if tp > 1 and host_blocks:
        raise ValueError(f"parallel.tp={tp} with a host KV tier (kv.host): the ranks' host copies are not built")
    if tp > 1 and workers is None:
        workers = Workers(args, replica_blocks)
    try:
        runner = build_runner(args, 0, model)
        if workers is not None:
            workers.join()
            runner.workers, runner.replica = workers, replica
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    caches = runner.kv_caches
    return EngineExecutor(runner, kv_manager, clock, host_pool=HostKVPool(caches, host_blocks) if host_blocks else None)


def build_draft_proposer(draft: ModelSpec, target: ModelRunner, num_blocks: int, *, dtype: torch.dtype | None = None,
                         seed: int = 0, model: LlamaForCausalLM | None = None) -> DraftModelProposer:
    """A draft-model proposer beside ``target``: the draft model (loaded from ``draft.path`` or random from
    ``seed``), a KV pool of ``num_blocks`` blocks of the target's block size, and a greedy runner on the target's
    device and kernels that materialises prompts exactly as the target does."""
    from core.kv_cache import KVCacheManager
    from policies.eviction.lru import LRUEviction

    if draft.vocab_size != target.spec.vocab_size:
        raise ValueError(f"draft model vocabulary {draft.vocab_size} != the target's {target.spec.vocab_size}")
    device, bs = target.device, target.block_size
    if model is None:
        model = build_model(draft, seed=seed, dtype=dtype, device=device)
    caches = allocate_kv_caches(draft, num_blocks, bs, model.dtype, model.device)
    runner = ModelRunner(model, draft, target.kernels, caches, bs, device, Sampler(device=device), target.seed)
    return DraftModelProposer(runner, KVCacheManager(num_blocks, bs, LRUEviction(), enable_prefix_caching=False))
