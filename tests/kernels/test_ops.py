"""Backend registry: each backend maps every op to its own implementation; unknown names and a missing triton
fail with clear errors; the torch and native backends import without triton."""

import dataclasses
import subprocess
import sys

import pytest

import kernels.activation as activation
import kernels.attention as attention
import kernels.cpu_native as cpu_native
import kernels.grouped_gemm as grouped_gemm
import kernels.kv_store as kv_store
import kernels.norm as norm
import kernels.rope as rope
import kernels.w4a16 as w4a16
from kernels.ops import KernelSet, get_kernels

EXPECTED = {
    "torch": (norm.rms_norm_torch, rope.rope_torch, activation.silu_and_mul_torch, kv_store.store_kv_torch,
              attention.paged_attention_torch, w4a16.w4a16_linear_torch, grouped_gemm.grouped_gemm_torch),
    "native": (cpu_native.rms_norm_native, cpu_native.rope_native, cpu_native.silu_and_mul_native,
               cpu_native.store_kv_native, cpu_native.paged_attention_native, w4a16.w4a16_linear_torch,
               grouped_gemm.grouped_gemm_torch),
    "triton": (norm.rms_norm_triton, rope.rope_triton, activation.silu_and_mul_triton, kv_store.store_kv_triton,
               attention.paged_attention_triton, w4a16.w4a16_linear_triton, grouped_gemm.grouped_gemm_triton),
}
FIELDS = ("rms_norm", "rope", "silu_and_mul", "store_kv", "attention", "w4a16_linear", "grouped_gemm")


@pytest.mark.parametrize("backend", ["torch", "native", "triton"])
def test_backend_maps_every_op(backend):
    ks = get_kernels(backend)
    assert tuple(f.name for f in dataclasses.fields(KernelSet)) == FIELDS
    assert tuple(getattr(ks, f) for f in FIELDS) == EXPECTED[backend]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ks.rms_norm = None


def test_unknown_backend_lists_allowed():
    with pytest.raises(ValueError, match="'cuda'.*torch, native, triton"):
        get_kernels("cuda")


def test_torch_and_native_backends_work_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
            "import torch\n"
            "from kernels.ops import get_kernels\n"
            "ks = get_kernels('torch')\n"
            "print(ks.silu_and_mul(torch.ones(1, 2)).item())\n"
            "print(get_kernels('native').rms_norm(torch.ones(1, 2), torch.full((2,), 3.0), 0.0).sum().item())\n"
            "try:\n    get_kernels('triton')\nexcept ValueError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert abs(float(lines[0]) - 0.7310585786) < 1e-6  # silu(1) * 1 = sigmoid(1)
    assert float(lines[1]) == 6.0  # each of the two ones normalised to 1, times 3
    assert lines[2].startswith("ERR") and "triton" in lines[2]
