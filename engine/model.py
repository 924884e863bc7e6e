"""Llama-family decoder (Llama 2/3, Qwen2, Mistral, Qwen3, and the mixtures of experts Mixtral and Qwen3-MoE) over
one flattened varlen batch and a paged KV cache.

Parameter names follow Hugging Face's except for the fused projections: ``self_attn.qkv_proj`` holds q, k, v
stacked along the output dim and ``mlp.gate_up_proj`` holds gate then up (the loader concatenates); MoE layers'
experts are stacked (engine.moe). Every op goes through a ``kernels.ops.KernelSet`` passed to ``forward``, so the
torch / Triton switch is one name and one model can be shared by executors using either backend. Multi-head latent
attention (DeepSeek-V2/V3) is not here: the constructor refuses it (the simulator prices those models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.arithmetic import is_moe_layer
from core.checks import check_choice
from core.specs import ModelSpec
from engine.attention import AttentionMetadata, KVCache, paged_attention
from engine.layers import Linear, RMSNorm, param
from engine.moe import Experts, SparseMoE
from kernels.cpu_gemm import CpuLinear
from kernels.greedy_screen import GreedyScreen
from kernels.ops import CPU_GEMMS, KernelSet
from kernels.rope import rope_cos_sin

# Tokens per pass through a layer's token-wise ops on CPU: a long prefill's intermediates (the MLP's
# [T, 2 * intermediate] above all) then stay in cache; ~1/3 off those ops for a 2k-token prefill. GPUs take all rows.
CPU_ROW_CHUNK = 512


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(spec.hidden_size, q_size + 2 * kv_size, spec.attention_bias, dtype, device)
        self.o_proj = Linear(q_size, spec.hidden_size, False, dtype, device)
        self.scale = spec.head_dim ** -0.5
        # Qwen3: one RMSNorm weight [head_dim] for every q head, one for every k head
        self.q_norm, self.k_norm = ((RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device),
                                     RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device))
                                    if spec.qk_norm else (None, None))

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kernels: KernelSet):
        """x [T, hidden] -> q [T, H, D] and k [T, Hkv, D] (per-head normed when the model has q/k norms) rotated,
        v [T, Hkv, D] (token-wise)."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x, kernels).split(self.split, dim=-1)
        if self.q_norm is not None:  # over each head's D values: rows of [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim), None, kernels)[0]
            k = self.k_norm(k.reshape(-1, self.head_dim), None, kernels)[0]
        q, k = kernels.rope(q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
                            positions, cos_sin)
        return q, k, v.view(T, self.num_kv_heads, self.head_dim)

    def attend(self, q, k, v, meta: AttentionMetadata, cache: KVCache, kernels: KernelSet) -> torch.Tensor:
        """Store k, v and attend over the paged context -> [T, H * D] (before o_proj)."""
        return paged_attention(kernels, q, k, v, cache, meta, self.scale).reshape(q.shape[0], -1)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, False, dtype, device)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x, kernels)), kernels)


def _by_rows(fn, chunk: int | None, *xs):
    """fn(*xs) -> tuple of [T, ...] tensors, run over chunks of ``chunk`` rows of xs (None passes through) and
    concatenated; a single call when the rows fit one chunk."""
    T = xs[0].shape[0]
    if chunk is None or chunk >= T:
        return fn(*xs)
    parts = [fn(*(None if x is None else x[a:a + chunk] for x in xs)) for a in range(0, T, chunk)]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = Attention(spec, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = SparseMoE(spec, dtype, device) if is_moe_layer(spec, layer) else MLP(spec, dtype, device)
        self.reduce = _same  # tensor parallelism: the all-reduce after the row-parallel o_proj and MLP (engine.tp)

    def forward(self, h, residual, positions, meta, cache, cos_sin, kernels, row_chunk: int | None = None):
        """Everything but attention itself is token-wise, so it may run ``row_chunk`` tokens at a time."""
        def pre(h, residual, positions):
            x, residual = self.input_layernorm(h, residual, kernels)
            return *self.self_attn.project(x, positions, cos_sin, kernels), residual

        def post(o, residual):
            x, residual = self.post_attention_layernorm(self.reduce(self.self_attn.o_proj(o, kernels)), residual,
                                                        kernels)
            return self.reduce(self.mlp(x, kernels)), residual

        q, k, v, residual = _by_rows(pre, row_chunk, h, residual, positions)
        return _by_rows(post, row_chunk, self.self_attn.attend(q, k, v, meta, cache, kernels), residual)


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = param(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, device) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The decoder. Build empty here; fill with ``engine.loader`` (checkpoint or seeded random weights)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if spec.mla is not None:
            raise ValueError(f"model.architecture={spec.architecture!r}: multi-head latent attention is not in the "
                             "engine; the simulator (backend=sim) runs this model")
        if spec.moe is not None and spec.moe.num_shared_experts:
            raise ValueError(f"model.moe.num_shared_experts={spec.moe.num_shared_experts}: shared experts are not in "
                             "the engine; the simulator (backend=sim) runs this model")
        self.spec = spec
        self.dtype = dtype or getattr(torch, spec.dtype)
        self.model = Backbone(spec, self.dtype, device)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, False,
                                                                     self.dtype, device)
        self.logits_matmul = CpuLinear()  # the LM head (or the tied embedding) as a GEMM
        self.greedy_screen: GreedyScreen | None = GreedyScreen()  # greedy tokens without all the logits (CPU)
        self.tp = None  # engine.tp.TensorParallel: this rank's shard of a tensor-parallel model (engine.tp.shard_model)
        # cos/sin rounded to the model dtype, as HF casts them before rotating
        self.register_buffer("cos_sin", rope_cos_sin(spec.head_dim, spec.max_model_len, spec.rope_theta,
                                                     spec.rope_scaling, self.dtype, device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.cos_sin.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], kernels: KernelSet, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions int64 [T] -> final hidden states [T, hidden], or only those of ``rows`` (the
        sampled tokens: the final norm is token-wise); writes this step's K/V."""
        h = F.embedding(input_ids, self.model.embed_tokens.weight) if self.tp is None else self.tp.embed(
            input_ids, self.model.embed_tokens.weight)
        residual = None
        row_chunk = CPU_ROW_CHUNK if h.device.type == "cpu" else None
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, meta, cache, self.cos_sin, kernels, row_chunk)
        if rows is not None:
            h, residual = h[rows], residual[rows]
        return self.model.norm(h, residual, kernels)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] (the LM head stays in 16-bit even when the layers are quantised; tensor
        parallel: each rank's vocabulary slice, gathered)."""
        logits = self.logits_matmul(hidden, self.logits_weight)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.spec.vocab_size)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> the argmax of each row's logits (int64 [n]) through the LM head's int8 screen
        (kernels.greedy_screen: the same tokens, most logits never computed in fp32); None where the screen does not
        apply (off, not an fp32 model on an x86 CPU with AVX2, a row it cannot screen): take compute_logits."""
        return None if self.greedy_screen is None else self.greedy_screen(hidden, self.logits_weight)

    def use_greedy_screen(self, on: bool) -> None:
        """backend.greedy_screen: greedy_tokens through the screen (True) or never (False: callers compute every
        logit)."""
        on = on and self.tp is None  # a rank holds a slice of the LM head: the screen needs all of it
        if on != (self.greedy_screen is not None):
            self.greedy_screen = GreedyScreen() if on else None

    @property
    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head's weight, or the tied embedding table."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_cpu_gemm(self, choice: str) -> None:
        """kernels.cpu_gemm.CPU_GEMMS: "native" runs every fp32 CPU GEMM on the native kernel (one packed weight
        copy), "auto" the faster kernel per row count. Drops packed copies made under the other choice."""
        check_choice(choice, "backend.cpu_gemm", CPU_GEMMS)
        for module in self.modules():
            if isinstance(module, Linear) and module.matmul.native_only != (choice == "native"):
                module.matmul = CpuLinear(choice == "native")
            elif isinstance(module, Experts):
                module.use_cpu_gemm(choice == "native")
        if self.logits_matmul.native_only != (choice == "native"):
            self.logits_matmul = CpuLinear(choice == "native")

    def pack_cpu_weights(self) -> None:
        """Pack every fp32 CPU GEMM's weight copies now (warm-up) rather than in a timed step."""
        for module in self.model.layers.modules():
            if isinstance(module, Linear) and module.weight is not None:
                module.matmul.prepack(module.weight)
            elif isinstance(module, Experts):
                module.prepack()
        self.logits_matmul.prepack(self.logits_weight)
        if self.greedy_screen is not None:
            self.greedy_screen.prepack(self.logits_weight)

    def quantize(self, group_size: int = 128, zero_point: bool = True) -> None:
        """W4A16: replace every projection in the decoder layers by a group-wise 4-bit weight."""
        if self.spec.moe is not None:
            raise ValueError("quant=w4a16 does not cover MoE experts: run mixture-of-experts models unquantised")
        for module in self.model.layers.modules():
            if isinstance(module, Linear):
                module.quantize(group_size, zero_point)
