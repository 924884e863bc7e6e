"""The engine's core.interfaces.Executor: runs the model on a batch and reports the measured step time."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from core.batch import Batch, Chunk
from core.checks import check_bool, check_choice, check_float, check_fraction, check_int, check_keys
from core.interfaces import BaseExecutor, StepOutput
from core.specs import ModelSpec
from engine.attention import allocate_kv_caches
from engine.host_pool import HostKVPool
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from engine.runner import ModelRunner
from engine.sampler import Sampler, SamplingParams
from engine.speculative import DraftModelProposer, Proposer
from kernels.cpu_gemm import CPU_GEMMS
from kernels.ops import BACKENDS as KERNEL_BACKENDS
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
            tokens, counts = self.runner.speculate(batch, self.kv_manager.block_table, drafts)
        else:
            tokens, counts = self.runner.execute(batch, self.kv_manager.block_table), None
        _sync(self.runner.device)
        return StepOutput(tokens, self.stopwatch() - t0, counts)

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


def resolve_kernels(name: str, device: str | torch.device) -> str:
    """``auto``: the Triton kernels on a GPU, the native CPU ops (torch references elsewhere) on CPU; other names
    pass through."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "native"
    return name


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_DTYPES = ("auto", "int8")
QUANTS = (None, "w4a16")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's ``backend`` config section (``conf/backend/engine.yaml``), checked on construction: a bad value
    fails naming ``backend.<key>``; ``from_mapping`` also rejects unknown keys. Counts given as whole floats (2.0)
    are read as integers."""

    name: str = "engine"
    kernels: str = "auto"  # auto (triton on cuda, native on cpu) | torch | native | triton
    device: str = "cpu"  # cpu | cuda[:i]
    dtype: str | None = None  # None: the model's dtype (bfloat16 for an fp32 model on cuda)
    quant: str | None = None  # None | w4a16
    quant_group_size: int = 128  # W4A16 group (must divide the linear layers' input widths)
    kv_dtype: str = "auto"  # auto (the model dtype) | int8
    cpu_gemm: str = "auto"  # fp32 CPU GEMMs: auto (the faster kernel per row count) | native (one kernel, one copy)
    greedy_screen: bool = True  # greedy tokens through an int8 screen of the LM head (same tokens; fp32, x86 CPU)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    warmup_steps: int = 2  # untimed forward passes per executor before the run
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (cuda + triton; ignored elsewhere)
    num_threads: int | None = None  # torch CPU threads; None or 0: torch's default
    ignore_eos: bool = True  # read by the replica limits (experiments.build), not by the executor

    def __post_init__(self) -> None:
        def put(key: str, value: Any) -> None:
            object.__setattr__(self, key, value)

        check_choice(self.name, "backend.name", ("engine",))
        check_choice(self.kernels, "backend.kernels", ("auto", *KERNEL_BACKENDS))
        check_choice(self.dtype, "backend.dtype", [*TORCH_DTYPES, None])
        check_choice(self.quant, "backend.quant", QUANTS)
        put("quant_group_size", check_int(self.quant_group_size, "backend.quant_group_size", 1, whole_float=True))
        check_choice(self.kv_dtype, "backend.kv_dtype", KV_DTYPES)
        check_choice(self.cpu_gemm, "backend.cpu_gemm", CPU_GEMMS)
        check_bool(self.greedy_screen, "backend.greedy_screen")
        put("temperature", check_float(self.temperature, "backend.temperature", 0.0))
        put("top_p", check_fraction(self.top_p, "backend.top_p"))
        put("top_k", check_int(self.top_k, "backend.top_k", 0, whole_float=True))
        put("warmup_steps", check_int(self.warmup_steps, "backend.warmup_steps", 0, whole_float=True))
        check_bool(self.cuda_graphs, "backend.cuda_graphs")
        if self.num_threads is not None:
            put("num_threads", check_int(self.num_threads, "backend.num_threads", 0, whole_float=True))
        check_bool(self.ignore_eos, "backend.ignore_eos")

    @classmethod
    def from_mapping(cls, backend: Mapping[str, Any]) -> EngineOptions:
        check_keys("backend", backend, [f.name for f in fields(cls)])
        return cls(**backend)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else TORCH_DTYPES[self.dtype]

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


def build_engine_executors(spec: ModelSpec, options: EngineOptions, kv_managers: list[KVCacheManager],
                           seed: int = 0, clock: str = "wall") -> list[EngineExecutor]:
    """One executor per replica; the replicas share one model."""
    group = options.quant_group_size
    if options.quant and (spec.hidden_size % group or spec.intermediate_size % group
                          or (spec.num_heads * spec.head_dim) % group):
        raise ValueError(f"backend.quant_group_size={group!r} must divide the linear layers' input widths "
                         f"(hidden {spec.hidden_size}, attention {spec.num_heads * spec.head_dim}, "
                         f"FFN {spec.intermediate_size})")
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    kernels, sampling = resolve_kernels(options.kernels, options.device), options.sampling
    model, executors = None, []
    for kv in kv_managers:
        ex = build_engine_executor(spec, kv_manager=kv, kernels=kernels, device=options.device,
                                   dtype=options.torch_dtype, quant=options.quant, group_size=group,
                                   kv_dtype=options.kv_dtype, seed=seed, sampling=sampling, model=model, clock=clock,
                                   host_blocks=kv.host.num_blocks if kv.host is not None else 0,
                                   cpu_gemm=options.cpu_gemm, greedy_screen=options.greedy_screen)
        model = ex.runner.model
        ex.warmup(options.warmup_steps, options.cuda_graphs)
        executors.append(ex)
    return executors


def build_engine_executor(spec: ModelSpec, *, kv_manager: KVCacheManager, kernels: str = "auto",
                          device: str = "cpu", dtype: torch.dtype | None = None, quant: str | None = None,
                          group_size: int = 128, kv_dtype: str = "auto", seed: int = 0,
                          sampling: SamplingParams | None = None, model: LlamaForCausalLM | None = None,
                          clock: str = "wall", host_blocks: int = 0, cpu_gemm: str = "auto",
                          greedy_screen: bool = True) -> EngineExecutor:
    """One replica's executor, with KV tensors for the manager's pool (and a host pool of ``host_blocks`` blocks
    for the manager's host tier, if it has one). Pass ``model`` to share one set of weights
    between replicas (each executor gets its own KV cache tensors); otherwise the model is loaded from
    ``spec.path`` or random-initialised from ``seed``. ``cpu_gemm``: kernels.cpu_gemm.CPU_GEMMS; ``greedy_screen``:
    LlamaForCausalLM.use_greedy_screen."""
    num_blocks, block_size = kv_manager.num_blocks, kv_manager.block_size
    kernel_set = get_kernels(resolve_kernels(kernels, device))
    if dtype is None and model is None and str(device).startswith("cuda") and spec.dtype == "float32":
        dtype = torch.bfloat16  # fp32 on a GPU runs ieee dots without tensor cores: bf16 unless asked for
    if model is None:
        model = build_model(spec, seed=seed, dtype=dtype, device=device, quant=quant, group_size=group_size)
    model.use_cpu_gemm(cpu_gemm)
    model.use_greedy_screen(greedy_screen)
    caches = allocate_kv_caches(spec, num_blocks, block_size, model.dtype, model.device, kv_dtype)
    sampler = Sampler(sampling, seed=seed, device=model.device)
    runner = ModelRunner(model, spec, kernel_set, caches, block_size, model.device, sampler, seed)
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
