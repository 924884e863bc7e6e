"""CPU fp32 linear layers: which GEMM runs at which row count, and the native small-M GEMM (tw_gemm, cpu_native.c).

Decode steps run GEMMs of a few rows over weights far larger than the caches, so they are bound by how fast the
weights stream from DRAM. Measured on this project's machines (docs/measurements/cpu_engine.md), one thread, the 17
GEMMs of a decode step of the 44M Llama:
- NATIVE_MIN_ROWS..NATIVE_MAX_ROWS rows: the native kernel, over a panel-packed copy of the weight (on huge pages)
  with software prefetch (oneDNN's packed GEMM leaves the weight stream short of bandwidth at these sizes): decode
  steps take 12-16% less time at batch 8 and 32 than on oneDNN.
- 1 row on the 256-bit build: MKL's GEMV on the transposed [in, out] layout (engine.layers.linear_weight).
- more rows (long prefills): oneDNN's packed GEMM, compute-bound, 1.1-1.3x the native kernel at 192-512 rows.
Where the native library is missing (kernels.cpu_native: no compiler, not x86) or ``TWINSERVE_NATIVE_GEMM=0`` is
set (to measure what the kernel brings), oneDNN takes those rows instead.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from kernels.cpu_native import fp32_cpu, huge_page_empty, native_library, unit_stride_rows

# From these row counts the native kernel runs. 512-bit build, from 1 row: one weight copy for every decode batch
# size. With MKL's GEMV (another copy) at 1 row, the first step after the batch size crossed 1 <-> 2 ran on weights
# the other copy had pushed out of cache: tiny-model decode steps right after a batch change took 2.72 ms against
# 2.12 ms steady (native at 1 row: 2.15 and 2.10); and at batch 1 on the 44M model native beat MKL in three
# alternating engine runs (decode step 6.0-6.6 vs 6.7-8.2 ms). 256-bit build: unmeasured at 1 row, MKL stays.
NATIVE_MIN_ROWS = {64: 1, 32: 2}  # vector bytes of the build -> fewest rows it takes
# Above these row counts oneDNN's compute-bound kernels win. 512-bit build, whole engine prefill steps (weights
# come from L3 between layers, where the native kernel's prefetch pays; a hot-cache GEMM loop flatters oneDNN):
# 44M model 1.05x oneDNN at 65 rows, 1.0x at 96-128, 0.88x at 192, 0.87x at 512; the 5M tiny model 1.15x at 65,
# 1.07x at 128, 1.0x at 256. Cutting where both are alike also keeps step time continuous in the row count, which
# a fitted cost model needs (the old cut at 64 put a 20% jump between 64 and 65 tokens on the tiny model).
# 256-bit build: measured only on an AVX-512 CPU (against oneDNN's AVX-512 kernels), 0.93x at 32 rows and 0.7x at
# 64; oneDNN on an AVX2-only CPU is slower than that, so 32 is a conservative cut there.
NATIVE_MAX_ROWS = {64: 128, 32: 32}  # vector bytes of the build -> most rows it takes
# backend.cpu_gemm: "auto" takes the faster GEMM for each row count (above); "native" the native kernel at every row
# count, one packed copy of each weight: a step then costs the same whatever step ran before it. With "auto" a run's
# long prefill (after decodes) finds oneDNN's copy cold where a back-to-back calibration profile finds it warm; on
# the tiny engine "native" with profile_weight 1.0 brought the pipeline's held-out errors from up to 22% to within
# 8%. It costs long prefills: a 4096-token prefill of the 44M model takes 12% longer.
ONEDNN = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


@functools.cache
def gemm_library() -> ctypes.CDLL | None:
    """The native library when it runs GEMMs here: built, and not turned off by ``TWINSERVE_NATIVE_GEMM=0``."""
    return None if os.environ.get("TWINSERVE_NATIVE_GEMM", "1") == "0" else native_library()


def native_gemm_name() -> str:
    """What runs small-batch fp32 GEMMs in this process, for benchmark reports."""
    lib = gemm_library()
    return "onednn" if lib is None else f"native {8 * lib.tw_vector_bytes()}-bit"


def pack_weight(weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
    """W [N, K] (any strides) -> [ceil(N / NR), K, NR] fp32 panels of NR output columns, zero-padded past N."""
    n, k = weight.shape
    nr = lib.tw_panel_width()
    panels = -(-n // nr)
    w = F.pad(weight.detach().float(), (0, 0, 0, panels * nr - n)).view(panels, nr, k).transpose(1, 2)
    return huge_page_empty(w.shape, w.dtype).copy_(w)


def native_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                  lib: ctypes.CDLL) -> torch.Tensor:
    """x [M, K] fp32 @ W^T (+ bias) with W as pack_weight packed it -> [M, out_features]."""
    if not fp32_cpu(x) or x.dim() != 2:
        raise ValueError(f"native_linear takes 2-D float32 CPU rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = unit_stride_rows(x)
    m, k = x.shape
    if packed.shape[1] != k:
        raise ValueError(f"x has {k} features, the packed weight {packed.shape[1]}")
    if packed.shape[0] != -(-out_features // packed.shape[2]):  # the kernel would read past the packed panels
        raise ValueError(f"out_features={out_features} does not fit the packed weight's {packed.shape[0]} panels "
                         f"of {packed.shape[2]} columns")
    out = torch.empty(m, out_features, dtype=torch.float32)
    b = None if bias is None else bias.detach().float().contiguous()
    lib.tw_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), out_features, out.data_ptr(), out_features,
                None if b is None else b.data_ptr(), torch.get_num_threads())
    return out


class CpuLinear:
    """F.linear for one weight, or on CPU with fp32 rows the faster GEMM for the row count (module docstring),
    over packed copies of the weight kept here (one per layer: no process-wide cache) and remade when the weight
    changes (its data pointer or version counter)."""

    __slots__ = ("key", "onednn", "native", "native_only")

    def __init__(self, native_only: bool = False) -> None:
        self.key: tuple[int, int] | None = None
        self.onednn: torch.Tensor | None = None
        self.native: torch.Tensor | None = None
        # the native kernel at every row count (no oneDNN copy): see CPU_GEMMS
        self.native_only = native_only

    def __deepcopy__(self, memo: dict) -> CpuLinear:
        # a cache of the weight: a copied model packs its own (a oneDNN tensor cannot be copied)
        return CpuLinear(self.native_only)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if not fp32_cpu(x, weight) or x.dim() != 2:
            return F.linear(x, weight, bias)
        lib = gemm_library()
        vb = lib.tw_vector_bytes() if lib is not None else 0
        if lib is not None and NATIVE_MIN_ROWS[vb] <= rows and (self.native_only or rows <= NATIVE_MAX_ROWS[vb]):
            self._check(weight)
            return native_linear(x, self._native(weight, lib), weight.shape[0], bias, lib)
        if rows <= 1:  # MKL's GEMV on the transposed layout (or no rows at all)
            return F.linear(x, weight, bias)
        self._check(weight)
        if not ONEDNN:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._onednn(weight), bias, "none", [], "")

    def prepack(self, weight: torch.Tensor) -> None:
        """Make every packed copy a run can use now (engine warm-up), not in the first timed step that needs it."""
        if not fp32_cpu(weight):
            return
        self._check(weight)
        if (lib := gemm_library()) is not None:
            self._native(weight, lib)
        if ONEDNN and not (self.native_only and lib is not None):
            self._onednn(weight)

    def _native(self, weight: torch.Tensor, lib: ctypes.CDLL) -> torch.Tensor:
        if self.native is None:
            self.native = pack_weight(weight, lib)
        return self.native

    def _onednn(self, weight: torch.Tensor) -> torch.Tensor:
        if self.onednn is None:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)
        return self.onednn

    def _check(self, weight: torch.Tensor) -> None:
        """Drop the packed copies of an earlier weight (another tensor, or this one changed in place)."""
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.key, self.onednn, self.native = key, None, None
