"""Mixture-of-experts FFN (Mixtral, Qwen3-MoE): a router picks each token's top_k experts, and each expert runs once
per step over the tokens routed to it.

Expert weights are stacked per layer in transformers' fused layout, ``experts.gate_up_proj`` [E, 2F, d] (gate rows
then up rows) and ``experts.down_proj`` [E, d, F]; the loader fills them from that layout or from per-expert
checkpoints. ``Experts.forward`` is the one place experts are applied (grouping, GEMMs, weighted sum), so a grouped
GEMM kernel can replace its body.
"""

from __future__ import annotations

import torch
from torch import nn

from core.specs import ModelSpec
from engine.layers import Linear, linear_weight
from kernels.cpu_gemm import CpuLinear
from kernels.grouped_gemm import route_tokens
from kernels.ops import KernelSet


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, top_k], expert ids int64 [T, top_k]), transformers' order:
    a float32 softmax over all experts, the top_k probabilities, divided by their sum when ``renormalise`` (Mixtral
    always, which makes them a softmax over the top_k logits; Qwen3-MoE with norm_topk_prob)."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """E SwiGLU experts, stacked. Each expert's two GEMMs go through its own CpuLinear pair (kernels.cpu_gemm), the
    path the dense MLP takes: on fp32 CPU rows the native kernel over a packed copy of that expert's weights."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device) -> None:
        super().__init__()
        n, width = spec.moe.num_experts, spec.moe.intermediate_size
        self.gate_up_proj = linear_weight(2 * width, spec.hidden_size, dtype, device, n)
        self.down_proj = linear_weight(spec.hidden_size, width, dtype, device, n)
        self.num_experts, self.first = n, 0  # the model's experts; the first one held here (engine.tp: EP shards)
        self.matmuls = self._matmuls(native_only=False)

    def _matmuls(self, native_only: bool) -> list[tuple[CpuLinear, CpuLinear]]:
        return [(CpuLinear(native_only), CpuLinear(native_only)) for _ in range(self.gate_up_proj.shape[0])]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """x [T, d]; each token's expert ``ids`` and ``weights`` [T, k] -> sum_j weights[t, j] · expert_ids[t, j](x[t])
        over the experts this module holds (all, or an expert-parallel rank's ``first`` ... ``first + n - 1``;
        the others' pairs add nothing here: the ranks' sums are all-reduced).

        The T·k (token, expert) pairs are sorted by expert (the pairs of experts held elsewhere last); on CPU each
        held expert that got any runs one GEMM pair over its rows (a Python loop over experts, never over tokens),
        elsewhere one grouped GEMM (kernels.grouped_gemm: the Triton kernel on CUDA) runs them all."""
        num_tokens, k = ids.shape
        n = self.gate_up_proj.shape[0]
        flat = ids.flatten() - self.first
        if self.first or n < self.num_experts:  # expert parallel: other ranks' experts -> n (sorted last, skipped)
            flat = torch.where((flat >= 0) & (flat < n), flat, n)
        if x.device.type != "cpu":
            return self._grouped(x, weights, flat.view(num_tokens, k), kernels)
        order = torch.argsort(flat, stable=True)  # pair p = t·k + j, grouped by expert
        counts = torch.bincount(flat, minlength=n + 1).tolist()  # one host sync per layer
        rows = x[order // k]
        outs, start = [], 0
        for e, m in enumerate(counts[:n]):
            if m:
                gate_up, down = self.matmuls[e]
                h = kernels.silu_and_mul(gate_up(rows[start:start + m], self.gate_up_proj[e]))
                outs.append(down(h, self.down_proj[e]))
                start += m
        by_pair = torch.zeros_like(rows) if start < len(rows) else torch.empty_like(rows)
        if outs:
            by_pair[order[:start]] = torch.cat(outs)
        # weighted in float32 and rounded once, as Mixtral does (Qwen3-MoE rounds the weights to the model dtype
        # first: the same in fp32)
        return (by_pair.view(num_tokens, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """The experts as two grouped GEMMs (the SwiGLU in the first one's epilogue) over the pairs in expert
        order; ids n (experts held elsewhere) sort last and are cut off, at one host sync for their count."""
        n = self.gate_up_proj.shape[0]
        route = route_tokens(ids, n + 1)
        offsets, rows = route.expert_offsets[:n + 1], route.permute(x)
        held = rows.shape[0] if n == self.num_experts else int(offsets[n])
        h = kernels.grouped_gemm(rows[:held], offsets, self.gate_up_proj, True)
        y = kernels.grouped_gemm(h, offsets, self.down_proj)
        if held < rows.shape[0]:
            y = torch.cat([y, y.new_zeros(rows.shape[0] - held, y.shape[1])])
        return route.combine(y, weights).to(x.dtype)

    def use_cpu_gemm(self, native_only: bool) -> None:
        """LlamaForCausalLM.use_cpu_gemm for the experts' GEMMs."""
        if self.matmuls[0][0].native_only != native_only:
            self.matmuls = self._matmuls(native_only)

    def prepack(self) -> None:
        """Pack every expert's weights now (warm-up), not in the first step that routes a token to it."""
        for e, (gate_up, down) in enumerate(self.matmuls):
            gate_up.prepack(self.gate_up_proj[e])
            down.prepack(self.down_proj[e])


class SparseMoE(nn.Module):
    """Router (``gate``, as transformers names it) + experts; token-wise, like the dense MLP it replaces."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate = Linear(spec.hidden_size, spec.moe.num_experts, False, dtype, device)
        self.experts = Experts(spec, dtype, device)
        self.top_k, self.renormalise = spec.moe.top_k, spec.moe.norm_topk_prob

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        weights, ids = route(self.gate(x, kernels), self.top_k, self.renormalise)
        return self.experts(x, weights, ids, kernels)
