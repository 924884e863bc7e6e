"""Tensor and expert parallelism inside one model: what a rank holds and the collectives its forward pass calls.

``shard_model`` cuts a whole model (loaded or seeded on every rank alike) down to rank r's share of tp ranks, as
Megatron-LM and vLLM split a Llama: column-parallel q/k/v (the rank's query heads and their KV heads; a KV head
replicated on tp / num_kv_heads ranks when tp > num_kv_heads) and gate/up (a slice of the FFN width),
row-parallel o_proj and down_proj whose partial sums are all-reduced, the embedding and the LM head split by
vocabulary (an embedding row outside the rank's slice is zero before the all-reduce; the logits slices are
gathered, rank 0 samples). MoE experts are split by their FFN width (tp) or, with ``ep``, the experts themselves
over ep groups of tp / ep ranks each (each group's experts split by width over its ranks): every rank has every
token (the hidden state is replicated after each all-reduce), runs its experts on the pairs routed to them and the
layer's all-reduce sums the experts' outputs, so dispatch is the all-reduce the dense layer has anyway. The router
and the norms are replicated. The processes and the step broadcast are ``engine.workers``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.layers import Linear, linear_weight
from engine.model import LlamaForCausalLM
from engine.moe import Experts, SparseMoE
from kernels.cpu_gemm import CpuLinear


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` (the default torch.distributed group) holding vocabulary rows
    [vocab_start, vocab_start + vocab_shard) of a ``vocab_size`` vocabulary (the last rank's slice zero-padded)."""

    rank: int
    size: int
    vocab_size: int

    @property
    def vocab_shard(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this rank's rows, zeros for ids outside its slice, summed over the ranks."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(h.masked_fill_(outside[:, None], 0))

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, vocab_shard] on each rank -> [n, vocab_size] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def local_kv_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one of tp ranks holds (one, replicated, when tp > num_kv_heads)."""
    return max(1, num_kv_heads // tp)


def _span(first: int, n: int, width: int, base: int = 0) -> torch.Tensor:
    """Indices of ``n`` consecutive ``width``-wide blocks from block ``first``, offset by ``base``."""
    return torch.arange(base + first * width, base + (first + n) * width)


def _linear(weight: torch.Tensor, like: torch.Tensor, *stack: int) -> torch.nn.Parameter:
    """``weight`` [*stack, out, in] as a new parameter in the engine's layout (engine.layers.linear_weight)."""
    p = linear_weight(*weight.shape[-2:], like.dtype, like.device, *stack)
    p.data.copy_(weight)
    return p


def _keep(lin: Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    """Keep output features ``rows`` (column-parallel) or input features ``cols`` (row-parallel) of ``lin``."""
    w = lin.weight.data
    w = w[rows] if rows is not None else w[:, cols]
    lin.weight = _linear(w, w)
    if lin.bias is not None and rows is not None:
        lin.bias = torch.nn.Parameter(lin.bias.data[rows].clone(), requires_grad=False)
    lin.matmul = CpuLinear(lin.matmul.native_only)  # drop packed copies of the whole weight


def _vocab_rows(weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] table, zero-padded to vocab_shard rows."""
    out = weight.new_zeros(tp.vocab_shard, weight.shape[1])
    rows = weight[tp.vocab_start:tp.vocab_start + tp.vocab_shard]
    out[:rows.shape[0]] = rows
    return out


def _shard_experts(experts: Experts, rank: int, tp: int, ep: int) -> None:
    """Rank ``rank``'s experts: group rank // (tp / ep) of ep holds num_experts / ep experts, split by FFN width
    over the group's tp / ep ranks."""
    per_group = tp // ep
    group, sub = divmod(rank, per_group)
    n = experts.num_experts // ep
    first = group * n
    width = experts.gate_up_proj.shape[1] // 2
    f = width // per_group
    cols = _span(sub, 1, f)
    gate_up = experts.gate_up_proj.data[first:first + n][:, torch.cat([cols, cols + width])]
    down = experts.down_proj.data[first:first + n][:, :, cols]
    experts.gate_up_proj, experts.down_proj = _linear(gate_up, gate_up, n), _linear(down, down, n)
    experts.first = first
    experts.matmuls = experts._matmuls(experts.matmuls[0][0].native_only)


def check_shardable(model: LlamaForCausalLM, tp: int, ep: int) -> None:
    """The widths tp (and ep) must divide, named by their config keys."""
    spec = model.spec
    if spec.num_heads % tp or (spec.num_kv_heads % tp and tp % spec.num_kv_heads):
        raise ValueError(f"parallel.tp={tp} must divide model.num_heads={spec.num_heads} and divide or be a "
                         f"multiple of model.num_kv_heads={spec.num_kv_heads}")
    if spec.intermediate_size % tp:
        raise ValueError(f"parallel.tp={tp} must divide model.intermediate_size={spec.intermediate_size}")
    if spec.moe is not None and (tp % ep or spec.moe.num_experts % ep or spec.moe.intermediate_size % (tp // ep)):
        raise ValueError(f"parallel.ep={ep} must divide parallel.tp={tp} and the model's {spec.moe.num_experts} "
                         f"experts, and tp / ep the experts' width {spec.moe.intermediate_size}")
    if spec.moe is None and ep > 1:
        raise ValueError(f"parallel.ep={ep}: model {spec.name} has no experts")


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, rank: int, tp: int, ep: int = 1) -> LlamaForCausalLM:
    """Cut ``model`` (all its weights, 16-bit) down to rank ``rank``'s share of ``tp`` ranks (module docstring);
    its forward pass then calls the collectives of the default process group."""
    check_shardable(model, tp, ep)
    spec = model.spec
    par = TensorParallel(rank, tp, spec.vocab_size)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    h, hkv = H // tp, local_kv_heads(Hkv, tp)
    q0, kv0 = rank * h, rank * Hkv // tp
    q = _span(q0, h, D)
    qkv = torch.cat([q, _span(kv0, hkv, D, H * D), _span(kv0, hkv, D, (H + Hkv) * D)])
    for layer in model.model.layers:
        attn = layer.self_attn
        _keep(attn.qkv_proj, rows=qkv)
        _keep(attn.o_proj, cols=q)
        attn.num_heads, attn.num_kv_heads, attn.split = h, hkv, (h * D, hkv * D, hkv * D)
        layer.reduce = par.all_reduce
        if isinstance(layer.mlp, SparseMoE):
            _shard_experts(layer.mlp.experts, rank, tp, ep)
        else:
            width = spec.intermediate_size
            f = _span(rank, 1, width // tp)
            _keep(layer.mlp.gate_up_proj, rows=torch.cat([f, f + width]))
            _keep(layer.mlp.down_proj, cols=f)
    emb = model.model.embed_tokens
    emb.weight = torch.nn.Parameter(_vocab_rows(emb.weight.data, par), requires_grad=False)
    if model.lm_head is not None:
        model.lm_head.weight = _linear(_vocab_rows(model.lm_head.weight.data, par), emb.weight)
    model.logits_matmul = CpuLinear(model.logits_matmul.native_only)
    model.tp = par
    model.use_greedy_screen(False)
    return model
