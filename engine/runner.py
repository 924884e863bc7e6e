"""Turns a core.Batch into one flattened varlen forward step and samples one token per sampling chunk.

Inputs are built with a fixed number of array ops per step (Python only touches chunks and block lists,
never single tokens), so input preparation stays a small share of the step even for tiny models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from core.batch import Batch
from core.prompt import materialize
from core.request import RequestState, SamplingParams
from core.specs import ModelSpec
from engine.attention import AttentionMetadata, KVCache, allocate_kv_caches
from engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs
from engine.loader import build_model
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler
from engine.tp import local_kv_heads, shard_model
from kernels.attention import DecodeCache, paged_attention_torch, plan_attention
from kernels.cpu_native import paged_attention_native
from kernels.ops import KernelSet, get_kernels

PROMPT_CACHE_PRUNE_MIN = 1024  # prompt-cache size at which finished requests are swept out


@dataclass(frozen=True, slots=True)
class HostInputs:
    """A step's inputs as host arrays: what rank 0 broadcasts to the other tensor-parallel ranks each step."""

    ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    qsl: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S]
    tables: np.ndarray  # int32 [S, max_blocks]
    rows: np.ndarray  # int64 [n]: the sampled rows
    max_query_len: int
    max_seq_len: int
    decodes: tuple[str, ...]  # the ids of the requests this step decodes (the CPU decode cache's owners)


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # int64 [n]: last token of each sampling chunk
    # the request of each logits row when one of them carries its own sampling params; None: all use the default
    sample_states: list[RequestState] | None = None
    # speculative decoding: per sampling chunk, its draft tokens ([] for a plain one); None: no drafts this step.
    # A chunk with d drafts has d + 1 consecutive logits rows.
    drafts: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What a forward step leaves for sampling: the sampled rows' final hidden states, or (a CUDA graph replay)
    their logits."""

    hidden: torch.Tensor | None = None  # [n, hidden]
    logits: torch.Tensor | None = None  # [n, vocab]


class ModelRunner:
    """Runs batches on one model with one set of KV caches (one replica)."""

    def __init__(self, model: LlamaForCausalLM, spec: ModelSpec, kernels: KernelSet | str, kv_caches: list[KVCache],
                 block_size: int, device: torch.device | str, sampler: Sampler | None = None,
                 seed: int = 0) -> None:
        """``seed`` is the content seed for prompts made from hash ids / lengths (core.prompt.materialize)."""
        if len(kv_caches) != spec.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, model has {spec.num_layers}")
        if kv_caches[0].k.shape[1] != block_size:
            raise ValueError(f"block_size={block_size} but the KV cache blocks hold {kv_caches[0].k.shape[1]} tokens")
        self.model, self.spec, self.kv_caches = model, spec, kv_caches
        self.kernels = get_kernels(kernels) if isinstance(kernels, str) else kernels
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler or Sampler(seed=seed, device=self.device)
        self.seed = seed
        self.max_positions = model.cos_sin.shape[0]
        # torch attention: one plan per step for all layers; on CPU, decodes also keep their K/V between steps.
        # The native backend's decodes read an fp32 paged cache in C: then only steps with a prefill chunk are
        # planned (with an int8 or 16-bit cache it runs the torch path, decodes included).
        k = kv_caches[0].k
        native = self.kernels.attention is paged_attention_native
        self._plan_attention = native or self.kernels.attention is paged_attention_torch
        self._plan_decodes = not (native and k.dtype == torch.float32 and k.device.type == "cpu")
        self._decode_cache = DecodeCache(2 * k.shape[2] * k.shape[3] * 4) \
            if self._plan_attention and self._plan_decodes and self.device.type == "cpu" else None
        self._prompts: dict[str, tuple[RequestState, list[int]]] = {}
        self._prune_at = PROMPT_CACHE_PRUNE_MIN
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode-only steps (capture_graphs)
        self.workers = None  # tensor parallelism: rank 0's engine.workers.Workers, which get every step's inputs
        self.replica = 0  # which of the workers' replicas this runner is

    @property
    def can_capture_graphs(self) -> bool:
        # an MoE layer sizes its expert GEMMs from the step's routing on the host: no fixed graph to replay
        return self.device.type == "cuda" and not self._plan_attention and self.spec.moe is None \
            and self.model.tp is None

    def capture_graphs(self, max_batch: int = BATCH_BUCKETS[-1]) -> None:
        """Capture the decode-only forward pass per batch-size bucket (engine.cuda_graphs); CUDA + Triton only."""
        if not self.can_capture_graphs:
            raise ValueError("CUDA graphs need a CUDA device, the triton kernels and a dense (not MoE) model")
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.kernels, self.block_size, max_batch)
        self.graphs.capture()

    def release(self, request_id: str) -> None:
        """Forget a finished request's materialised prompt (and its own sampling generator, if it had one)."""
        self._prompts.pop(request_id, None)
        self.sampler.release(request_id)

    def tokens_of(self, state: RequestState) -> list[int]:
        """The request's prompt (materialised as the model sees it) + its outputs so far."""
        return self._prompt(state) + state.output_token_ids

    def _prompt(self, state: RequestState) -> list[int]:
        entry = self._prompts.get(state.id)
        if entry is not None and entry[0] is state:
            return entry[1]
        prompt = materialize(state.request, self.spec.vocab_size, self.seed)
        if max(prompt) >= self.spec.vocab_size or min(prompt) < 0:
            raise ValueError(f"request {state.id}: prompt token ids must be in [0, {self.spec.vocab_size})")
        if len(self._prompts) >= self._prune_at:  # safety net for drivers that never call release()
            for rid in [k for k, e in self._prompts.items() if e[0].status.terminal]:
                del self._prompts[rid]
            self._prune_at = max(PROMPT_CACHE_PRUNE_MIN, 2 * len(self._prompts))
        self._prompts[state.id] = (state, prompt)
        return prompt

    def host_inputs(self, batch: Batch, block_table: Callable[[str], list[int]],
                    drafts: Mapping[str, list[int]] | None = None
                    ) -> tuple[HostInputs, list[RequestState] | None, list[list[int]] | None]:
        """Flatten ``batch``: token ids, positions, slot mapping, query offsets, context lengths, block tables, as
        host arrays; with the states of the sampled rows when one brings its own sampling or drafts, and the drafts.
        ``drafts``: the draft tokens of each chunk with ``num_draft_tokens`` (by request id), fed after its token."""
        bs, prompts = self.block_size, self._prompts
        ids: list[int] = []
        flat_blocks: list[int] = []
        starts, lens, num_blocks, logits_rows = [], [], [], []
        offset, own_sampling = 0, False
        sample_drafts: list[list[int]] | None = None
        for ch in batch.chunks:
            state, s, e = ch.state, ch.start, ch.end
            rid = state.id
            entry = prompts.get(rid)
            prompt = entry[1] if entry is not None and entry[0] is state else self._prompt(state)
            n_prompt = len(prompt)
            if e <= n_prompt:
                ids += prompt[s:e]
            elif s >= n_prompt:
                ids += state.output_token_ids[s - n_prompt:e - n_prompt]
            else:
                ids += prompt[s:]
                ids += state.output_token_ids[:e - n_prompt]
            d = ch.num_draft_tokens
            if d:
                draft = drafts[rid] if drafts is not None and rid in drafts else []
                if len(draft) != d:
                    raise ValueError(f"request {rid}: chunk verifies {d} drafts, the proposer gave {len(draft)}")
                ids += draft
                e += d
                if sample_drafts is None:
                    sample_drafts = [[] for _ in logits_rows]
            nb = -(-e // bs)
            table = block_table(rid)
            if len(table) < nb:
                raise ValueError(f"request {rid}: {e} tokens need {nb} blocks, its block table has {len(table)}")
            flat_blocks += table[:nb]
            starts.append(s)
            lens.append(e - s)
            num_blocks.append(nb)
            offset += e - s
            if ch.samples:
                logits_rows.extend(range(offset - 1 - d, offset))
                if sample_drafts is not None:
                    sample_drafts.append(draft if d else [])
                if state.request.sampling is not None:
                    own_sampling = True
        if len(ids) != offset:
            raise ValueError(f"batch asks for {offset} tokens but requests only have {len(ids)} (chunk past the end)")
        max_seq_len = max(map(int.__add__, starts, lens))
        if max_seq_len > self.max_positions:
            rid = next(ch.state.id for ch in batch.chunks if ch.end == max_seq_len)
            raise ValueError(f"request {rid}: position {max_seq_len - 1} is beyond max_model_len {self.max_positions}")

        # one list -> array conversion per step; numpy, not torch: its per-op cost is far lower on tiny arrays
        S, R, B = len(lens), len(logits_rows), len(flat_blocks)
        flat = np.array(starts + lens + num_blocks + logits_rows + flat_blocks + ids, dtype=np.int64)
        starts_a, lens_a, nb_a = flat[:S], flat[S:2 * S], flat[2 * S:3 * S]
        rows_a, blocks_a, ids_a = flat[3 * S:3 * S + R], flat[3 * S + R:3 * S + R + B], flat[3 * S + R + B:]
        qsl = np.zeros(S + 1, dtype=np.int32)
        np.cumsum(lens_a, out=qsl[1:])
        seq_of_token = np.repeat(np.arange(S), lens_a)
        positions = np.arange(offset) + (starts_a - qsl[:-1])[seq_of_token]
        tables = np.zeros((S, max(num_blocks)), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < nb_a[:, None]] = blocks_a
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        host = HostInputs(ids_a, positions, slots, qsl, (starts_a + lens_a).astype(np.int32), tables, rows_a,
                          max(lens), max_seq_len, tuple(ch.state.id for ch in batch.chunks if ch.num_positions == 1))
        sample_states = [ch.state for ch in batch.chunks if ch.samples] if own_sampling or sample_drafts else None
        return host, sample_states, sample_drafts

    def prepare(self, batch: Batch, block_table: Callable[[str], list[int]],
                drafts: Mapping[str, list[int]] | None = None) -> StepInputs:
        """Flatten ``batch`` (``host_inputs``), send that to the other tensor-parallel ranks if there are any, and
        put it on the device (``device_inputs``)."""
        host, sample_states, sample_drafts = self.host_inputs(batch, block_table, drafts)
        if self.workers is not None:
            self.workers.broadcast(self.replica, host)
        return self.device_inputs(host, sample_states, sample_drafts)

    def device_inputs(self, host: HostInputs, sample_states: list[RequestState] | None = None,
                      drafts: list[list[int]] | None = None) -> StepInputs:
        """The step's tensors on the model's device and its attention plan (every tensor-parallel rank runs this
        on the inputs rank 0 broadcast: each rank has its own decode cache)."""
        dev = self.device
        to_dev = torch.from_numpy if dev.type == "cpu" else lambda a: torch.from_numpy(a).to(dev, non_blocking=True)
        if self._decode_cache is not None:
            self._decode_cache.claim(host.decodes)
        plan = plan_attention(host.tables, host.seq_lens, host.qsl, self.block_size, self._decode_cache, dev) \
            if self._plan_attention and (self._plan_decodes or host.max_query_len > 1) else None
        meta = AttentionMetadata(to_dev(host.slots), to_dev(host.qsl), to_dev(host.seq_lens), to_dev(host.tables),
                                 host.max_query_len, host.max_seq_len, plan)
        return StepInputs(to_dev(host.ids), to_dev(host.positions), meta, to_dev(host.rows), sample_states, drafts)

    @torch.inference_mode()
    def warmup_kernels(self) -> None:
        """Compile (and autotune) every Triton variant a run can launch, on scratch inputs, so no compile time lands
        in a timed step: attention decode-only and mixed, each with and without split-K; W4A16 at each M tile of
        every projection shape. Reads KV cache blocks (whatever they hold); writes nothing shared. On CPU: pack the
        fp32 GEMMs' weight copies (kernels.cpu_gemm) and build the native GEMM."""
        if self.device.type == "cpu":
            self.model.pack_cpu_weights()
            return
        if self.device.type != "cuda" or self._plan_attention:
            return
        from kernels.w4a16 import WARMUP_M

        # autotune times the first call of each variant: a realistic decode batch (32 x 1k context) and a mixed
        # step (a 256-token chunk next to 31 decodes), over garbage-filled (never written) cache blocks
        dev, cache, i32 = self.device, self.kv_caches[0], torch.int32
        seqs, ctx, chunk = 32, min(1024, self.max_positions), min(256, self.max_positions)
        per_seq = -(-ctx // self.block_size)
        tables = (torch.arange(seqs * per_seq, dtype=i32, device=dev) % cache.k.shape[0]).view(seqs, per_seq)
        lens = torch.full((seqs,), ctx, dtype=i32, device=dev)
        heads = self.model.model.layers[0].self_attn.num_heads  # this rank's (tensor parallelism)
        q = torch.zeros(chunk + seqs, heads, self.spec.head_dim, dtype=self.model.dtype, device=dev)
        for max_q in (1, chunk):
            qsl = torch.arange(seqs + 1, dtype=i32, device=dev) + (max_q - 1) * (torch.arange(seqs + 1) > 0).to(dev)
            for splits in (1, 2):
                self.kernels.attention(q[:seqs + max_q - 1], cache.k, cache.v, tables, lens, qsl.to(i32), 1.0,
                                       cache.k_scale, cache.v_scale, max_query_len=max_q, max_seq_len=ctx,
                                       num_splits=splits)
        shapes = {(m.qweight.shape, m.qweight.group_size, m.qweight.zeros is None): m
                  for m in self.model.modules() if getattr(m, "qweight", None) is not None}
        for m in shapes.values():
            for rows in WARMUP_M:
                m(torch.zeros(rows, m.qweight.shape[1], dtype=self.model.dtype, device=dev), self.kernels)
        torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def execute(self, batch: Batch, block_table: Callable[[str], list[int]]) -> list[int]:
        """One forward step; returns one token per chunk with ``samples`` set, in batch order."""
        out, inputs = self._forward(batch, block_table, None)
        return [] if out is None else self._sample(out, inputs).tolist()

    @torch.inference_mode()
    def speculate(self, batch: Batch, block_table: Callable[[str], list[int]],
                  drafts: Mapping[str, list[int]]) -> tuple[list[int], list[int]]:
        """One forward step that also verifies draft tokens (``drafts`` by request id, see ``prepare``): the tokens
        of the chunks with ``samples`` set, flattened in batch order, and how many each yields (1 to 1 + d;
        ``Sampler.verify``)."""
        out, inputs = self._forward(batch, block_table, drafts)
        if out is None:
            return [], []
        if inputs.drafts is None:  # no chunk carried drafts
            tokens = self._sample(out, inputs).tolist()
            return tokens, [1] * len(tokens)
        return self._verify(self._logits(out), inputs)

    def _forward(self, batch: Batch, block_table: Callable[[str], list[int]],
                 drafts: Mapping[str, list[int]] | None) -> tuple[ForwardOutput | None, StepInputs | None]:
        """The step's final hidden states of the sampled rows (logits, from a CUDA graph), or None: nothing
        samples."""
        if batch.empty:
            return None, None
        inputs = self.prepare(batch, block_table, drafts)
        f, graphs = batch.features, self.graphs
        if graphs is not None and f.num_decode_seqs == f.num_batched_tokens == f.num_seqs \
                and graphs.fits(f.num_seqs, inputs.meta.block_tables.shape[1]):
            return ForwardOutput(logits=graphs.run(inputs.input_ids, inputs.positions, inputs.meta)), inputs
        hidden = self.forward_inputs(inputs)
        if inputs.logits_rows.numel() == 0:
            return None, inputs
        return ForwardOutput(hidden=hidden), inputs

    def forward_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """The model's forward pass over prepared inputs -> the sampled rows' final hidden states."""
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, self.kernels,
                          rows=inputs.logits_rows)

    @torch.inference_mode()
    def follow(self, host: HostInputs) -> None:
        """A tensor-parallel worker's step: rank 0's inputs through this rank's shard, the same collectives as
        rank 0 (the layers' all-reduces, the logits' gather when rows sample; rank 0 samples)."""
        inputs = self.device_inputs(host)
        hidden = self.forward_inputs(inputs)
        if inputs.logits_rows.numel():
            self.model.compute_logits(hidden)

    def _logits(self, out: ForwardOutput) -> torch.Tensor:
        return out.logits if out.logits is not None else self.model.compute_logits(out.hidden)

    def _sample(self, out: ForwardOutput, inputs: StepInputs) -> torch.Tensor:
        """One token per sampled row. When every row is greedy the model may take them without the full logits
        (LlamaForCausalLM.greedy_tokens: the same tokens)."""
        if out.hidden is not None and self.sampler.all_greedy(inputs.sample_states):
            tokens = self.model.greedy_tokens(out.hidden)
            if tokens is not None:
                return tokens
        return self.sampler(self._logits(out), inputs.sample_states)

    def _verify(self, logits: torch.Tensor, inputs: StepInputs) -> tuple[list[int], list[int]]:
        """Tokens of a step with drafts: plain rows sampled together, each speculative decode verified."""
        states, drafts = inputs.sample_states, inputs.drafts
        plain, row = [], 0
        for draft in drafts:
            if not draft:
                plain.append(row)
            row += 1 + len(draft)
        sampled = iter(self.sampler(logits[plain], [states[i] for i, d in enumerate(drafts) if not d]).tolist()
                       if plain else [])
        tokens, counts, row = [], [], 0
        for state, draft in zip(states, drafts, strict=True):
            out = self.sampler.verify(logits[row:row + 1 + len(draft)], draft, state) if draft else [next(sampled)]
            tokens += out
            counts.append(len(out))
            row += 1 + len(draft)
        return tokens, counts


@dataclass(frozen=True)
class RunnerArgs:
    """How to build one replica's runner: picklable, so each tensor-parallel rank's process builds its own shard.
    ``quant``: "w4a16" or None; ``kv_dtype``: engine.attention.KV_DTYPES; ``cpu_gemm``: kernels.cpu_gemm.CPU_GEMMS;
    ``greedy_screen``: LlamaForCausalLM.use_greedy_screen; ``tp`` / ``ep``: engine.tp."""

    spec: ModelSpec
    num_blocks: int
    block_size: int
    kernels: str = "auto"
    device: str = "cpu"
    dtype: torch.dtype | None = None
    quant: str | None = None
    group_size: int = 128
    kv_dtype: str = "auto"
    seed: int = 0
    sampling: SamplingParams | None = None
    cpu_gemm: str = "auto"
    greedy_screen: bool = True
    num_threads: int | None = None
    tp: int = 1
    ep: int = 1

    def rank_device(self, rank: int) -> str:
        """Rank r of a CUDA run takes the r-th GPU from the configured one; CPU ranks share the CPU."""
        if not self.device.startswith("cuda"):
            return self.device
        return f"cuda:{(torch.device(self.device).index or 0) + rank}"


def resolve_kernels(name: str, device: str | torch.device) -> str:
    """``auto``: the Triton kernels on a GPU, the native CPU ops (torch references elsewhere) on CPU; other names
    pass through."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "native"
    return name


def build_runner(args: RunnerArgs, rank: int = 0, model: LlamaForCausalLM | None = None) -> ModelRunner:
    """Rank ``rank``'s runner: the model (``model``, shared; or loaded from ``spec.path`` or seeded, then cut to
    this rank's shard and quantised), KV tensors of ``num_blocks`` blocks for its KV heads, a sampler."""
    spec, device = args.spec, args.rank_device(rank)
    dtype = args.dtype
    if dtype is None and model is None and device.startswith("cuda") and spec.dtype == "float32":
        dtype = torch.bfloat16  # fp32 on a GPU runs ieee dots without tensor cores: bf16 unless asked for
    if model is None:
        sharded = args.tp > 1
        model = build_model(spec, seed=args.seed, dtype=dtype, device=device, quant=None if sharded else args.quant,
                            group_size=args.group_size)
        if sharded:
            shard_model(model, rank, args.tp, args.ep)
            if args.quant == "w4a16":
                widths = (spec.num_heads * spec.head_dim // args.tp, spec.intermediate_size // args.tp)
                if any(w % args.group_size for w in widths):
                    raise ValueError(f"quant.group_size={args.group_size} must divide each rank's linear input "
                                     f"widths {widths} (attention, FFN) at parallel.tp={args.tp}")
                model.quantize(args.group_size)
    model.use_cpu_gemm(args.cpu_gemm)
    model.use_greedy_screen(args.greedy_screen)
    caches = allocate_kv_caches(spec, args.num_blocks, args.block_size, model.dtype, model.device, args.kv_dtype,
                                local_kv_heads(spec.num_kv_heads, args.tp))
    sampler = Sampler(args.sampling, seed=args.seed, device=model.device)
    return ModelRunner(model, spec, get_kernels(resolve_kernels(args.kernels, device)), caches, args.block_size,
                       model.device, sampler, args.seed)
