"""The published per-operator GPU profiles (LLMServingSim's profiler, vLLM 0.19;
``shared/data/gpu-measurements/llmservingsim/<GPU>/<org>/<model>/<variant>/``, ``SOURCES.md`` there), read into
tables that ``sim.cost.profiled`` prices steps from: the 1-D tables, the attention grid, the skew correction, the
MoE block; the search for a bundle by hardware and model name; each table's error on rows held back from its own
interpolation.

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
  ``all_reduce`` / NCCL row in any ``tp<N>/`` file), so ``sim.cost.profiled`` adds them for ``tp`` > 1, priced as every
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

Outside a table: below its smallest value (a 5-token chunk, a decode with 10 tokens of history) the smallest row
holds (a kernel's fixed cost); above its largest (more tokens, sequences or KV than profiled) the table value at the
edge is scaled by the roofline's growth from the edge to the query (``RooflineCostModel``'s op groups: continuous at
the edge, measured efficiency kept). Both are counted per table (``coverage``; metrics.json ``cost_model``).

``python -m sim.cost.profile_tables <variant dir> [--tp N] [--every K]`` prints each table's error on rows held back
from its own interpolation (``held_out_errors``).
"""

from __future__ import annotations

import argparse
import bisect
import csv
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.specs import ModelSpec

US = 1e-6
VARIANTS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
PC_COORDINATES = ("pairs", "linear")


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
