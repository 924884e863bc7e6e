"""The engine's options (``conf/backend/engine.yaml``), checked without importing torch: a simulator run parses its
config without loading the engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from core.checks import check_bool, check_choice, check_float, check_fraction, check_int, check_keys
from core.request import SamplingParams
from core.specs import QuantSpec
from kernels.ops import BACKENDS as KERNEL_BACKENDS
from kernels.ops import CPU_GEMMS

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's ``backend`` section, checked on construction: a bad value fails naming ``backend.<key>``;
    ``from_mapping`` also rejects unknown keys. Counts given as whole floats (2.0) are read as integers. How weights
    and KV are stored is the run's ``quant`` section (``QuantSpec``), shared with the simulator."""

    name: str = "engine"
    kernels: str = "auto"  # auto (triton on cuda, native on cpu) | torch | native | triton
    device: str = "cpu"  # cpu | cuda[:i]
    dtype: str | None = None  # None: the model's dtype (bfloat16 for an fp32 model on cuda)
    cpu_gemm: str = "auto"  # fp32 CPU GEMMs: auto (the faster kernel per row count) | native (one kernel, one copy)
    greedy_screen: bool = True  # greedy tokens through an int8 screen of the LM head (same tokens; fp32, x86 CPU)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    warmup_steps: int = 2  # untimed forward passes per executor before the run
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (cuda + triton; ignored elsewhere)
    num_threads: int | None = None  # torch CPU threads; None or 0: torch's default
    ignore_eos: bool = True  # true: every request generates exactly its output length (read by the replica limits)

    def __post_init__(self) -> None:
        def put(key: str, value: Any) -> None:
            object.__setattr__(self, key, value)

        check_choice(self.name, "backend.name", ("engine",))
        check_choice(self.kernels, "backend.kernels", ("auto", *KERNEL_BACKENDS))
        check_choice(self.dtype, "backend.dtype", [*DTYPES, None])
        check_choice(self.cpu_gemm, "backend.cpu_gemm", CPU_GEMMS)
        check_bool(self.greedy_screen, "backend.greedy_screen")
        put("temperature", check_float(self.temperature, "backend.temperature", 0.0))
        put("top_p", check_fraction(self.top_p, "backend.top_p"))
        put("top_k", check_int(self.top_k, "backend.top_k", 0, whole_float=True))
        put("warmup_steps", check_int(self.warmup_steps, "backend.warmup_steps", 0, whole_float=True))
        check_bool(self.cuda_graphs, "backend.cuda_graphs")
        if self.num_threads is not None:
            put("num_threads", check_int(self.num_threads, "backend.num_threads", 0, whole_float=True))
        check_bool(self.ignore_eos, "backend.ignore_eos")

    @classmethod
    def from_mapping(cls, backend: Mapping[str, Any]) -> EngineOptions:
        check_keys("backend", backend, [f.name for f in fields(cls)])
        return cls(**backend)

    @staticmethod
    def check_quant(quant: QuantSpec) -> None:
        """What the engine can store: 16-bit or W4A16 weights, model-dtype or int8 KV (the group size against the
        layers' widths: ``core.arithmetic.check_group_size``, for both backends)."""
        if quant.weight_bits not in (16, 4):
            raise ValueError(f"quant.weight_bits={quant.weight_bits}: the engine stores 16-bit (the model dtype) or "
                             "W4A16 (4) weights; 8-bit weights are a simulator what-if")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)

    @property
    def sampling(self) -> SamplingParams:
        """The default sampling parameters of requests that bring none."""
        return SamplingParams(self.temperature, self.top_p, self.top_k)
