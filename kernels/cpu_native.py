"""The native CPU kernels (cpu_native.c, cpu_screen.c): building and loading them, and the ops among them besides
the GEMM (kernels.cpu_gemm) and the LM head's greedy screen (kernels.greedy_screen).

The C library is compiled on first use with the system C compiler (``$CC``, default ``cc``) for this machine
(-march=native) and cached under ``$TWINSERVE_CACHE`` (default ``~/.cache/twinserve``). Without a compiler, or on a
non-x86 machine, ``native_library()`` is None (a failed build logs a warning saying why) and every op here falls
back to its torch reference; ``kernels.cpu_gemm`` uses the library's GEMM.

The ``native`` kernel backend's ops (kernels.ops) keep the torch references' contracts and run fp32 CPU tensors
in one C call each: ``rms_norm_native``, ``rope_native``, ``silu_and_mul_native``, ``store_kv_native`` and
``paged_attention_native`` (decodes; prefill chunks stay on the torch path); ``argmax_rows`` is the sampler's
greedy pick. A decode step interleaves these small ops with weight streams that leave the caches cold, and there
each op torch dispatches costs tens of microseconds: ``torch.rms_norm`` (a composite of about 8 aten ops) took
80-90 us per call on [8, 512] inside a decode step against 21 us in a loop. The rope, the KV store and the argmax
are bit-identical to torch's; the norm differs from HF's only in the order it sums squares, SiLU and attention by
a few ulp (their own vectorised exp). ``huge_page_empty`` holds the GEMM's packed weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import mmap
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.activation import check_silu_and_mul_input, silu_and_mul_torch
from kernels.attention import AttentionPlan, check_attention_inputs, paged_attention_torch, plan_attention
from kernels.kv_store import check_store_kv_inputs, store_kv_torch
from kernels.norm import check_rms_norm_inputs, rms_norm_torch
from kernels.rope import check_rope_inputs, rope_torch

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("cpu_native.c"), Path(__file__).with_name("cpu_screen.c"))
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
    """Compile the C sources into one library, once per sources, flags, compiler and CPU; concurrent builders each
    write a private file and rename it into place, so a reader never sees a partial library."""
    texts = [src.read_text() for src in SOURCES]
    key = hashlib.sha256("\0".join([*texts, *CFLAGS, cc, _cpu_id()]).encode()).hexdigest()[:16]
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
            subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True, text=True,
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
    lib.tw_decode_attention.argtypes = [p, i64, i64, i64, p, p, p, i64, p, p, i64, i64, i64, i64, i64,
                                        ctypes.c_float, p, p, i64, ctypes.c_int]
    lib.tw_decode_attention.restype = i64
    lib.tw_argmax_rows.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.tw_silu_and_mul.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.tw_store_kv.argtypes = [p, i64, p, i64, i64, i64, p, i64, p, p]
    lib.tw_store_kv.restype = i64
    lib.tw_screen_scratch_bytes.argtypes = [i64, i64, i64, ctypes.c_int]
    lib.tw_screen_scratch_bytes.restype = i64
    lib.tw_screen_argmax.argtypes = [p, i64, i64, i64, p, p, p, p, p, ctypes.c_float, i64, p, i64, p, p, p,
                                     ctypes.c_int]
    lib.tw_screen_argmax.restype = i64
    for f in (lib.tw_gemm, lib.tw_rms_norm, lib.tw_argmax_rows, lib.tw_silu_and_mul):
        f.restype = None
    return lib


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty CPU tensor on memory advised for transparent huge pages (Linux; elsewhere, and under 2 MiB, a plain
    one). For the weights decode steps stream: with 4 KiB pages a 65 MB LM head spans 16k pages, far more than the
    TLB holds, and each new page costs a page walk inside the stream. Measured on the Xeon (engine, batch 8, one
    thread): decode steps 16.6 -> 15.0 ms with every packed GEMM weight on huge pages (batch 32, compute-bound:
    no change)."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # a private anonymous map (THP applies to those); one spare huge page leaves room to align the start
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without THP: plain pages, same tensor
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf mapped as long as a view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + n].view(dtype).view(shape)


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


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           *, max_query_len: int | None = None, max_seq_len: int | None = None,
                           plan: AttentionPlan | None = None, k: torch.Tensor | None = None,
                           v: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.attention.paged_attention_torch with its decodes in C (fp32 caches on CPU; anything else is that
    function). Every single-token sequence attends straight from the paged cache, with no gather and no copy
    kept between steps; prefill chunks go through the torch path (``plan`` without its decode part)."""
    lib = native_library()
    if lib is None or not fp32_cpu(q, k_cache, v_cache) or k_scale is not None or v_scale is not None:
        return paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale,
                                     v_scale, max_query_len=max_query_len, max_seq_len=max_seq_len, plan=plan,
                                     k=k, v=v)
    check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, None, None)
    T, S = q.shape[0], seq_lens.shape[0]
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731 (no copy when already int32 and contiguous)
    qsl, lens, tables = i32(query_start_loc), i32(seq_lens), i32(block_tables)
    if max_query_len is None or max_seq_len is None:
        q_lens = qsl[1:] - qsl[:-1]
        max_query_len, max_seq_len = int(q_lens.max()) if S else 0, int(lens.max()) if S else 0
    if T == S and max_query_len == 1:  # every sequence decodes (the usual step): C only
        out = torch.empty(q.shape, dtype=torch.float32)
    else:
        if plan is None:
            plan = plan_attention(tables, lens, qsl, k_cache.shape[1])
        if plan.decode_rows is None:  # no decodes: all prefill
            return paged_attention_torch(q, k_cache, v_cache, tables, lens, qsl, scale, plan=plan, k=k, v=v)
        prefill_only = dataclasses.replace(plan, decode_rows=None, all_decode=False)
        out = paged_attention_torch(q, k_cache, v_cache, tables, lens, qsl, scale, plan=prefill_only, k=k, v=v)
    if S == 0:
        return out
    scratch = torch.empty(torch.get_num_threads() * q.shape[1] * (max_seq_len + q.shape[2] + 1), dtype=torch.float32)
    x = unit_stride_rows(q)
    kc, vc = k_cache.contiguous(), v_cache.contiguous()
    bad = lib.tw_decode_attention(x.data_ptr(), x.stride(0), x.stride(1), S, qsl.data_ptr(), lens.data_ptr(),
                                  tables.data_ptr(), tables.shape[1], kc.data_ptr(), vc.data_ptr(), kc.shape[0],
                                  kc.shape[1], kc.shape[2], q.shape[1], q.shape[2], scale, out.data_ptr(),
                                  scratch.data_ptr(), max_seq_len, torch.get_num_threads())
    if bad >= 0:
        raise ValueError(f"attention: sequence {bad} has seq_len {int(lens[bad])} (max_seq_len {max_seq_len}) or a "
                         f"block id outside [0, {kc.shape[0]}) in its {tables.shape[1]}-block table row")
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` (int64; the first maximum, a NaN counting as the maximum) in one C pass for
    2-D fp32 CPU rows of at most 2**31 columns; that expression for anything else. Greedy sampling: inside a
    decode step the torch reduction reads the [n, vocab] logits at a few GB/s."""
    lib = native_library()
    if lib is None or not fp32_cpu(logits) or logits.dim() != 2 or not 0 < logits.shape[1] < 2 ** 31:
        return logits.max(dim=-1).indices
    x = unit_stride_rows(logits)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.tw_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """kernels.activation.silu_and_mul_torch in C for fp32 CPU rows (that function for anything else): one pass,
    within a few ulp of torch's silu (its own vectorised exp)."""
    lib = native_library()
    if lib is None or not fp32_cpu(x):
        return silu_and_mul_torch(x)
    check_silu_and_mul_input(x)
    x = unit_stride_rows(x)
    f = x.shape[1] // 2
    out = torch.empty(x.shape[0], f, dtype=torch.float32)
    lib.tw_silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], f, out.data_ptr(), torch.get_num_threads())
    return out


def store_kv_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """kernels.kv_store.store_kv_torch in C for fp32 CPU caches (that function for anything else, int8 included):
    one row copy per token and cache; a slot of -1 is skipped, one outside the cache raises before any write."""
    lib = native_library()
    if lib is None or not fp32_cpu(k, v, k_cache, v_cache) or slot_mapping.device.type != "cpu" \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return store_kv_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_store_kv_inputs(k, v, k_cache, v_cache, slot_mapping, None, None)
    k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (k, v))
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    bad = lib.tw_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0],
                          k.shape[1] * k.shape[2], slots.data_ptr(), num_slots, k_cache.data_ptr(), v_cache.data_ptr())
    if bad >= 0:
        raise IndexError(f"store_kv: slot {int(slots[bad])} of token {bad} is outside the cache's {num_slots} slots")
