"""Step time from published per-operator GPU profiles: the tables LLMServingSim's profiler measured with vLLM 0.19
(``shared/data/gpu-measurements/llmservingsim/<GPU>/<org>/<model>/<variant>/``, ``SOURCES.md`` there), so the
simulator predicts a vLLM run on a GPU it has no access to. ``cost_model=profiled``; the tables are found from
``hardware.name``, the model's name and ``tp``.

How a step is priced: ``embedding(T) + final_layernorm(T) + L x [per-layer dense rows(T) + attention] + lm_head(S) +
sampler(S)`` (+ ``L x moe(T, experts)``, collectives, launches, ``overhead_s``), with T = ``num_batched_tokens``,
S = ``num_seqs``. Pipeline stages (``pp``) each run their layers' rows (``core.arithmetic.stage_layers``), the embedding
on the first, the final norm, LM head and sampler on the last, and send the activations on; attention data-parallel
ranks (``dp``) with expert parallelism (``ep``) run their own attention and dense rows and meet at the MoE blocks:
the busiest expert group's expert-token pairs and touched experts (``sim.cost.moe.MoELoad``) looked up in
``moe.csv`` as pairs / k tokens, on ep / (tp x dp) of the block's width (``moe_time``). 1-D tables are piecewise
linear in their axis. Attention is looked up at the step's equivalent single chunk and mean decode history, then
corrected for uneven decode contexts (skew); see ``AttentionTable``.

The tables, what a row is and what happens outside them: ``sim.cost.profile_tables``.

Kernel launches: the tables are kernel time without the gaps between kernels, which is what vLLM pays when it
replays a CUDA graph. It captures graphs for steps of up to ``cuda_graph_max_tokens`` tokens (its default
min(2 x max_num_seqs, 512, max_num_batched_tokens); 0 = ``enforce_eager``) and runs larger steps (long prefill
chunks) eagerly; those pay ``kernel_s`` (``hardware.kernel_launch_s``) for every kernel they launch
(``sim.cost.roofline.kernels_of_stage``: 12 per dense layer), breakdown key ``kernels``. On the RTX PRO 6000
Llama-3.1-8B run (max_num_seqs 128: graphs up to 256 tokens) that is 389 kernels x 4 us = 1.6 ms per eager step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_float, check_int
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import as_hardware_spec, as_model_spec, lockstep_step_time
from sim.cost.comm import Comm, stage_collectives
from sim.cost.moe import MoELoad
from sim.cost.profile_tables import (
    ABOVE,
    BELOW,
    VARIANTS,
    AttentionPoint,
    activated_experts,
    check_shapes,
    equivalent_chunk,
    find_profile,
    load_tables,
    moe_from_tp1,
)
from sim.cost.roofline import OpCost, RooflineCostModel, kernels_of_stage

ONCE_PER_STEP = ("embedding", "final_layernorm")  # dense.csv rows run once per step, not per layer
TWICE_PER_LAYER = ("layernorm",)  # input and post-attention RMSNorm of each decoder layer
# vLLM's CUDA-graph ceiling when none is configured (vllm/config/vllm.py ``_set_cudagraph_sizes``): graphs are captured
# for batches of up to min(2 x max_num_seqs, 512) tokens, never more than max_num_batched_tokens (1024 instead of
# 512 on data-center Blackwell, which no preset here is).
VLLM_GRAPH_CEILING = 512


def vllm_cuda_graph_max_tokens(max_num_seqs: int | None, max_num_batched_tokens: int | None) -> int:
    """The largest step (in tokens) vLLM replays as a CUDA graph by default; larger steps run eagerly."""
    out = VLLM_GRAPH_CEILING if max_num_seqs is None else min(2 * int(max_num_seqs), VLLM_GRAPH_CEILING)
    return out if max_num_batched_tokens is None else min(out, int(max_num_batched_tokens))

# ---- the cost model -------------------------------------------------------------------------------------------------
class OperatorProfileCostModel:
    """Prices a step from the published per-operator tables of one GPU, model and TP degree (module docstring).

    ``overhead_s``: a fixed per-step time outside the tables' kernel time (vLLM 0.19 overlaps its CPU scheduling
    with the GPU, async scheduling being on by default, and replays CUDA graphs; 0 by default). ``skew``: apply the
    uneven-decode-context correction where the bundle has one. ``pp``, ``dp``, ``ep``: the deployment beyond
    ``tp`` (docs/parallelism.md); ``network_dir``: Vidur's measured NCCL tables, read for
    ``hardware.network_profile`` (``sim.cost.comm``; none: the hardware's peer link prices every collective).
    ``num_experts`` / ``experts_per_token``: a MoE model's routing, for a ``moe.csv``; null: the model's ``moe``
    section (``num_experts``, ``top_k``). ``profile``: a variant folder to use instead of the search by hardware
    and model name. ``kernel_s`` (null: ``hardware.kernel_launch_s``), ``cuda_graph_max_tokens`` (null: vLLM's
    default from ``max_num_seqs`` / ``max_num_batched_tokens``): the launches of steps that run without a CUDA
    graph (module docstring).
    """

    def __init__(self, model: ModelSpec | Mapping[str, Any], hardware: HardwareSpec | Mapping[str, Any], tp: int = 1,
                 data_dir: str | None = None, profile: str | None = None, variant: str | None = None,
                 overhead_s: float = 0.0, skew: bool = True, num_experts: int | None = None,
                 experts_per_token: int | None = None, pp: int = 1, dp: int = 1, ep: int = 1,
                 network_dir: str | None = None, kernel_s: float | None = None,
                 cuda_graph_max_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        m, hw = as_model_spec(model), as_hardware_spec(hardware)
        self.model, self.hardware = m, hw
        self.tp = check_int(tp, "parallel.tp", 1)
        self.overhead_s = check_float(overhead_s, "cost_model.overhead_s", 0.0)
        self.pp, self.dp, self.ep = (check_int(v, f"parallel.{k}", 1) for k, v in (("pp", pp), ("dp", dp), ("ep", ep)))
        self.skew = bool(skew)
        self.kernel_s = check_float(hw.kernel_launch_s if kernel_s is None else kernel_s, "cost_model.kernel_s", 0.0)
        self.cuda_graph_max_tokens = (vllm_cuda_graph_max_tokens(max_num_seqs, max_num_batched_tokens)
                                      if cuda_graph_max_tokens is None
                                      else check_int(cuda_graph_max_tokens, "cost_model.cuda_graph_max_tokens", 0))
        variant = variant or VARIANTS.get(m.dtype, m.dtype)
        if profile is None and data_dir is None:
            raise ValueError("cost_model.data_dir: the published profiles' folder is required (a run fills in "
                             "shared/data/gpu-measurements/llmservingsim), or cost_model.profile: one variant folder")
        folder = Path(profile) if profile else find_profile(hw.name, m.name, variant, data_dir)
        self.tables = tables = load_tables(str(folder.resolve()), self.tp)
        check_shapes(tables.meta, m, folder)
        if self.ep > 1 and (m.moe is None or m.moe.num_experts % self.ep or (self.tp * self.dp) % self.ep):
            raise ValueError(f"parallel.ep={self.ep} needs an MoE model whose experts it divides, and must divide "
                             f"parallel.tp x parallel.dp = {self.tp * self.dp}")
        if self.tp * self.dp > 1 and hw.interconnect_bw <= 0 and not hw.network_profile:
            raise ValueError(f"parallel.tp x parallel.dp = {self.tp * self.dp} needs hardware.interconnect_bw > 0 "
                             f"({hw.name} has 0)")
        self.roofline = RooflineCostModel(m, hw, tp=self.tp)
        self.comm = Comm.of(hw, network_dir)
        self.network_dir = network_dir
        self._row = m.hidden_size * ar.act_bytes(m)  # bytes of one token's activations
        stages = ar.stage_layers(m, self.pp)
        self._stages = [(len(r), sum(1 for i in r if ar.is_moe_layer(m, i))) for r in stages]
        # launch seconds of each stage's kernels, paid by a step that runs without a CUDA graph (``launch_time``)
        self._stage_launch_s = [self.kernel_s * kernels_of_stage(m, r, k == 0, k == self.pp - 1)
                                for k, r in enumerate(stages)]
        self.experts: tuple[int, int] | None = None
        self.moe_from: str | None = None  # where the MoE block's times come from, when not this TP's own moe.csv
        if tables.moe is None and m.moe is not None and self.tp > 1:
            tables = self.tables = moe_from_tp1(tables, folder.resolve(), self.tp)
            self.moe_from = f"tp1/moe.csv / {self.tp}"
        if tables.moe is not None:
            if m.moe is not None:  # the model's routing unless given here
                num_experts = m.moe.num_experts if num_experts is None else num_experts
                experts_per_token = m.moe.top_k if experts_per_token is None else experts_per_token
            if num_experts is None or experts_per_token is None:
                raise ValueError(f"{tables.directory} has moe.csv: the model has no moe section; set "
                                 "cost_model.num_experts and cost_model.experts_per_token (its routing)")
            self.experts = (check_int(num_experts, "cost_model.num_experts", 1),
                            check_int(experts_per_token, "cost_model.experts_per_token", 1))
        once = [n for n in ONCE_PER_STEP if n in tables.dense]
        self._layer_rows = {n: (2 if n in TWICE_PER_LAYER else 1) for n in tables.dense if n not in ONCE_PER_STEP}
        for name in ("lm_head", "sampler"):
            if name not in tables.per_sequence:
                raise ValueError(f"{tables.directory}/per_sequence.csv has no {name!r} rows")
        # per-step dense time at every token count the tables cover (index = tokens), summed once here
        self._max_tokens = int(min(c.top for c in tables.dense.values()))
        if tables.moe is not None:
            self._max_tokens = min(self._max_tokens, int(tables.moe.top))
        t = np.arange(self._max_tokens + 1, dtype=float)
        layer = sum(k * tables.dense[n].at(t) for n, k in self._layer_rows.items())
        per_layer = layer + self._moe_at(t)
        self._dense = sum(tables.dense[n].at(t) for n in once) + m.num_layers * per_layer
        # a stage's parts (pp, dp, ep): one layer's dense rows without the MoE block, the once-per-step rows
        self._layer_dense = layer + np.zeros_like(t)
        self._first_rows = sum((tables.dense[n].at(t) for n in once if n == "embedding"), np.zeros_like(t))
        self._last_rows = sum((tables.dense[n].at(t) for n in once if n != "embedding"), np.zeros_like(t))
        self.moe_load = MoELoad(*self.experts, self.ep) if self.experts is not None else None
        self._max_seqs = int(min(tables.per_sequence[n].top for n in ("lm_head", "sampler")))
        s = np.arange(self._max_seqs + 1, dtype=float)
        self._head = tables.per_sequence["lm_head"].at(s) + tables.per_sequence["sampler"].at(s)
        self.priced = 0  # steps priced (a fast-forwarded decode run prices some it never takes)
        self.beyond: Counter[str] = Counter()  # lookups whose table value was scaled from the edge, per table
        self.below: Counter[str] = Counter()  # ... held at the smallest profiled value

    def _moe_at(self, tokens: np.ndarray) -> np.ndarray:
        moe = self.tables.moe
        if moe is None or self.experts is None:
            return np.zeros_like(tokens)
        acts = activated_experts(tokens, *self.experts)
        return np.array([moe.at(float(x), float(e)) if x > 0 else 0.0 for x, e in zip(tokens, acts, strict=True)])

    # ---- parts of a step ----
    def dense_time(self, tokens: int) -> float:
        """Every dense.csv row a step of ``tokens`` tokens runs (+ MoE blocks), all layers."""
        if tokens <= self._max_tokens:
            return float(self._dense[tokens])
        self.beyond["dense"] += 1
        edge = self._max_tokens
        return float(self._dense[edge]) * self._roof_dense(tokens) / self._roof_dense(edge)

    def head_time(self, seqs: int) -> float:
        """LM head + sampler of ``seqs`` sequences."""
        if seqs <= self._max_seqs:
            return float(self._head[seqs])
        self.beyond["per_sequence"] += 1
        edge, ps = self._max_seqs, self.tables.per_sequence
        head = float(ps["lm_head"].at(edge)) * self._roof_head(seqs) / self._roof_head(edge)
        return head + float(ps["sampler"].at(edge)) * seqs / edge  # the sampler reads one logits row a sequence

    def attention_point(self, f: StepFeatures, kd: float) -> AttentionPoint:
        pc, kp = equivalent_chunk(f.num_prefill_tokens, f.attention_pairs)
        return AttentionPoint(pc, kp, f.num_decode_seqs, kd if f.num_decode_seqs else 0.0)

    def _attention_at(self, q: AttentionPoint) -> float:
        value, clamped, status = self.tables.attention.lookup(q)
        if status == ABOVE:
            self.beyond["attention"] += 1
            return value * self._roof_attention(q) / self._roof_attention(clamped)
        if status == BELOW:
            self.below["attention"] += 1
        return value

    def attention_time(self, f: StepFeatures) -> tuple[float, float]:
        """(one layer's attention at the mean decode history, the skew correction added to it)."""
        nd = f.num_decode_seqs
        mean_kd = f.kv_tokens_read / nd - 1 if nd else 0.0
        q = self.attention_point(f, mean_kd)
        t_mean = self._attention_at(q)
        sk = self.tables.skew
        max_kd, min_kd = f.max_decode_context - 1, f.min_decode_context - 1
        if not self.skew or sk is None or nd < 2 or f.max_decode_context <= 0 or max_kd <= mean_kd:
            return t_mean, 0.0
        alpha = sk.alpha(f.num_prefill_tokens, nd, (mean_kd - min_kd) / (max_kd - min_kd), max_kd, q.kp)
        if alpha == 0.0:
            return t_mean, 0.0
        t_max = self._attention_at(AttentionPoint(q.pc, q.kp, nd, max_kd))
        return t_mean, alpha * (t_max - t_mean) if t_max > t_mean else 0.0

    def allreduce_time(self, tokens: int) -> float:
        """Two all-reduces of the activations per layer (after o_proj and down_proj), none at tp 1 (``sim.cost.comm``;
        the pp = dp = ep = 1 step's only collective)."""
        if self.tp == 1:
            return 0.0
        return 2 * self.model.num_layers * self.comm.all_reduce_s(tokens * self._row, self.tp)

    def launch_time(self, tokens: int, stage: int = 0) -> float:
        """Kernel launches of a stage's step: free when the step replays a CUDA graph (at most
        ``cuda_graph_max_tokens`` tokens), ``kernel_s`` per kernel when it runs eagerly. The tables are GPU kernel
        time without launch gaps, which is what a graph replay costs; an eager step adds its launches."""
        return 0.0 if tokens <= self.cuda_graph_max_tokens else self._stage_launch_s[stage]

    def _rows(self, arr: np.ndarray, tokens: int) -> float:
        """A per-token-count array of dense rows at ``tokens``, scaled as ``dense_time`` beyond the tables."""
        if tokens <= self._max_tokens:
            return float(arr[tokens])
        self.beyond["dense"] += 1
        edge = self._max_tokens
        return float(arr[edge]) * self._roof_dense(tokens) / self._roof_dense(edge)

    def moe_time(self, tokens: int) -> float:
        """One MoE block on one device when ``tokens`` tokens (every dp rank's) meet there: the busiest of the ep
        expert groups' expert-token pairs (``MoELoad``) as pairs / k tokens, over the experts of its group they
        touch, on ep / (tp x dp) of the experts' width (the table's block is the whole layer at this TP degree, so
        x tp / (tp x dp / ep)). At dp = ep = 1 that is the table at the step's tokens and expected activated experts.
        Beyond the table's tokens: linear in tokens from its edge (the block is compute-bound there), counted."""
        moe, load = self.tables.moe, self.moe_load
        if moe is None or load is None or tokens <= 0:
            return 0.0
        x, experts = load.busiest_pairs(tokens) / load.top_k, load.experts_touched(tokens)
        if x <= moe.top:
            block = moe.at(x, experts)
        else:
            self.beyond["moe"] += 1
            block = moe.at(moe.top, experts) * x / moe.top
        return block * self.ep / self.dp

    def comm_times(self, f: StepFeatures, moe_tokens: int | None = None) -> list[dict[str, float]]:
        """Each stage's collectives (``sim.cost.comm.stage_collectives``)."""
        return [stage_collectives(self.comm, tokens=f.num_batched_tokens, row_bytes=self._row, layers=layers,
                                  moe_layers=moe_layers, tp=self.tp, dp=self.dp, ep=self.ep, moe_tokens=moe_tokens,
                                  last=k == self.pp - 1)
                for k, (layers, moe_layers) in enumerate(self._stages)]

    def stage_parts(self, f: StepFeatures, moe_tokens: int | None = None) -> list[dict[str, float]]:
        """Seconds per part of each pipeline stage: ``dense`` (its layers' dense rows, the embedding on the first
        stage, the final norm on the last), ``moe``, ``attention`` (skew included), ``head`` (LM head + sampler, the
        last stage) and its collectives."""
        T = f.num_batched_tokens
        t_mean, skew = self.attention_time(f)
        moe = self.moe_time(T if moe_tokens is None else moe_tokens) if self.experts else 0.0
        layer = self._rows(self._layer_dense, T)
        out = []
        for k, ((layers, moe_layers), comm) in enumerate(zip(self._stages, self.comm_times(f, moe_tokens),
                                                             strict=True)):
            dense = layers * layer + (self._rows(self._first_rows, T) if k == 0 else 0.0)
            last = k == self.pp - 1
            if last:
                dense += self._rows(self._last_rows, T)
            out.append({"dense": dense, "moe": moe_layers * moe, "attention": layers * (t_mean + skew),
                        "head": self.head_time(f.num_seqs) if last else 0.0, "kernels": self.launch_time(T, k),
                        **comm})
        return out

    def stage_times(self, f: StepFeatures, moe_tokens: int | None = None) -> list[float]:
        """Seconds each pipeline stage takes for the step, its send to the next included, no overhead
        (``sim.cost.base.StagedCostModel``); ``moe_tokens``: every dp rank's tokens, meeting at the MoE blocks."""
        if f.num_batched_tokens == 0:
            return [0.0] * self.pp
        self.priced += 1
        return [sum(parts.values()) for parts in self.stage_parts(f, moe_tokens)]

    def group_step_time(self, features: Sequence[StepFeatures]) -> float:
        """One lockstep step of the dp ranks (``sim.cost.base.lockstep_step_time``)."""
        return lockstep_step_time(self, features)

    # ---- roofline anchors beyond a table's edge ----
    def _roof(self, f: StepFeatures, groups: Sequence[str]) -> float:
        ops = self.roofline.ops(f)
        return sum(self.roofline.op_time(ops[g]) for g in groups)

    def _roof_dense(self, tokens: int) -> float:
        return self._roof(StepFeatures(num_seqs=1, num_batched_tokens=tokens, num_prefill_seqs=1,
                                       num_prefill_tokens=tokens), ("linear", "elementwise"))

    def _roof_head(self, seqs: int) -> float:
        return self._roof(StepFeatures(num_seqs=seqs, num_batched_tokens=seqs, num_decode_seqs=seqs,
                                       kv_tokens_read=seqs), ("lm_head",))

    def _roof_attention(self, q: AttentionPoint) -> float:
        pairs = q.pc * q.kp + q.pc * (q.pc + 1) / 2
        per_pair = ar.attention_flops_per_pair(self.model) / self.tp
        per_kv = ar.kv_bytes_per_token_per_device(self.model, 16, self.tp)
        read = q.nd * (q.kd + 1)
        return (self.roofline.op_time(OpCost(per_pair * pairs, per_kv * (q.kp + q.pc)))
                + self.roofline.op_time(OpCost(per_pair * read, per_kv * read)))

    # ---- the step ----
    def step_time(self, f: StepFeatures) -> float:
        if f.num_batched_tokens == 0:
            return self.overhead_s
        if self.pp * self.dp * self.ep > 1:
            return sum(self.stage_times(f)) + self.overhead_s
        self.priced += 1
        t_mean, skew = self.attention_time(f)
        return (self.dense_time(f.num_batched_tokens) + self.model.num_layers * (t_mean + skew)
                + self.head_time(f.num_seqs) + self.allreduce_time(f.num_batched_tokens)
                + self.launch_time(f.num_batched_tokens) + self.overhead_s)

    def breakdown(self, f: StepFeatures) -> dict[str, float]:
        """Seconds per part, straight from the tables' curves (not the summed arrays ``step_time`` uses); they sum
        to ``step_time``. Keys: each dense.csv row (all layers), ``moe``, ``attention``, ``skew``, ``lm_head``,
        ``sampler``, ``allreduce`` (pp, dp or ep > 1: also ``all_to_all`` and ``send_recv``, the stages summed),
        ``overhead``."""
        if f.num_batched_tokens == 0:
            return {"overhead": self.overhead_s}
        T, S, L = f.num_batched_tokens, f.num_seqs, self.model.num_layers
        tabs = self.tables
        out = {n: float(c.at(T)) * (1 if n in ONCE_PER_STEP else L * self._layer_rows[n])
               for n, c in tabs.dense.items()}
        staged = self.pp * self.dp * self.ep > 1
        out["moe"] = sum(n for _, n in self._stages) * self.moe_time(T) if staged else \
            L * float(self._moe_at(np.array([float(T)]))[0])
        t_mean, skew = self.attention_time(f)
        out["attention"], out["skew"] = L * t_mean, L * skew
        out["lm_head"] = float(tabs.per_sequence["lm_head"].at(S))
        out["sampler"] = float(tabs.per_sequence["sampler"].at(S))
        if staged:
            for stage in self.comm_times(f):
                for k, v in stage.items():
                    out[k] = out.get(k, 0.0) + v
        else:
            out["allreduce"] = self.allreduce_time(T)
        out["kernels"] = sum(self.launch_time(T, k) for k in range(self.pp))
        out["overhead"] = self.overhead_s
        return out

    def coverage(self) -> dict[str, Any]:
        """How many lookups left a table's grid, per table, of how many steps priced (metrics.json ``cost_model``)."""
        out = {"profile": str(self.tables.directory), "priced_steps": self.priced, "beyond_grid": dict(self.beyond),
               "below_grid": dict(self.below)}
        if self.moe_from:
            out["moe_from"] = self.moe_from
        return out
