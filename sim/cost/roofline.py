"""Roofline step time: each op group costs max(compute time, memory time); a step is their sum plus overhead.

All quantities are per device. Parallel deployments (``parallel``: tp, pp, dp, ep; docs/parallelism.md):

- tensor parallelism splits weights, heads, FLOPs and KV across ``tp`` devices and adds two all-reduces of the
  activations per layer (after attention, after the MLP);
- pipeline parallelism splits the layers into ``pp`` stages (``core.arithmetic.stage_layers``), the embedding on the
  first, the LM head on the last, a send/recv of the activations between stages; ``stage_times`` prices each stage
  (``sim.pipeline`` runs micro-batches through them);
- MoE layers are their own op group ``moe``: the routed experts of the tokens of all ``dp`` ranks (they meet
  there), split into ``ep`` groups of experts, each sharded over tp x dp / ep devices. The busiest group sets the
  time: its expert-token pairs are the expected maximum of a multinomial draw of the T·k pairs over the ep groups
  (``moe_imbalance``: a measured max / mean factor instead), its bytes the experts the step's tokens touch
  (E/ep · (1 − (1 − k/E)^T) of them). With dp > 1 and ep > 1 the MLP all-reduce of an MoE layer becomes vLLM's
  default expert-parallel exchange (an all-gather of every rank's activations, then a reduce-scatter of the
  experts' outputs; ``sim.cost.comm.stage_collectives``); ``group_step_time`` is the step of dp ranks in lockstep (the
  slowest rank's attention and dense layers, plus the shared MoE layers).

Collectives are priced by ``sim.cost.comm.Comm``: measured NCCL tables where the hardware has them
(``network_dir`` with ``hardware.network_profile``), else the peer link.

Kernels cost twice in an eager-mode engine (no CUDA graphs), once on each side of the launch queue; both terms
count the same kernels, the same at every tp (an eager engine launches the same kernels per layer at every tp, only
smaller ones: ``kernels_of_stage``):

- device side (``kernel_s``, default ``hardware.kernel_launch_s``, 0 unless the preset sets it): the gap a device
  leaves between two kernels even with its queue full, added to the stage's device time;
- host side (``host_kernel_s``, default 0): the CPU time the engine spends issuing one kernel (Python, framework
  dispatch, the launch call). The host runs ahead of the device, so the two overlap: a stage lasts

      stage = max(device, host),  device = Σ op groups + collectives + kernels x kernel_s,
                                  host   = kernels x host_kernel_s

  (each pp stage has its own host process). A big batch hides the host behind the device; a small batch at high
  tp waits on the host, which is why a host-bound engine's decode step stops shrinking with tp. ``breakdown`` adds
  the part not hidden, ``host_wait`` = max(0, host − device), beside the device terms (present only when
  host_kernel_s > 0); ``host_s`` is the whole host term of each stage. ``overhead_s`` (scheduling before the
  launches) is added to the step after the overlap. host_kernel_s 0: the host is never the bound, and every price is
  the device time alone, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_float, check_fraction, check_int
from core.fast_forward import decode_features as next_decode
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import as_hardware_spec, as_model_spec, decode_steps, lockstep_step_time
from sim.cost.comm import Comm, stage_collectives
from sim.cost.moe import MoELoad

LOGIT_BYTES = 4  # logits are written in float32
ALLREDUCES_PER_LAYER = 2  # after attention and after the MLP (Megatron-style tensor parallelism)
TARGET = "sim.cost.roofline.RooflineCostModel"
PARAMS = ("compute_eff", "bw_eff", "overhead_s", "weight_bits", "kv_bits", "group_size", "tp", "pp", "dp", "ep",
          "moe_imbalance", "network_dir", "kernel_s", "host_kernel_s")  # besides the specs
COMM = ("allreduce", "all_to_all", "send_recv")  # breakdown's communication terms
# Kernels of one decoder layer of an eager-mode engine (vLLM without CUDA graphs): input RMSNorm, QKV GEMM, rotary
# embedding, KV-cache write, attention, o_proj GEMM, residual add, post-attention RMSNorm, then the MLP. The
# all-reduces are not counted: the collectives are priced from measured NCCL times, which include their launch.
ATTENTION_KERNELS = 7  # norm, qkv, rope, cache write, attention, o_proj, residual add
DENSE_MLP_KERNELS = 5  # norm, gate_up GEMM, SiLU-and-mul, down GEMM, residual add
MOE_MLP_KERNELS = 7  # norm, router GEMM, top-k softmax, experts gate_up, activation, experts down, residual add
SHARED_EXPERT_KERNELS = 3  # gate_up GEMM, activation, down GEMM of the shared experts (added to an MoE layer's)
FIRST_STAGE_KERNELS = 1  # embedding lookup
LAST_STAGE_KERNELS = 4  # final RMSNorm, LM head GEMM, sampler softmax, sampling


@dataclass(frozen=True)
class OpCost:
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


class RooflineCostModel:
    """Op groups: linear layers (dense: attention projections, dense MLPs, shared experts, routers), routed experts
    (``moe``), attention prefill, attention decode, LM head, norms/elementwise.

    Assumptions: the LM head computes one logits row per scheduled sequence (``num_seqs``: every decode and every
    prefill chunk, as vLLM does before discarding a partial prefill's sample); the embedding lookup is ignored;
    quantised weights are dequantised to compute at 16-bit peak (weight-only quantisation saves bytes, not FLOPs).
    A step with no tokens costs ``overhead_s``.

    Every kernel costs ``kernel_s`` of device time besides (``kernel_s`` None: ``hardware.kernel_launch_s``;
    breakdown key ``kernels``), and ``host_kernel_s`` of host time that overlaps the device's (breakdown key
    ``host_wait``: the host time not hidden); see the module docstring.

    Bytes are what the engine stores, from ``core.arithmetic``: with ``weight_bits`` 4 (the engine's W4A16) or 8
    (a what-if format: the engine has no W8 path) each group of ``group_size`` linear weights carries a 16-bit
    scale and a 16-bit zero point, counted the same way for both widths; ``kv_bits`` 8 (the engine's int8 KV) reads
    one float32 scale per token and KV head for K and for V besides the int8 elements, so its KV reads are
    (Dh + 4) / (2·Dh) of 16-bit KV's, not half.
    """

    def __init__(self, model: ModelSpec | Mapping[str, Any], hardware: HardwareSpec | Mapping[str, Any],
                 compute_eff: float = 0.7, bw_eff: float = 0.75, overhead_s: float = 1e-3, weight_bits: int = 16,
                 kv_bits: int = 16, group_size: int = 128, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                 moe_imbalance: float | None = None, network_dir: str | None = None,
                 kernel_s: float | None = None, host_kernel_s: float = 0.0) -> None:
        m, hw = as_model_spec(model), as_hardware_spec(hardware)
        self.model, self.hardware = m, hw
        self.compute_eff = check_fraction(compute_eff, "cost_model.compute_eff")
        self.bw_eff = check_fraction(bw_eff, "cost_model.bw_eff")
        self.overhead_s = check_float(overhead_s, "cost_model.overhead_s", 0.0)
        self.kernel_s = check_float(hw.kernel_launch_s if kernel_s is None else kernel_s, "cost_model.kernel_s", 0.0)
        self.host_kernel_s = check_float(host_kernel_s, "cost_model.host_kernel_s", 0.0)
        ar.check_quant(weight_bits, kv_bits, group_size)
        self.weight_bits, self.kv_bits, self.group_size = weight_bits, kv_bits, group_size
        ar.kv_heads_per_device(m, tp)  # validates tp
        for key, v in (("pp", pp), ("dp", dp), ("ep", ep)):
            check_int(v, f"parallel.{key}", 1)
        if ep > 1 and (m.moe is None or m.moe.num_experts % ep or (tp * dp) % ep):
            raise ValueError(f"parallel.ep={ep} needs an MoE model whose experts it divides, and must divide "
                             f"parallel.tp x parallel.dp = {tp * dp}")
        if tp * dp > 1 and hw.interconnect_bw <= 0:
            raise ValueError(f"parallel.tp={tp} needs hardware.interconnect_bw > 0 ({hw.name} has 0)")
        self.tp, self.pp, self.dp, self.ep, self.moe_imbalance = tp, pp, dp, ep, moe_imbalance
        self.network_dir = network_dir
        self.comm = Comm.of(hw, network_dir)
        self.moe = MoELoad(m.moe.num_experts, m.moe.top_k, ep, moe_imbalance) if m.moe is not None else None

        self._flop_rate = hw.peak_flops * self.compute_eff
        self._byte_rate = hw.mem_bw * self.bw_eff
        self._act_bytes = ar.act_bytes(m)
        self._stages = [self._stage(layers, i == pp - 1) for i, layers in enumerate(ar.stage_layers(m, pp))]
        # the one stage of pp=1, as attributes the hot path and the published checks read
        (self._linear_flops, self._linear_bytes, self._moe_flops, self._moe_bytes, self._pair_flops, self._kv_bytes,
         self._elem_bytes, self._head_flops, self._head_bytes, self._logit_bytes, _) = self._stages[0]
        self._act_row = m.hidden_size * self._act_bytes  # bytes of one token's activations
        stages = ar.stage_layers(m, pp)
        self.kernels = [kernels_of_stage(m, layers, i == 0, i == pp - 1) for i, layers in enumerate(stages)]
        self._stage_kernel_s = [self.kernel_s * n for n in self.kernels]  # seconds of each stage's launches
        self._kernel_s = self._stage_kernel_s[0]  # pp=1 (the hot path)
        self.host_s = [self.host_kernel_s * n for n in self.kernels]  # host seconds to issue each stage's kernels
        self._host_s = self.host_s[0]

    def _stage(self, layers: range, last: bool) -> tuple:
        """Per-device coefficients of one stage: dense linear FLOPs per token and bytes, routed-expert FLOPs per
        expert-token pair and bytes per touched expert, attention FLOPs per pair, KV bytes per token, elementwise
        bytes per token, LM head FLOPs per row and bytes (0 off the last stage), logit bytes per row, and the
        layer counts (all, MoE)."""
        m, tp, wb, gs = self.model, self.tp, self.weight_bits, self.group_size
        moe_layers = [i for i in layers if ar.is_moe_layer(m, i)]
        shared = m.moe.num_shared_experts * ar.expert_params(m) if m.moe else 0
        # per layer: attention + the dense MLP, or in an MoE layer its shared experts (the routed ones: ``moe``);
        # the attention as tp x what one device holds (vLLM keeps some of it whole on every device), so / tp holds
        attention = tp * ar.attention_params_per_device(m, tp)
        dense = sum(attention + (shared if ar.is_moe_layer(m, i) else ar.mlp_params_per_layer(m, i))
                    for i in layers)
        routers = sum(ar.router_params(m, i) for i in layers)
        shard = max(1, tp * self.dp // self.ep)  # devices one expert is split over
        expert_bytes = ar.stored_bytes(m, ar.expert_params(m), wb, gs) / shard if m.moe else 0.0
        whole = len(layers) == m.num_layers
        frac = 1.0 if whole else len(layers) / m.num_layers
        pair = ar.attention_flops_per_pair(m) if whole else 2.0 * m.num_heads * sum(
            ar._attention_head_dims(m)) * len(layers)
        elem = ar.elementwise_bytes_per_token(m, tp)
        return (2.0 * (dense + routers) / tp,
                (ar.stored_bytes(m, dense, wb, gs) + routers * ar.act_bytes(m)) / tp,
                2.0 * ar.expert_params(m) / shard * len(moe_layers) if m.moe else 0.0,
                expert_bytes * len(moe_layers),
                pair / tp,
                ar.kv_bytes_per_token_of_stage(m, self.kv_bits, tp, layers),
                elem if whole else elem * frac,
                ar.lm_head_flops_per_token(m) / tp if last else 0.0,
                ar.embedding_params(m) * ar.act_bytes(m) / tp if last else 0.0,
                m.vocab_size * LOGIT_BYTES / tp if last else 0.0,
                (len(layers), len(moe_layers)))

    def params(self) -> dict[str, Any]:
        """Constructor arguments other than the specs."""
        return {k: getattr(self, k) for k in PARAMS}

    def replace(self, **changes: Any) -> RooflineCostModel:
        return RooflineCostModel(self.model, self.hardware, **{**self.params(), **changes})

    @property
    def kv_bytes_per_token(self) -> float:
        """Per device (of the first stage)."""
        return self._kv_bytes

    @property
    def weight_bytes_per_step(self) -> float:
        """Weights a step with tokens streams per device: decoder linear layers + LM head (not the embedding table)."""
        return self._linear_bytes + self._moe_bytes * (self.moe.num_experts / self.ep if self.moe else 0.0) \
            + self._head_bytes

    GROUPS = ("linear", "moe", "attention_prefill", "attention_decode", "lm_head", "elementwise")

    def _groups(self, f: StepFeatures, stage: tuple | None = None,
                moe_tokens: int | None = None) -> tuple[tuple[float, float], ...]:
        """(FLOPs, bytes) per op group, in GROUPS order, per device of ``stage`` (default: the one of pp=1);
        ``moe_tokens``: the tokens meeting at the MoE layers (default: the step's own). Plain tuples: this runs
        once per step."""
        lin_f, lin_b, moe_f, moe_b, pair_f, kv_b, elem_b, head_f, head_b, logit_b, _ = \
            self._stages[0] if stage is None else stage
        t = f.num_batched_tokens
        moe = (0.0, 0.0)
        if moe_f:
            n = t if moe_tokens is None else moe_tokens
            moe = (moe_f * self.moe.busiest_pairs(n), moe_b * self.moe.experts_touched(n))
        return (
            (lin_f * t, lin_b),
            moe,
            (pair_f * f.attention_pairs, kv_b * f.prefill_kv_tokens),
            (pair_f * f.kv_tokens_read, kv_b * f.kv_tokens_read),
            (head_f * f.num_seqs, head_b + logit_b * f.num_seqs),
            (elem_b * t / self._act_bytes, elem_b * t),
        )

    def ops(self, f: StepFeatures) -> dict[str, OpCost]:
        """FLOPs and bytes of each op group of the step, per device (pp=1; a stage's: ``stage_ops``)."""
        if f.num_batched_tokens == 0:
            return {}
        return {name: OpCost(*fb) for name, fb in zip(self.GROUPS, self._groups(f), strict=True)
                if name != "moe" or self.moe is not None}

    def op_time(self, c: OpCost) -> float:
        return max(c.flops / self._flop_rate, c.bytes / self._byte_rate)

    def comm_times(self, f: StepFeatures, stage: tuple | None = None,
                   moe_tokens: int | None = None) -> dict[str, float]:
        """Seconds of one stage's collectives (default: the one of pp=1): ``allreduce`` (tensor parallelism: after
        attention and after the MLP of every layer, and over the tp x dp ranks sharing the experts of an MoE layer
        when ep = 1 and dp > 1), ``all_to_all`` (ep > 1 with dp > 1: the expert-parallel exchange, an all-gather and
        a reduce-scatter of the ranks' activations per MoE layer), ``send_recv`` (to the next stage; none from the
        last); ``sim.cost.comm.stage_collectives``."""
        stage = self._stages[0] if stage is None else stage
        layers, moe_layers = stage[-1]
        return stage_collectives(self.comm, tokens=f.num_batched_tokens, row_bytes=self._act_row, layers=layers,
                                 moe_layers=moe_layers, tp=self.tp, dp=self.dp, ep=self.ep, moe_tokens=moe_tokens,
                                 last=stage is self._stages[-1])

    def _comm_s(self, f: StepFeatures) -> float:
        """Every collective of the pp=1 step, one float (the hot path)."""
        if self.tp * self.dp * self.pp == 1:
            return 0.0
        c = self.comm_times(f)
        return c["allreduce"] + c["all_to_all"] + c["send_recv"]

    def breakdown(self, f: StepFeatures) -> dict[str, float]:
        """Seconds per op group, plus the collectives (``COMM``), the device-side launches (``kernels``), with
        host_kernel_s > 0 the host time not hidden behind the device (``host_wait``: max(0, host − device) per
        stage), and ``overhead``; they sum to ``step_time`` (pp > 1: the stages' parts summed)."""
        times: dict[str, float] = {}
        if f.num_batched_tokens:
            for stage, kernel_s, host_s in zip(self._stages, self._stage_kernel_s, self.host_s, strict=True):
                parts = {n: max(fl / self._flop_rate, by / self._byte_rate)
                         for n, (fl, by) in zip(self.GROUPS, self._groups(f, stage), strict=True)}
                parts.update(self.comm_times(f, stage))
                parts["kernels"] = kernel_s
                if self.host_kernel_s:
                    parts["host_wait"] = max(0.0, host_s - sum(parts.values()))
                for k, v in parts.items():
                    times[k] = times.get(k, 0.0) + v
            if self.moe is None:
                times.pop("moe")
        else:
            times.update(dict.fromkeys(COMM, 0.0))
            times["kernels"] = 0.0
            if self.host_kernel_s:
                times["host_wait"] = 0.0
        times["overhead"] = self.overhead_s
        return times

    def stage_times(self, f: StepFeatures, moe_tokens: int | None = None) -> list[float]:
        """Seconds each pipeline stage takes for the step: max(device, host), the device time with its send to the
        next stage and its kernel launches (no overhead)."""
        if f.num_batched_tokens == 0:
            return [0.0] * self.pp
        fr, br = self._flop_rate, self._byte_rate
        out = []
        for stage, kernel_s, host_s in zip(self._stages, self._stage_kernel_s, self.host_s, strict=True):
            c = self.comm_times(f, stage, moe_tokens)
            device = sum(max(fl / fr, by / br) for fl, by in self._groups(f, stage, moe_tokens)) \
                + c["allreduce"] + c["all_to_all"] + c["send_recv"] + kernel_s
            out.append(max(device, host_s))
        return out

    def group_step_time(self, features: Sequence[StepFeatures]) -> float:
        """One lockstep step of the dp ranks (``sim.cost.base.lockstep_step_time``)."""
        return lockstep_step_time(self, features)

    def step_time(self, f: StepFeatures) -> float:
        """Same sum as ``breakdown`` without building dicts (the simulator's hot path)."""
        if f.num_batched_tokens == 0:
            return self.overhead_s
        if self.pp > 1:
            return sum(self.stage_times(f)) + self.overhead_s
        fr, br = self._flop_rate, self._byte_rate
        compute = sum(max(fl / fr, by / br) for fl, by in self._groups(f))
        return max(compute + self._comm_s(f) + self._kernel_s, self._host_s) + self.overhead_s

    def decode_step_times(self, first: StepFeatures, num_steps: int) -> list[float]:
        """``step_time`` of a run of decode steps (``sim.cost.base.DecodeCostModel``), bit-identical to the scalar:
        the op groups in ``step_time``'s order, each ``max(FLOPs / rate, bytes / rate)``, summed left to right from
        0, then the max with the host term; only attention decode varies (KV tokens read), as a numpy array, the
        other terms are the scalar floats."""
        if first.num_batched_tokens == 0:
            return [self.overhead_s] * num_steps
        if self.pp > 1:
            return [self.step_time(next_decode(first, m)) for m in range(num_steps)]
        kv, _ = decode_steps(first, num_steps)
        fr, br = self._flop_rate, self._byte_rate
        g = self._groups(first)
        compute = 0 + max(g[0][0] / fr, g[0][1] / br) + max(g[1][0] / fr, g[1][1] / br) \
            + max(g[2][0] / fr, g[2][1] / br)
        t = compute + np.maximum(self._pair_flops * kv / fr, self._kv_bytes * kv / br)
        t = t + max(g[4][0] / fr, g[4][1] / br)
        t = t + max(g[5][0] / fr, g[5][1] / br)
        t = t + self._comm_s(first)
        t = t + self._kernel_s
        t = np.maximum(t, self._host_s)
        t = t + self.overhead_s
        return t.tolist()


def kernels_of_stage(m: ModelSpec, layers: range, first: bool, last: bool) -> int:
    """Kernels one device launches for a step of the stage running ``layers`` (``first``: it embeds the tokens,
    ``last``: it runs the LM head and the sampler); the same at every tp (the module constants count them)."""
    n = 0
    for i in layers:
        if m.moe is not None and ar.is_moe_layer(m, i):
            n += ATTENTION_KERNELS + MOE_MLP_KERNELS + (SHARED_EXPERT_KERNELS if m.moe.num_shared_experts else 0)
        else:
            n += ATTENTION_KERNELS + DENSE_MLP_KERNELS
    return n + (FIRST_STAGE_KERNELS if first else 0) + (LAST_STAGE_KERNELS if last else 0)
