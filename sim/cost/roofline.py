"""Roofline step time: each op group costs max(compute time, memory time); a step is their sum plus overhead.

All quantities are per device: tensor parallelism splits weights, heads, FLOPs and KV across ``tp`` devices and
adds two ring all-reduces of the activations per layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_float, check_fraction
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import as_hardware_spec, as_model_spec, decode_steps

LOGIT_BYTES = 4  # logits are written in float32
ALLREDUCES_PER_LAYER = 2  # after attention and after the MLP (Megatron-style tensor parallelism)
TARGET = "sim.cost.roofline.RooflineCostModel"
PARAMS = ("compute_eff", "bw_eff", "overhead_s", "weight_bits", "kv_bits", "group_size", "tp")  # besides the specs


@dataclass(frozen=True)
class OpCost:
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


class RooflineCostModel:
    """Op groups: linear layers, attention prefill, attention decode, LM head, norms/elementwise.

    Assumptions: the LM head computes one logits row per scheduled sequence (``num_seqs``: every decode and every
    prefill chunk, as vLLM does before discarding a partial prefill's sample); the embedding lookup and
    all-reduce latency are ignored; quantised weights are dequantised to compute at 16-bit peak (weight-only
    quantisation saves bytes, not FLOPs). A step with no tokens costs ``overhead_s``.

    Bytes are what the engine stores, from ``core.arithmetic``: with ``weight_bits`` 4 (the engine's W4A16) or 8
    (a what-if format: the engine has no W8 path) each group of ``group_size`` linear weights carries a 16-bit
    scale and a 16-bit zero point, counted the same way for both widths; ``kv_bits`` 8 (the engine's int8 KV) reads
    one float32 scale per token and KV head for K and for V besides the int8 elements, so its KV reads are
    (Dh + 4) / (2·Dh) of 16-bit KV's, not half.
    """

    def __init__(self, model: ModelSpec | Mapping[str, Any], hardware: HardwareSpec | Mapping[str, Any],
                 compute_eff: float = 0.7, bw_eff: float = 0.75, overhead_s: float = 1e-3, weight_bits: int = 16,
                 kv_bits: int = 16, group_size: int = 128, tp: int = 1) -> None:
        m, hw = as_model_spec(model), as_hardware_spec(hardware)
        self.model, self.hardware = m, hw
        self.compute_eff = check_fraction(compute_eff, "cost_model.compute_eff")
        self.bw_eff = check_fraction(bw_eff, "cost_model.bw_eff")
        self.overhead_s = check_float(overhead_s, "cost_model.overhead_s", 0.0)
        ar.check_quant(weight_bits, kv_bits, group_size)
        self.weight_bits, self.kv_bits, self.group_size = weight_bits, kv_bits, group_size
        ar.kv_heads_per_device(m, tp)  # validates tp
        if tp > 1 and hw.interconnect_bw <= 0:
            raise ValueError(f"parallel.tp={tp} needs hardware.interconnect_bw > 0 ({hw.name} has 0)")
        self.tp = tp

        self._flop_rate = hw.peak_flops * self.compute_eff
        self._byte_rate = hw.mem_bw * self.bw_eff
        self._linear_flops = ar.linear_flops_per_token(m) / tp
        self._linear_bytes = ar.linear_weight_bytes(m, weight_bits, group_size) / tp
        self._head_flops = ar.lm_head_flops_per_token(m) / tp
        self._head_bytes = ar.embedding_params(m) * ar.act_bytes(m) / tp
        self._logit_bytes = m.vocab_size * LOGIT_BYTES / tp
        self._pair_flops = ar.attention_flops_per_pair(m) / tp
        self._kv_bytes = ar.kv_bytes_per_token_per_device(m, kv_bits, tp)
        self._elem_bytes = ar.elementwise_bytes_per_token(m, tp)
        self._act_bytes = ar.act_bytes(m)
        ring = 2 * (tp - 1) / tp  # bytes each device sends per byte reduced, ring all-reduce
        self._allreduce_s_per_token = (ALLREDUCES_PER_LAYER * m.num_layers * ring * m.hidden_size * ar.act_bytes(m)
                                       / hw.interconnect_bw) if tp > 1 else 0.0

    def params(self) -> dict[str, Any]:
        """Constructor arguments other than the specs."""
        return {k: getattr(self, k) for k in PARAMS}

    def replace(self, **changes: Any) -> RooflineCostModel:
        return RooflineCostModel(self.model, self.hardware, **{**self.params(), **changes})

    @property
    def kv_bytes_per_token(self) -> float:
        """Per device."""
        return self._kv_bytes

    @property
    def weight_bytes_per_step(self) -> float:
        """Weights a step with tokens streams per device: decoder linear layers + LM head (not the embedding table)."""
        return self._linear_bytes + self._head_bytes

    GROUPS = ("linear", "attention_prefill", "attention_decode", "lm_head", "elementwise")

    def _groups(self, f: StepFeatures) -> tuple[tuple[float, float], ...]:
        """(FLOPs, bytes) per op group, in GROUPS order, per device. Plain tuples: this runs once per step."""
        t = f.num_batched_tokens
        return (
            (self._linear_flops * t, self._linear_bytes),
            (self._pair_flops * f.attention_pairs, self._kv_bytes * f.prefill_kv_tokens),
            (self._pair_flops * f.kv_tokens_read, self._kv_bytes * f.kv_tokens_read),
            (self._head_flops * f.num_seqs, self._head_bytes + self._logit_bytes * f.num_seqs),
            (self._elem_bytes * t / self._act_bytes, self._elem_bytes * t),
        )

    def ops(self, f: StepFeatures) -> dict[str, OpCost]:
        """FLOPs and bytes of each op group of the step, per device."""
        if f.num_batched_tokens == 0:
            return {}
        return {name: OpCost(*fb) for name, fb in zip(self.GROUPS, self._groups(f), strict=True)}

    def op_time(self, c: OpCost) -> float:
        return max(c.flops / self._flop_rate, c.bytes / self._byte_rate)

    def breakdown(self, f: StepFeatures) -> dict[str, float]:
        """Seconds per op group, plus ``allreduce`` and ``overhead``; they sum to ``step_time``."""
        times = {name: self.op_time(c) for name, c in self.ops(f).items()}
        times["allreduce"] = self._allreduce_s_per_token * f.num_batched_tokens
        times["overhead"] = self.overhead_s
        return times

    def step_time(self, f: StepFeatures) -> float:
        """Same sum as ``breakdown`` without building dicts (the simulator's hot path)."""
        if f.num_batched_tokens == 0:
            return self.overhead_s
        fr, br = self._flop_rate, self._byte_rate
        compute = sum(max(fl / fr, by / br) for fl, by in self._groups(f))
        return compute + self._allreduce_s_per_token * f.num_batched_tokens + self.overhead_s

    def decode_step_times(self, first: StepFeatures, num_steps: int) -> list[float]:
        """``step_time`` of a run of decode steps (``sim.cost.base.DecodeCostModel``), bit-identical to the scalar:
        the op groups in ``step_time``'s order, each ``max(FLOPs / rate, bytes / rate)``, summed left to right from
        0; only attention decode varies (KV tokens read), as a numpy array, the other terms are the scalar floats."""
        if first.num_batched_tokens == 0:
            return [self.overhead_s] * num_steps
        kv, _ = decode_steps(first, num_steps)
        fr, br = self._flop_rate, self._byte_rate
        g = self._groups(first)
        compute = 0 + max(g[0][0] / fr, g[0][1] / br) + max(g[1][0] / fr, g[1][1] / br)
        t = compute + np.maximum(self._pair_flops * kv / fr, self._kv_bytes * kv / br)
        t = t + max(g[3][0] / fr, g[3][1] / br)
        t = t + max(g[4][0] / fr, g[4][1] / br)
        t = t + self._allreduce_s_per_token * first.num_batched_tokens
        t = t + self.overhead_s
        return t.tolist()
