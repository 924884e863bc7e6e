"""The engine's core.interfaces.Executor: runs the model on a batch and reports the measured step time."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from core.batch import Batch
from core.interfaces import BaseExecutor, StepOutput
from core.specs import ModelSpec
from engine.attention import allocate_kv_caches
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingParams
from kernels.ops import get_kernels

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


class EngineExecutor(BaseExecutor):
    """execute(batch) -> StepOutput(tokens, duration_s): measured time of input prep + forward + sampling.

    Block tables come from the replica's KVCacheManager (the scheduler allocated them before the step).
    """

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, clock: str = "wall") -> None:
        if clock not in STOPWATCHES:
            raise ValueError(f"engine clock {clock!r}; allowed: {list(STOPWATCHES)}")
        self.clock = clock
        self.stopwatch = STOPWATCHES[clock]  # the loop adds schedule() time read on the same stopwatch
        if kv_manager.block_size != runner.block_size:
            raise ValueError(f"KV manager block_size={kv_manager.block_size} != runner block_size="
                             f"{runner.block_size}")
        if kv_manager.num_blocks > runner.kv_caches[0].k.shape[0]:
            raise ValueError(f"KV manager has {kv_manager.num_blocks} blocks, the KV cache tensors only "
                             f"{runner.kv_caches[0].k.shape[0]}")
        self.runner, self.kv_manager = runner, kv_manager

    def execute(self, batch: Batch) -> StepOutput:
        _sync(self.runner.device)
        t0 = self.stopwatch()
        tokens = self.runner.execute(batch, self.kv_manager.block_table)
        _sync(self.runner.device)
        return StepOutput(tokens, self.stopwatch() - t0)

    def warmup(self, steps: int = 2, prompt_len: int = 32) -> None:
        """Untimed prefill + decode passes (allocator, kernel and thread-pool warm-up) before a measured run: one
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

    def release(self, request_id: str) -> None:
        """Call when a request reaches a terminal status (drops its cached prompt tokens)."""
        self.runner.release(request_id)


def resolve_kernels(name: str, device: str | torch.device) -> str:
    """``auto``: the Triton kernels on a GPU, the torch references on CPU; other names pass through."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    return name


def build_engine_executors(spec: ModelSpec, backend: Mapping[str, Any], kv_managers: list[KVCacheManager],
                           seed: int = 0, clock: str = "wall") -> list[EngineExecutor]:
    """One executor per replica from a ``conf/backend/engine.yaml`` section; the replicas share one model."""
    allowed = {"name", "kernels", "device", "dtype", "quant", "quant_group_size", "kv_dtype", "temperature", "top_p",
               "top_k", "warmup_steps", "num_threads", "ignore_eos"}
    unknown = sorted(set(backend) - allowed)
    if unknown:
        raise ValueError(f"backend: unknown keys {unknown}; allowed: {sorted(allowed)}")
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, None: None}
    if backend.get("dtype") not in dtypes:
        raise ValueError(f"backend.dtype={backend.get('dtype')!r}; allowed: {list(dtypes)}")
    if backend.get("kv_dtype", "auto") not in ("auto", "int8"):
        raise ValueError(f"backend.kv_dtype={backend.get('kv_dtype')!r}; allowed: auto, int8")
    quant = backend.get("quant")
    if quant not in (None, "w4a16"):
        raise ValueError(f"backend.quant={quant!r}; allowed: null, w4a16")
    group = backend.get("quant_group_size", 128)
    if quant and (not isinstance(group, int) or group < 1 or spec.hidden_size % group
                  or spec.intermediate_size % group or (spec.num_heads * spec.head_dim) % group):
        raise ValueError(f"backend.quant_group_size={group!r} must divide the linear layers' input widths "
                         f"(hidden {spec.hidden_size}, attention {spec.num_heads * spec.head_dim}, "
                         f"FFN {spec.intermediate_size})")
    if backend.get("num_threads"):
        torch.set_num_threads(int(backend["num_threads"]))
    sampling = SamplingParams(float(backend.get("temperature", 0.0)), float(backend.get("top_p", 1.0)),
                              int(backend.get("top_k", 0)))
    device = backend.get("device", "cpu")
    kernels = resolve_kernels(backend.get("kernels", "auto"), device)
    model, executors = None, []
    for kv in kv_managers:
        ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels,
                                   device=device, dtype=dtypes[backend.get("dtype")],
                                   quant=backend.get("quant"), group_size=int(backend.get("quant_group_size", 128)),
                                   kv_dtype=backend.get("kv_dtype", "auto"), seed=seed, sampling=sampling, model=model,
                                   clock=clock)
        model = ex.runner.model
        ex.warmup(int(backend.get("warmup_steps", 2)))
        executors.append(ex)
    return executors


def build_engine_executor(spec: ModelSpec, *, kv_manager: KVCacheManager, kernels: str = "torch",
                          device: str = "cpu", dtype: torch.dtype | None = None, quant: str | None = None,
                          group_size: int = 128, kv_dtype: str = "auto", seed: int = 0,
                          sampling: SamplingParams | None = None, model: LlamaForCausalLM | None = None,
                          clock: str = "wall") -> EngineExecutor:
    """One replica's executor, with KV tensors for the manager's pool. Pass ``model`` to share one set of weights
    between replicas (each executor gets its own KV cache tensors); otherwise the model is loaded from
    ``spec.path`` or random-initialised from ``seed``."""
    num_blocks, block_size = kv_manager.num_blocks, kv_manager.block_size
    kernel_set = get_kernels(kernels)
    if model is None:
        model = build_model(spec, seed=seed, dtype=dtype, device=device, quant=quant, group_size=group_size)
    caches = allocate_kv_caches(spec, num_blocks, block_size, model.dtype, model.device, kv_dtype)
    sampler = Sampler(sampling, seed=seed, device=model.device)
    runner = ModelRunner(model, spec, kernel_set, caches, block_size, model.device, sampler, seed)
    return EngineExecutor(runner, kv_manager, clock)
