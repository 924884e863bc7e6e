"""The native CPU kernels (cpu_native.c): building and loading them, and the token-wise ops among them.

The C library is compiled on first use with the system C compiler (``$CC``, default ``cc``) for this machine
(-march=native) and cached under ``$TWINSERVE_CACHE`` (default ``~/.cache/twinserve``). Without a compiler, or on a
non-x86 machine, ``native_library()`` is None (a failed build logs a warning saying why) and every op here falls
back to its torch reference; ``kernels.cpu_gemm`` uses the library's GEMM.

``rms_norm_native`` and ``rope_native`` are the ``native`` kernel backend's (kernels.ops): the torch references'
contracts, on fp32 CPU tensors in one C call each. A decode step interleaves these small ops with weight streams
that leave the caches cold, and there each op torch dispatches costs tens of microseconds: ``torch.rms_norm`` (a
composite of about 8 aten ops) took 80-90 us per call on [8, 512] inside a decode step against 21 us in a loop.
The rope is bit-identical to ``rope_torch``; the norm differs from HF's only in the order it sums squares.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.norm import check_rms_norm_inputs, rms_norm_torch
from kernels.rope import check_rope_inputs, rope_torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def _cache_dir() -> Path:
    if os.environ.get("TWINSERVE_CACHE"):
        return Path(os.environ["TWINSERVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "twinserve"


def _cpu_id() -> str:
    """What -march=native depends on: a build is only reused on a CPU with the same flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    """Compile cpu_native.c once per source, flags, compiler and CPU; concurrent builders each write a private file
    and rename it into place, so a reader never sees a partial library."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, cc, _cpu_id()]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        out_dir = Path(tempfile.gettempdir()) / "twinserve"
        out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_native-{key}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True,
                           timeout=120)
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled library, or None (with a warning saying why) where it cannot or should not run."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # measured on x86 only; oneDNN elsewhere
    cc = os.environ.get("CC", "cc")
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except subprocess.CalledProcessError as e:
        log.warning("native CPU kernels not built (%s failed: %s); torch / oneDNN run their ops", cc,
                    (e.stderr or "").strip()[-300:])
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: no home directory
        log.warning("native CPU kernels not built (%s); torch / oneDNN run their ops", e)
        return None
    if lib.tw_vector_bytes() == 0:
        log.warning("native CPU kernels: this CPU has no AVX2/AVX-512 FMA; torch / oneDNN run their ops")
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tw_gemm.argtypes = [p, i64, i64, i64, p, i64, p, i64, p, ctypes.c_int]
    lib.tw_rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.tw_rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, i64, p, ctypes.c_int]
    lib.tw_rope.restype = i64
    for f in (lib.tw_gemm, lib.tw_rms_norm):
        f.restype = None
    return lib


def fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    """Every tensor given (None skipped) is float32 on the CPU: what the C kernels take."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


def unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dim (any row stride): what the C loops index."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """kernels.norm.rms_norm_torch in C for fp32 CPU tensors (that function for anything else)."""
    lib = native_library()
    if lib is None or not fp32_cpu(x, weight, residual):
        return rms_norm_torch(x, weight, eps, residual)
    check_rms_norm_inputs(x, weight, residual)
    x, weight = unit_stride_rows(x), weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    new_r = None if residual is None else torch.empty_like(out)
    r = None if residual is None else unit_stride_rows(residual)
    lib.tw_rms_norm(x.data_ptr(), x.stride(0), None if r is None else r.data_ptr(), 0 if r is None else r.stride(0),
                    weight.data_ptr(), out.data_ptr(), None if new_r is None else new_r.data_ptr(), x.shape[0],
                    x.shape[1], eps, torch.get_num_threads())
    return out if residual is None else (out, new_r)


def rope_native(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """kernels.rope.rope_torch in C for fp32 CPU tensors (that function for anything else), bit for bit."""
    lib = native_library()
    if lib is None or not fp32_cpu(q, k, cos_sin) or positions.device.type != "cpu":
        return rope_torch(q, k, positions, cos_sin)
    check_rope_inputs(q, k, positions, cos_sin)
    pos = positions.to(torch.int64).contiguous()
    table = cos_sin.contiguous()
    outs = []
    for x in (q, k):
        x = unit_stride_rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        bad = lib.tw_rope(x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], x.shape[2], pos.data_ptr(),
                          table.data_ptr(), table.shape[0], out.data_ptr(), torch.get_num_threads())
        if bad >= 0:
            raise IndexError(f"rope: position {int(pos[bad])} of token {bad} is outside the table's "
                             f"{table.shape[0]} positions")
        outs.append(out)
    return tuple(outs)
