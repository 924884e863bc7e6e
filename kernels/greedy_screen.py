"""Exact greedy tokens through an int8 screen of the LM head (cpu_screen.c; x86 CPUs with AVX2, fp32 models).

A greedy decode needs each row's argmax over the vocabulary, not its logits. ``GreedyScreen`` computes every logit
approximately from an int8 copy of the LM head with a rigorous bound on the error, and recomputes in fp32 only
the tokens whose upper bound reaches the best lower bound, each with the native GEMM's own arithmetic. The token is
the argmax of the native GEMM's fp32 logits bit for bit (the first index on ties) for any weights and inputs; the
screen only decides how many tokens get recomputed (a handful per row when the top logit stands clear of the rest
by more than the bound, up to all of them when it does not).

Why: the LM head is the largest weight a small model's decode step reads (32000 x 512 fp32 is 65.5 MB against
47 MB for all layers of the 44M Llama) and at batch 32 the largest GEMM. The int8 copy is a quarter of those bytes
and int8 multiply-adds run at 2-4x the fp32 rate (AVX-512 VNNI: 64 per instruction; AVX2: 32 per two). Measured
in docs/measurements/cpu_engine.md.

The cost is memory: the int8 panels (N K bytes) and a row-major fp32 copy of the weight when the model's own is
not row-major (the recomputed rows are read one by one).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels.cpu_native import fp32_cpu, huge_page_empty, native_library, unit_stride_rows

# The int32 dot products are exact while K * 255 * 127 < 2**31 (x as unsigned bytes, weights within +-127).
MAX_FEATURES = 65536
PACK_ROWS = 4096  # weight rows quantised at a time (float64 temporaries)


@functools.cache
def screen_library() -> ctypes.CDLL | None:
    """The native library when its build runs the screen (AVX-512 VNNI or AVX2), else None."""
    lib = native_library()
    return lib if lib is not None and lib.tw_screen_available() else None


def _up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 rounded up (a bound stays a bound)."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.tensor(float("inf"))), f)


class ScreenWeights:
    """One LM head weight [N, K], packed for the screen."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL) -> None:
        n, k = weight.shape
        nr = lib.tw_screen_panel_width()
        k4, npad = -(-k // 4), -(-n // nr) * nr
        self.n, self.k = n, k
        self.panels = huge_page_empty((npad // nr, k4, nr, 4), torch.int8)
        self.scale, self.dw, self.w2 = (torch.zeros(npad) for _ in range(3))  # see cpu_screen.c
        self.wsum = torch.zeros(npad, dtype=torch.int32)
        for a in range(0, npad, PACK_ROWS):  # PACK_ROWS is a multiple of nr: whole panels per chunk
            b = min(a + PACK_ROWS, npad)
            w = F.pad(weight[a:min(b, n)].detach().double(), (0, 4 * k4 - k, 0, b - min(b, n)))
            scale = (w.abs().amax(dim=1) / 127).float()
            s = scale.double()[:, None]
            q = torch.where(s > 0, w / torch.where(s > 0, s, 1), 0).round().clamp(-127, 127)
            self.scale[a:b], self.wsum[a:b] = scale, q.sum(dim=1).int()
            self.dw[a:b] = _up((w - s * q).norm(dim=1) * (1 + 2 ** -30))  # the float64 sums' own rounding
            self.w2[a:b] = _up(w.norm(dim=1) * (1 + 2 ** -30))
            self.panels[a // nr:b // nr] = q.to(torch.int8).view(-1, nr, k4, 4).transpose(1, 2)
        self.w2max = float(self.w2.max())
        # the recomputed rows: the weight itself when row-major, else a copy (engine.model keeps CPU weights [in, out])
        self.rows = weight.detach() if weight.stride(1) == 1 else huge_page_empty((n, k), torch.float32).copy_(weight)
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def argmax(self, x: torch.Tensor, lib: ctypes.CDLL, candidates: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy tokens of hidden rows x [M, K] (int64 [M]), or None when a row cannot be screened (a value that
        is not finite, or so large the products could overflow: the caller takes the full logits). ``candidates``
        (int32 [M]): gets how many tokens each row recomputed in fp32."""
        x = unit_stride_rows(x)
        m, threads = x.shape[0], torch.get_num_threads()
        need = lib.tw_screen_scratch_bytes(m, self.k, self.n, threads)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)
        out = torch.empty(m, dtype=torch.int64)
        bad = lib.tw_screen_argmax(x.data_ptr(), m, self.k, x.stride(0), self.panels.data_ptr(),
                                   self.scale.data_ptr(), self.wsum.data_ptr(), self.dw.data_ptr(), self.w2.data_ptr(),
                                   self.w2max, self.n, self.rows.data_ptr(), self.rows.stride(0), out.data_ptr(),
                                   None if candidates is None else candidates.data_ptr(), self._scratch.data_ptr(),
                                   threads)
        return None if bad >= 0 else out


class GreedyScreen:
    """The screen of one LM head: ``screen(x, weight)`` -> greedy tokens, or None where it does not apply (no AVX2
    or native library, not fp32 CPU tensors, K above MAX_FEATURES, a weight that is not finite, a row it
    cannot screen). Packs the weight on first use (or ``prepack``) and again when it changes (its data pointer or
    version counter)."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.packed: ScreenWeights | None = None

    def __deepcopy__(self, memo: dict) -> GreedyScreen:
        return GreedyScreen()  # a cache of the weight: a copied model packs its own

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 candidates: torch.Tensor | None = None) -> torch.Tensor | None:
        if x.dim() != 2 or not fp32_cpu(x) or x.shape[1] != weight.shape[1]:
            return None
        packed = self.prepack(weight)
        return None if packed is None else packed.argmax(x, screen_library(), candidates)

    def prepack(self, weight: torch.Tensor) -> ScreenWeights | None:
        """The packed weight (made now if needed), or None when the screen does not apply to it."""
        lib = screen_library()
        if lib is None or weight.dim() != 2 or not fp32_cpu(weight) or not 0 < weight.shape[1] <= MAX_FEATURES:
            return None
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            finite = bool(torch.isfinite(weight).all())
            self.key, self.packed = key, ScreenWeights(weight, lib) if finite else None
        return self.packed
