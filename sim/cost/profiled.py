"""Step time from published per-operator GPU profiles: the tables LLMServingSim's profiler measured with vLLM 0.19
(``shared/data/gpu-measurements/llmservingsim/<GPU>/<org>/<model>/<variant>/``, ``SOURCES.md`` there), so the
simulator predicts a vLLM run on a GPU it has no access to. ``cost_model=profiled``; the tables are found from
``hardware.name``, the model's name and ``tp``.

What a row is (read from the bundles' ``meta.yaml`` and checked against the numbers):

- Every time is GPU kernel time in microseconds: the CUDA time of the kernels one call of one vLLM module launched
  (vLLM's layer-wise profiler, per invocation), eager mode, dummy weights. No CPU time, no launch gaps.
- The profiled model has ONE decoder layer (``hf_overrides.num_hidden_layers: 1``) and *per-rank* shapes: tensor
  parallelism is emulated on one GPU by dividing heads, KV heads, FFN width and vocabulary by the TP degree. The
  ``hf_overrides`` recorded in ``meta.yaml`` are those of the last degree profiled (``tp_degrees[-1]``), although the
  file covers every ``tp<N>/`` folder: the RTX PRO 6000 Llama-3.1-8B bundle shows 16 heads, 4 KV heads, FFN 7168,
  vocabulary 64128 (half of Llama-3.1-8B), the RTX 4090 one (TP 1 only) the full shapes. ``tp1/`` rows are full-shape
  times (a 1-token ``gate_up_proj`` takes 159 us: its 235 MB at 1.47 TB/s), ``tp2/`` rows half-shape per-rank times
  (80 us). The all-reduces after ``o_proj`` / ``down_proj`` are in no table (one GPU ran the shard: no
  ``all_reduce`` / NCCL row in any ``tp<N>/`` file), so the model adds them for ``tp`` > 1, priced as every
  collective is (``sim.cost.comm``: measured NCCL tables where ``hardware.network_profile`` names one, the hardware's
  peer link otherwise).
- ``dense.csv`` (layer, tokens, time_us): one call of a module on ``tokens`` new tokens of one request without KV
  history. Per step ``embedding`` and ``final_layernorm`` run once; per decoder layer ``layernorm`` runs twice (input
  and post-attention RMSNorm) and every other row (``qkv_proj``, ``rotary_emb``, ``o_proj``, ``gate_up_proj``,
  ``act_fn``, ``down_proj``; Qwen3's ``qk_norm``) once -- the composition of LLMServingSim's own trace generator.
  TP-stable rows (the norms) are copies of ``tp1``'s.
- ``per_sequence.csv`` (layer, sequences, time_us): ``lm_head`` (vLLM's LogitsProcessor: the vocabulary-parallel
  GEMM on each sequence's last hidden state; ``tp2`` a half-vocabulary shard, ~half of ``tp1``) and ``sampler``
  (the full vocabulary, identical in every ``tp<N>``), for ``sequences`` one-token requests. vLLM computes logits
  for every scheduled request, partial prefills included, so a step pays them for ``num_seqs``.
- ``attention.csv`` (prefill_chunk, kv_prefill, n_decode, kv_decode, time_us): one attention-layer call on a batch of
  at most one prefill chunk of ``prefill_chunk`` tokens after ``kv_prefill`` cached ones, plus ``n_decode`` decodes
  each with ``kv_decode`` tokens of history (attending to kv_decode + 1). Zeros mean "none" (pc 0: no prefill, then
  kv_prefill 0; n_decode 0: no decodes, then kv_decode 0). The grid is slices, one per (prefill_chunk, n_decode),
  each the product of its own kv_prefill x kv_decode values: a doubling grid (chunks 16..2048, kv 0, 16..16384) and a
  x1.5 fill-in (chunks 24, 36, ..., 1384, kv 512, 768, ..., 13122 and kv_prefill 0) whose slices start at kv 512;
  n_decode 256 only without a prefill.
- ``skew.csv`` / ``skew_fit.csv``: decode batches of two context lengths (``nb`` at ``kv_big`` = 4 x ``kvs``, the
  rest at ``kvs``) measured with uniform-mean, uniform-max and the real mix: alpha = (t_skew - t_mean) / (t_max -
  t_mean). ``skew_fit.csv`` is alpha fitted per bucket of (pc, n, skew rate, kv_big, kv_prefill), the bins in
  ``meta.yaml`` ``skew_fit.bucket_axes``, ``alpha_default`` per TP for buckets without samples. Disabled bundles
  (the RTX 4090) have none: no correction.
- ``moe.csv`` (tokens, activated_experts, time_us; MoE models, ``tp1`` only): one layer's whole MoE block on
  ``tokens`` tokens whose routing touches ``activated_experts`` distinct experts.

How a step is priced: ``embedding(T) + final_layernorm(T) + L x [per-layer dense rows(T) + attention] + lm_head(S) +
sampler(S)`` (+ ``L x moe(T, experts)``, collectives, launches, ``overhead_s``), with T = ``num_batched_tokens``,
S = ``num_seqs``. Pipeline stages (``pp``) each run their layers' rows (``core.arithmetic.stage_layers``), the embedding
on the first, the final norm, LM head and sampler on the last, and send the activations on; attention data-parallel
ranks (``dp``) with expert parallelism (``ep``) run their own attention and dense rows and meet at the MoE blocks:
the busiest expert group's expert-token pairs and touched experts (``sim.cost.moe.MoELoad``) looked up in
``moe.csv`` as pairs / k tokens, on ep / (tp x dp) of the block's width (``moe_time``). 1-D tables are piecewise
linear in their axis. Attention is looked up at the step's equivalent single chunk and mean decode history, then
corrected for uneven decode contexts (skew); see ``AttentionTable``.

Outside a table: below its smallest value (a 5-token chunk, a decode with 10 tokens of history) the smallest row
holds (a kernel's fixed cost); above its largest (more tokens, sequences or KV than profiled) the table value at the
edge is scaled by the roofline's growth from the edge to the query (``RooflineCostModel``'s op groups: continuous at
the edge, measured efficiency kept). Both are counted per table (``coverage``; metrics.json ``cost_model``).

Kernel launches: the tables are kernel time without the gaps between kernels, which is what vLLM pays when it
replays a CUDA graph. It captures graphs for steps of up to ``cuda_graph_max_tokens`` tokens (its default
min(2 x max_num_seqs, 512, max_num_batched_tokens); 0 = ``enforce_eager``) and runs larger steps (long prefill
chunks) eagerly; those pay ``kernel_s`` (``hardware.kernel_launch_s``) for every kernel they launch
(``sim.cost.roofline.kernels_of_stage``: 12 per dense layer), breakdown key ``kernels``. On the RTX PRO 6000
Llama-3.1-8B run (max_num_seqs 128: graphs up to 256 tokens) that is 389 kernels x 4 us = 1.6 ms per eager step.

``python -m sim.cost.profiled <variant dir> [--tp N] [--every K]`` prints each table's error on rows held back from
its own interpolation (``held_out_errors``).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import functools
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core import arithmetic as ar
from core.batch import StepFeatures
from core.checks import check_float, check_int
from core.specs import HardwareSpec, ModelSpec
from sim.cost.base import as_hardware_spec, as_model_spec, lockstep_step_time
from sim.cost.comm import Comm, stage_collectives
from sim.cost.moe import MoELoad
from sim.cost.roofline import OpCost, RooflineCostModel, kernels_of_stage

US = 1e-6
PROFILE_SOURCE = "llmservingsim"  # the folder of shared/data/gpu-measurements that holds these bundles
ONCE_PER_STEP = ("embedding", "final_layernorm")  # dense.csv rows run once per step, not per layer
TWICE_PER_LAYER = ("layernorm",)  # input and post-attention RMSNorm of each decoder layer
VARIANTS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
PC_COORDINATES = ("pairs", "linear")
# vLLM's CUDA-graph ceiling when none is configured (vllm/config/vllm.py ``_set_cudagraph_sizes``): graphs are captured
# for batches of up to min(2 x max_num_seqs, 512) tokens, never more than max_num_batched_tokens (1024 instead of
# 512 on data-center Blackwell, which no preset here is).
VLLM_GRAPH_CEILING = 512


def vllm_cuda_graph_max_tokens(max_num_seqs: int | None, max_num_batched_tokens: int | None) -> int:
    """The largest step (in tokens) vLLM replays as a CUDA graph by default; larger steps run eagerly."""
    out = VLLM_GRAPH_CEILING if max_num_seqs is None else min(2 * int(max_num_seqs), VLLM_GRAPH_CEILING)
    return out if max_num_batched_tokens is None else min(out, int(max_num_batched_tokens))


def _norm(name: str) -> str:
    """A name without case or punctuation: ``Llama-3.1-8B``, ``llama3_1_8b`` -> ``llama318b``."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


# ---- 1-D tables -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curve:
    """A 1-D table: seconds at ascending ``x``, piecewise linear between rows."""

    x: np.ndarray
    y: np.ndarray

    @classmethod
    def of(cls, xs: Sequence[float], ys: Sequence[float]) -> Curve:
        order = np.argsort(np.asarray(xs, dtype=float), kind="stable")
        x, y = np.asarray(xs, dtype=float)[order], np.asarray(ys, dtype=float)[order]
        if len(x) == 0 or np.any(np.diff(x) <= 0):
            raise ValueError("a 1-D profile table needs distinct x values")
        return cls(x, y)

    @property
    def top(self) -> float:
        return float(self.x[-1])

    def at(self, q: float | np.ndarray) -> float | np.ndarray:
        """The table at ``q`` held within [x0, top] (callers handle beyond the top)."""
        return np.interp(q, self.x, self.y)


# ---- attention ------------------------------------------------------------------------------------------------------
GRID, BELOW, ABOVE = "grid", "below", "above"


def _bracket(values: Sequence[float], q: float) -> tuple[int, int, float]:
    """(lo, hi, weight of hi) of ``q`` within ascending ``values`` (q inside their range)."""
    hi = bisect.bisect_left(values, q)
    if hi < len(values) and values[hi] == q:
        return hi, hi, 0.0
    lo = hi - 1
    return lo, hi, (q - values[lo]) / (values[hi] - values[lo])


@dataclass(frozen=True)
class _Patch:
    """Times on a kv_prefill x kv_decode product grid."""

    kp: tuple[float, ...]
    kd: tuple[float, ...]
    t: tuple[tuple[float, ...], ...]  # t[i][j] at kp[i], kd[j], seconds

    def covers(self, kp: float, kd: float) -> bool:
        return self.kp[0] <= kp <= self.kp[-1] and self.kd[0] <= kd <= self.kd[-1]

    def cell(self, kp: float, kd: float) -> tuple[int, int, float, int, int, float]:
        i0, i1, wi = _bracket(self.kp, kp) if len(self.kp) > 1 else (0, 0, 0.0)
        j0, j1, wj = _bracket(self.kd, kd) if len(self.kd) > 1 else (0, 0, 0.0)
        return i0, i1, wi, j0, j1, wj

    def size(self, kp: float, kd: float) -> float:
        """The area of the grid cell around (kp, kd) (1 on a grid row): the finer patch interpolates."""
        i0, i1, _, j0, j1, _ = self.cell(kp, kd)
        return (self.kp[i1] - self.kp[i0] + 1) * (self.kd[j1] - self.kd[j0] + 1)

    def at(self, kp: float, kd: float) -> float:
        """Bilinear in (kv_prefill, kv_decode); a one-value axis (no prefill / no decodes) is constant."""
        i0, i1, wi, j0, j1, wj = self.cell(kp, kd)
        t = self.t
        a = t[i0][j0] + wj * (t[i0][j1] - t[i0][j0])
        b = t[i1][j0] + wj * (t[i1][j1] - t[i1][j0])
        return a + wi * (b - a)


class _Slice:
    """One (prefill_chunk, n_decode) slice: its rows as product grids. A slice measured on two interleaved grids
    (prefill_chunk 16 has the doubling and the fill-in kv values) is one patch per kv_decode set with every
    kv_prefill row that has it; a query takes the covering patch with the finest cell around it."""

    def __init__(self, cell: Mapping[tuple[float, float], float]) -> None:
        kd_of: dict[float, set[float]] = {}
        for kp, kd in cell:
            kd_of.setdefault(kp, set()).add(kd)
        patches = []
        for kds in {frozenset(v) for v in kd_of.values()}:
            kps = sorted(kp for kp, have in kd_of.items() if kds <= have)
            ks = sorted(kds)
            patches.append(_Patch(tuple(kps), tuple(ks), tuple(tuple(cell[(a, b)] for b in ks) for a in kps)))
        self.patches = sorted(patches, key=lambda p: -len(p.kp) * len(p.kd))
        self.kp = (min(p.kp[0] for p in patches), max(p.kp[-1] for p in patches))
        self.kd = (min(p.kd[0] for p in patches), max(p.kd[-1] for p in patches))

    def _patch(self, kp: float, kd: float) -> _Patch | None:
        covering = [p for p in self.patches if p.covers(kp, kd)]
        if len(covering) <= 1:
            return covering[0] if covering else None
        return min(covering, key=lambda p: p.size(kp, kd))

    def covers(self, kp: float, kd: float) -> bool:
        return self._patch(kp, kd) is not None

    def at(self, kp: float, kd: float) -> float:
        patch = self._patch(kp, kd)
        if patch is None:
            raise ValueError(f"attention slice does not cover kv_prefill={kp}, kv_decode={kd}")
        return patch.at(kp, kd)


@dataclass(frozen=True)
class AttentionPoint:
    """A query of the attention grid: one prefill chunk of ``pc`` tokens (fractional for an equivalent chunk) after
    ``kp`` cached tokens, and ``nd`` decodes with ``kd`` tokens of history each."""

    pc: float
    kp: float
    nd: int
    kd: float


class AttentionTable:
    """``attention.csv`` as slices, looked up multilinearly.

    Axes and their coordinates: ``n_decode``, ``kv_prefill`` and ``kv_decode`` linearly (decode attention reads
    n x (kv + 1) KV tokens, a chunk's cost grows with its cached history: linear in each, so linear interpolation of
    linear data is exact); ``prefill_chunk`` in its attention pairs u = pc x kp + pc (pc + 1) / 2 at the query's kp
    (``pc_coordinate="pairs"``): a chunk without history costs ~pc^2 / 2, which linear interpolation in pc on a
    doubling grid overestimates by up to 11% between rows (``held_out_errors`` compares both). The two bracketing
    values of each axis come from slices that cover the query (the fill-in slices cover kv >= 512 only), so every
    value is a blend of measured rows; a grid row's own value comes back exactly.
    """

    def __init__(self, rows: np.ndarray, pc_coordinate: str = "pairs") -> None:
        """``rows``: (prefill_chunk, kv_prefill, n_decode, kv_decode, seconds) per row."""
        if pc_coordinate not in PC_COORDINATES:
            raise ValueError(f"pc_coordinate={pc_coordinate!r}; allowed: {list(PC_COORDINATES)}")
        self.pc_coordinate = pc_coordinate
        cells: dict[tuple[int, int], dict[tuple[float, float], float]] = {}
        for pc, kp, nd, kd, t in np.asarray(rows, dtype=float).tolist():
            cells.setdefault((int(pc), int(nd)), {})[(kp, kd)] = t
        self.slices = {key: _Slice(cell) for key, cell in cells.items()}
        with_prefill = [k for k in self.slices if k[0] > 0]
        self.nd_prefill = sorted({nd for _, nd in with_prefill})  # n_decode values profiled with a prefill chunk
        self.nd_alone = sorted({nd for pc, nd in self.slices if pc == 0})  # ... without one
        self.pcs_at: dict[int, list[int]] = {}
        for pc, nd in self.slices:
            self.pcs_at.setdefault(nd, []).append(pc)
        for pcs in self.pcs_at.values():
            pcs.sort()
        decode_kd = [s.kd for (_, nd), s in self.slices.items() if nd > 0]
        prefill_kp = [s.kp for (pc, _), s in self.slices.items() if pc > 0]
        self.kd_range = (min(k[0] for k in decode_kd), max(k[-1] for k in decode_kd)) if decode_kd else (0.0, 0.0)
        self.kp_range = (min(k[0] for k in prefill_kp), max(k[-1] for k in prefill_kp)) if prefill_kp else (0.0, 0.0)
        self.pc_max = max((pc for pc, _ in self.slices), default=0)
        patches = [p for s in self.slices.values() for p in s.patches]
        self._kp_edges = sorted({v for p in patches for v in (p.kp[0], p.kp[-1])})
        self._kd_edges = sorted({v for p in patches for v in (p.kd[0], p.kd[-1])})
        self._eligible: dict[tuple[int, ...], list[int]] = {}

    @classmethod
    def from_csv(cls, path: Path) -> AttentionTable:
        return cls(attention_rows(path))

    def _u(self, pc: float, kp: float) -> float:
        return pc * kp + pc * (pc + 1) / 2 if self.pc_coordinate == "pairs" else pc

    def clamp(self, q: AttentionPoint) -> tuple[AttentionPoint, str]:
        """``q`` held inside the profiled ranges, and whether it was: ``grid`` (inside), ``below`` (raised to the
        smallest profiled value somewhere) or ``above`` (lowered to the largest; takes precedence)."""
        status = GRID
        pc, kp, nd, kd = q.pc, q.kp, q.nd, q.kd
        nds = self.nd_prefill if pc > 0 else self.nd_alone
        if not nds:
            raise ValueError("the attention table has no slice for this kind of batch "
                             f"({'with' if pc > 0 else 'without'} a prefill chunk)")
        if nd > nds[-1]:
            nd, status = nds[-1], ABOVE
        if pc > self.pc_max:
            pc, status = self.pc_max, ABOVE
        if pc > 0 and kp > self.kp_range[1]:
            kp, status = self.kp_range[1], ABOVE
        if nd > 0 and kd > self.kd_range[1]:
            kd, status = self.kd_range[1], ABOVE
        if nd > 0 and kd < self.kd_range[0]:
            kd, status = self.kd_range[0], status if status == ABOVE else BELOW
        return AttentionPoint(pc, kp if pc > 0 else 0.0, nd, kd if nd > 0 else 0.0), status

    def _pc_pair(self, pc: float, kp: float, kd: float, nd_lo: int, nd_hi: int) -> tuple[int, int, float, bool]:
        """The bracketing chunk sizes among slices covering (kp, kd) at both n_decode values, the weight of the upper
        one, and whether ``pc`` sat below the smallest (held there)."""
        # which slices cover (kp, kd) changes only where kp or kd crosses a patch's first or last value
        kpe, kde = self._kp_edges, self._kd_edges
        key = (nd_lo, nd_hi, bisect.bisect_left(kpe, kp), bisect.bisect_right(kpe, kp),
               bisect.bisect_left(kde, kd), bisect.bisect_right(kde, kd))
        pcs = self._eligible.get(key)
        if pcs is None:
            pcs = self._eligible[key] = [p for p in self.pcs_at.get(nd_lo, ()) if (p, nd_hi) in self.slices
                                         and self._covers(p, nd_lo, kp, kd) and self._covers(p, nd_hi, kp, kd)]
        if not pcs:
            raise ValueError(f"no attention slice covers kv_prefill={kp}, kv_decode={kd} at n_decode {nd_lo}..{nd_hi}")
        if pc <= pcs[0]:
            return pcs[0], pcs[0], 0.0, pc < pcs[0]
        if pc >= pcs[-1]:
            return pcs[-1], pcs[-1], 0.0, False
        hi = bisect.bisect_left(pcs, pc)
        if pcs[hi] == pc:
            return pcs[hi], pcs[hi], 0.0, False
        p0, p1 = pcs[hi - 1], pcs[hi]
        u0, u1 = self._u(p0, kp), self._u(p1, kp)
        return p0, p1, (self._u(pc, kp) - u0) / (u1 - u0), False

    def _covers(self, pc: int, nd: int, kp: float, kd: float) -> bool:
        s = self.slices[(pc, nd)]
        return s.covers(*self._in(s, pc, nd, kp, kd))

    @staticmethod
    def _in(s: _Slice, pc: int, nd: int, kp: float, kd: float) -> tuple[float, float]:
        """The slice's own (kp, kd) for a query: no prefill (pc 0) has kv_prefill 0 only, no decodes kv_decode 0."""
        return (kp if pc > 0 else s.kp[0]), (kd if nd > 0 else s.kd[0])

    def lookup(self, q: AttentionPoint) -> tuple[float, AttentionPoint, str]:
        """Seconds of one attention layer at ``q`` clamped into the grid (``clamp``), the clamped point and the
        status; the caller scales an ``above`` value."""
        c, status = self.clamp(q)
        nds = self.nd_prefill if c.pc > 0 else self.nd_alone
        if c.nd < nds[0]:
            nd_lo = nd_hi = nds[0]
            w_nd = 0.0
            status = status if status == ABOVE else BELOW
        else:
            nd_lo, nd_hi, w_nd = _bracket(nds, c.nd)
            nd_lo, nd_hi = nds[nd_lo], nds[nd_hi]
        p0, p1, w_pc, below = self._pc_pair(c.pc, c.kp, c.kd, nd_lo, nd_hi)
        if below and status == GRID:
            status = BELOW
        lo = self._blend(p0, nd_lo, nd_hi, w_nd, c)
        if p1 == p0:
            return lo, c, status
        return lo + w_pc * (self._blend(p1, nd_lo, nd_hi, w_nd, c) - lo), c, status

    def _blend(self, pc: int, nd_lo: int, nd_hi: int, w_nd: float, q: AttentionPoint) -> float:
        a, b = self.slices[(pc, nd_lo)], self.slices[(pc, nd_hi)]
        lo = a.at(*self._in(a, pc, nd_lo, q.kp, q.kd))
        return lo if nd_hi == nd_lo else lo + w_nd * (b.at(*self._in(b, pc, nd_hi, q.kp, q.kd)) - lo)


def equivalent_chunk(num_tokens: int, pairs: int) -> tuple[float, float]:
    """(chunk tokens, cached tokens) of the one prefill chunk with the step's prefill tokens and attention pairs, the
    work of a FlashAttention varlen call: a single chunk of n after c cached tokens is itself (n, c); several chunks
    after cached histories share n = their tokens and c = (pairs - n (n + 1) / 2) / n. Several fresh chunks have
    fewer pairs than one chunk of all their tokens: then no history and the chunk size whose pairs they are."""
    if num_tokens <= 0:
        return 0.0, 0.0
    n = float(num_tokens)
    excess = pairs - n * (n + 1) / 2
    if excess >= 0:
        return n, excess / n
    return (math.sqrt(1 + 8 * pairs) - 1) / 2, 0.0


# ---- skew correction ------------------------------------------------------------------------------------------------
def _label(bins: Sequence[float], labels: Sequence[str], value: float) -> str:
    """The bucket of ``value``: bins are (bins[i], bins[i + 1]], inclusive on the right (the fit's convention)."""
    for i, lab in enumerate(labels):
        if value <= bins[i + 1]:
            return lab
    return labels[-1]


class SkewTable:
    """``skew_fit.csv``: alpha per bucket key ``pc={pc}|{n}|{skew rate}|{kv_big}|{kv_prefill}`` (labels rebuilt
    from ``meta.yaml`` ``skew_fit.bucket_axes``), ``alpha_default`` for a bucket the fit has no samples for. The
    fit's pc buckets are its profiled chunk sizes; a step's chunk goes to the nearest (in log scale), where the fit's
    own lookup would miss every chunk size it did not profile and fall back to the pooled alpha."""

    def __init__(self, alphas: Mapping[str, float], axes: Mapping[str, Sequence], alpha_default: float) -> None:
        self.alphas, self.axes, self.alpha_default = dict(alphas), axes, float(alpha_default)
        self.pcs = sorted({int(k.split("|", 1)[0].removeprefix("pc=")) for k in self.alphas})

    def _pc(self, pc: float) -> int:
        if pc <= 0 or not self.pcs:
            return 0
        positive = [p for p in self.pcs if p > 0]
        if not positive:
            return 0
        return min(positive, key=lambda p: abs(math.log(p / pc)))

    def alpha(self, pc: float, n: int, rate: float, kv_big: float, kp: float) -> float:
        a = self.axes
        key = "|".join((f"pc={self._pc(pc)}", _label(a["n_bins"], a["n_labels"], n),
                        _label(a["skew_rate_bins"], a["skew_rate_labels"], min(1.0, max(0.0, rate))),
                        _label(a["kv_big_bins"], a["kv_big_labels"], kv_big), _label(a["kp_bins"], a["kp_labels"], kp)))
        return self.alphas.get(key, self.alpha_default)


# ---- MoE ------------------------------------------------------------------------------------------------------------
def moe_from_tp1(tables: ProfileTables, variant_dir: Path, tp: int) -> ProfileTables:
    """A TP folder without ``moe.csv`` (the bundles profile the MoE block at TP 1 only) priced from ``tp1``'s: under
    tensor parallelism every expert's FFN is split by width across the ``tp`` ranks, so each rank reads 1/tp of the
    activated experts' weights and does 1/tp of their FLOPs: the TP 1 block's time / tp (a kernel's fixed cost does
    not shrink: a small lower-bound bias at a few tokens). The all-reduce after the block is priced as the dense
    layers' is."""
    import dataclasses

    one = load_tables(str(variant_dir), 1)
    if one.moe is None:
        raise ValueError(f"{tables.directory}: a MoE model's profile without moe.csv here or in tp1/")
    rows = [(x, e, t / tp) for e, c in one.moe.curves.items() for x, t in zip(c.x.tolist(), c.y.tolist(), strict=True)]
    return dataclasses.replace(tables, moe=MoETable(np.array(rows)))


class MoETable:
    """``moe.csv``: one layer's MoE block by (tokens, distinct experts activated): per activated-experts row a curve
    in tokens, linear between rows."""

    def __init__(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=float)
        self.experts = sorted({int(e) for e in rows[:, 1]})
        self.curves = {e: Curve.of(rows[rows[:, 1] == e, 0], rows[rows[:, 1] == e, 2]) for e in self.experts}

    @property
    def top(self) -> float:
        return min(c.top for c in self.curves.values())

    def at(self, tokens: float, experts: float) -> float:
        e = min(max(experts, self.experts[0]), self.experts[-1])
        i0, i1, w = _bracket(self.experts, e)
        a, b = self.curves[self.experts[i0]], self.curves[self.experts[i1]]
        lo = float(a.at(max(tokens, a.x[0])))
        return lo + w * (float(b.at(max(tokens, b.x[0]))) - lo)


def activated_experts(tokens: int | np.ndarray, num_experts: int, experts_per_token: int) -> float | np.ndarray:
    """Expected distinct experts ``tokens`` tokens route to when each picks ``experts_per_token`` of
    ``num_experts`` uniformly: E (1 - (1 - k / E)^T)."""
    return num_experts * (1 - (1 - experts_per_token / num_experts) ** np.asarray(tokens, dtype=float))


# ---- reading a bundle -----------------------------------------------------------------------------------------------
def _csv_rows(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; header {reader.fieldnames}")
        return list(reader)


def attention_rows(path: Path) -> np.ndarray:
    """``attention.csv`` as (prefill_chunk, kv_prefill, n_decode, kv_decode, seconds) rows."""
    cols = ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us")
    rows = np.array([[float(r[c]) for c in cols] for r in _csv_rows(path, cols)])
    rows[:, 4] *= US
    return rows


def _curves(path: Path, key: str) -> dict[str, Curve]:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for r in _csv_rows(path, ("layer", key, "time_us")):
        xs, ys = groups.setdefault(r["layer"], ([], []))
        xs.append(float(r[key]))
        ys.append(float(r["time_us"]) * US)
    return {name: Curve.of(xs, ys) for name, (xs, ys) in groups.items()}


@dataclass(frozen=True)
class ProfileTables:
    """The parsed tables of one ``<variant>/tp<N>`` folder (read once per folder: ``load_tables``)."""

    directory: Path
    tp: int
    meta: dict[str, Any]
    dense: dict[str, Curve]
    per_sequence: dict[str, Curve]
    attention: AttentionTable
    skew: SkewTable | None
    moe: MoETable | None


@functools.cache
def load_tables(variant_dir: str, tp: int) -> ProfileTables:
    """Parse ``variant_dir/tp<tp>`` (cached per folder: a sweep builds many cost models on the same tables)."""
    root = Path(variant_dir)
    meta = yaml.safe_load((root / "meta.yaml").read_text())
    d = root / f"tp{tp}"
    if not d.is_dir():
        have = sorted(p.name for p in root.glob("tp*") if p.is_dir())
        raise ValueError(f"parallel.tp={tp}: no {d.name}/ in {root}; profiled: {have}")
    skew = None
    fit = meta.get("skew_fit") or {}
    if fit.get("enabled") and (d / "skew_fit.csv").is_file():
        entry = (fit.get("per_tp") or {}).get(tp) or {}
        alphas = {f"pc={int(r['pc'])}|{r['n_label']}|{r['skew_rate_label']}|{r['kv_big_label']}|{r['kp_label']}":
                  float(r["alpha"])
                  for r in _csv_rows(d / "skew_fit.csv", ("pc", "n_label", "skew_rate_label", "kv_big_label",
                                                          "kp_label", "alpha"))}
        skew = SkewTable(alphas, entry.get("bucket_axes") or fit["bucket_axes"], entry.get("alpha_default", 0.0))
    moe = None
    if (d / "moe.csv").is_file():
        rows = [(float(r["tokens"]), float(r["activated_experts"]), float(r["time_us"]) * US)
                for r in _csv_rows(d / "moe.csv", ("tokens", "activated_experts", "time_us"))]
        moe = MoETable(np.array(rows))
    return ProfileTables(d, tp, meta, _curves(d / "dense.csv", "tokens"), _curves(d / "per_sequence.csv", "sequences"),
                         AttentionTable.from_csv(d / "attention.csv"), skew, moe)


def _choose(parent: Path, want: str, what: str, key: str, dirs: Sequence[Path]) -> Path:
    """The folder named ``want`` (no case or punctuation); else the one folder whose name extends it (a model's
    fine-tune of the same shapes, ``qwen3_30b_a3b`` -> ``Qwen3-30B-A3B-Instruct-2507``: ``check_shapes`` then
    verifies the shapes)."""
    match = [p for p in dirs if _norm(p.name) == _norm(want)]
    if not match:
        match = [p for p in dirs if _norm(p.name).startswith(_norm(want))]
        if len(match) > 1:
            raise ValueError(f"{key}={want!r}: several published {what} profiles under {parent} extend the name: "
                             f"{sorted(str(p.relative_to(parent)) for p in match)}; name one exactly")
    if not match:
        names = sorted(str(p.relative_to(parent)) for p in dirs)
        raise ValueError(f"{key}={want!r}: no published {what} profile under {parent}; available: {names}")
    return match[0]


def find_profile(hardware: str, model: str, variant: str, root: str | Path) -> Path:
    """The variant folder of ``root/<GPU>/<org>/<model>/<variant>`` for a hardware and a model name, matched without
    case or punctuation (``rtxpro6000`` -> ``RTXPRO6000``, ``llama3_1_8b`` -> ``meta-llama/Llama-3.1-8B``); a clear
    error naming the folder and what it has otherwise. ``root``: the published profiles (the run builder gives
    ``shared/data/gpu-measurements/llmservingsim`` when ``cost_model.data_dir`` is null)."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"cost_model.data_dir: no profile folder {base}")
    gpu = _choose(base, hardware, "GPU", "hardware.name", [p for p in base.iterdir() if p.is_dir()])
    models = [m for org in gpu.iterdir() if org.is_dir() for m in org.iterdir() if m.is_dir()]
    chosen = _choose(gpu, model, "model", "model.name", models)
    folder = chosen / variant
    if not (folder / "meta.yaml").is_file():
        have = sorted(p.name for p in chosen.iterdir() if (p / "meta.yaml").is_file())
        raise ValueError(f"cost_model.variant={variant!r}: no {folder}; profiled variants: {have}")
    return folder


def check_shapes(meta: Mapping[str, Any], model: ModelSpec, where: Path) -> None:
    """The bundle's ``hf_overrides`` are ``model``'s shapes divided by the last TP degree profiled (see the module
    docstring); anything else is a profile of another model."""
    over = (meta.get("engine_effective") or {}).get("hf_overrides") or {}
    tp_last = int((meta.get("tp_degrees") or [1])[-1])
    want = {"num_attention_heads": model.num_heads // tp_last,
            "num_key_value_heads": max(1, model.num_kv_heads // tp_last),
            "intermediate_size": model.intermediate_size // tp_last, "vocab_size": model.vocab_size // tp_last}
    bad = {k: (over[k], v) for k, v in want.items() if k in over and int(over[k]) != v}
    if bad:
        raise ValueError(f"{where}/meta.yaml profiles other shapes than model {model.name} (per-rank at tp "
                         f"{tp_last}: {{key: (profiled, expected)}} {bad})")


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


# ---- held-out error of the tables' own interpolation ---------------------------------------------------------------
def _held(n: int, every: int) -> list[int]:
    """Interior indices k, 2k, 3k, ... below n - 1 (the ends stay: held-back rows are inside the rest's range)."""
    return [i for i in range(every, n - 1, every)]


def _summary(rel: Sequence[float]) -> dict[str, float | int]:
    r = np.abs(np.asarray(rel, dtype=float))
    if not len(r):
        return {"rows": 0, "median": float("nan"), "p90": float("nan"), "signed_median": float("nan")}
    return {"rows": len(r), "median": float(np.median(r)), "p90": float(np.percentile(r, 90)),
            "signed_median": float(np.median(np.asarray(rel, dtype=float)))}


def curve_held_out(curve: Curve, every: int = 2) -> list[float]:
    """Signed relative errors of the held-back rows of a 1-D table, each predicted from the rest."""
    held = _held(len(curve.x), every)
    keep = np.setdiff1d(np.arange(len(curve.x)), held)
    rest = Curve(curve.x[keep], curve.y[keep])
    return [(float(rest.at(curve.x[i])) - float(curve.y[i])) / float(curve.y[i]) for i in held]


def attention_held_out(rows: np.ndarray, axis: int, every: int = 2, pc_coordinate: str = "pairs") -> list[float]:
    """Signed relative errors of the rows at every ``every``-th interior value of one axis (0 prefill_chunk,
    1 kv_prefill, 2 n_decode, 3 kv_decode; zeros never held back), predicted by a table built from the rest.
    A row the rest cannot bracket (no covering slice on both sides) is skipped."""
    values = sorted({v for v in rows[:, axis].tolist() if v > 0})
    held = {values[i] for i in _held(len(values), every)}
    mask = np.isin(rows[:, axis], list(held))
    table = AttentionTable(rows[~mask], pc_coordinate)
    out = []
    for pc, kp, nd, kd, t in rows[mask].tolist():
        q = AttentionPoint(pc, kp, int(nd), kd)
        try:
            value, _, status = table.lookup(q)
        except ValueError:
            continue
        if status == GRID:
            out.append((value - t) / t)
    return out


def held_out_errors(variant_dir: str | Path, tp: int = 1, every: int = 2) -> dict[str, dict[str, float | int]]:
    """Each table's relative error on rows held back from its own interpolation: every ``every``-th interior row
    of each 1-D table (dense layers, LM head, sampler; MoE per activated-experts row), every ``every``-th interior
    value of each attention axis (plus the prefill-chunk axis interpolated linearly in tokens, for comparison), and
    the skew table's in-sample error on skew.csv (its alpha vs none: the fit was made on these rows)."""
    tabs = load_tables(str(Path(variant_dir).resolve()), tp)
    out: dict[str, dict[str, float | int]] = {}
    dense = {n: curve_held_out(c, every) for n, c in tabs.dense.items()}
    out["dense (all rows)"] = _summary([e for v in dense.values() for e in v])
    for n, errs in dense.items():
        out[f"dense {n}"] = _summary(errs)
    for n, c in tabs.per_sequence.items():
        out[f"per_sequence {n}"] = _summary(curve_held_out(c, every))
    rows = attention_rows(tabs.directory / "attention.csv")
    for axis, name in enumerate(("prefill_chunk", "kv_prefill", "n_decode", "kv_decode")):
        out[f"attention {name}"] = _summary(attention_held_out(rows, axis, every))
    out["attention prefill_chunk (linear in tokens)"] = _summary(attention_held_out(rows, 0, every, "linear"))
    if tabs.moe is not None:
        out["moe"] = _summary([e for c in tabs.moe.curves.values() for e in curve_held_out(c, every)])
    if tabs.skew is not None and (tabs.directory / "skew.csv").is_file():
        with_alpha, without = [], []
        for r in _csv_rows(tabs.directory / "skew.csv", ("n", "ratio", "pc", "kp", "kv_big", "t_mean_us",
                                                          "t_max_us", "t_skew_us")):
            t_mean, t_max, t_skew = float(r["t_mean_us"]), float(r["t_max_us"]), float(r["t_skew_us"])
            a = tabs.skew.alpha(float(r["pc"]), int(r["n"]), float(r["ratio"]), float(r["kv_big"]), float(r["kp"]))
            with_alpha.append((t_mean + a * (t_max - t_mean) - t_skew) / t_skew)
            without.append((t_mean - t_skew) / t_skew)
        out["skew (alpha table, in-sample)"] = _summary(with_alpha)
        out["skew (no correction)"] = _summary(without)
    return out


def format_held_out(errors: Mapping[str, Mapping[str, float | int]]) -> str:
    """The held-out errors as a markdown table."""
    lines = ["| table | rows | median | p90 | signed median |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['rows']} | {v['median']:.1%} | {v['p90']:.1%} | {v['signed_median']:+.1%} |"
              for k, v in errors.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Held-out error of a published operator profile's own interpolation.")
    p.add_argument("variant_dir", type=Path, help="e.g. ../shared/data/gpu-measurements/llmservingsim/RTXPRO6000/"
                                                   "meta-llama/Llama-3.1-8B/bf16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--every", type=int, default=2, help="hold back every k-th interior row / grid value")
    args = p.parse_args(argv)
    print(format_held_out(held_out_errors(args.variant_dir, args.tp, args.every)))


if __name__ == "__main__":
    main()
