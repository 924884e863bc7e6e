"""engine.options.EngineOptions: the backend section, checked with messages naming backend.<key>."""

import pytest
import torch
from omegaconf import OmegaConf

from core.specs import QuantSpec
from engine.options import EngineOptions
from experiments.build import CONF_DIR


def test_the_shipped_engine_config_reads_as_options():
    o = EngineOptions.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "backend" / "engine.yaml")))
    assert (o.kernels, o.device, o.dtype, o.warmup_steps) == ("auto", "cpu", None, 2)
    assert o.torch_dtype is None and o.sampling.greedy


def test_whole_floats_count_and_dtypes_map():
    o = EngineOptions(top_k=50.0, warmup_steps=1.0, dtype="bfloat16")
    assert (o.top_k, o.warmup_steps) == (50, 1) and type(o.top_k) is int and o.torch_dtype is torch.bfloat16


@pytest.mark.parametrize("backend, key", [
    ({"nope": 1}, "unknown keys ['nope']"), ({"dtype": "fp8"}, "backend.dtype"),
    ({"kv_dtype": "int8"}, "unknown keys ['kv_dtype']"),  # how KV is stored: the quant section
    ({"cpu_gemm": "onednn"}, "backend.cpu_gemm"), ({"greedy_screen": "yes"}, "backend.greedy_screen"),
    ({"temperature": -1}, "backend.temperature"), ({"top_p": 0}, "backend.top_p"), ({"top_k": 1.5}, "backend.top_k"),
    ({"warmup_steps": -1}, "backend.warmup_steps"), ({"num_threads": "4"}, "backend.num_threads"),
    ({"kernels": "cuda"}, "backend.kernels"), ({"ignore_eos": "yes"}, "backend.ignore_eos"),
    ({"name": "sim"}, "backend.name"),
])
def test_bad_options_name_the_key(backend, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        EngineOptions.from_mapping(backend)


def test_what_the_engine_can_store():
    EngineOptions.check_quant(QuantSpec(weight_bits=4, group_size=128, kv_bits=8))
    with pytest.raises(ValueError, match="quant.weight_bits=8: the engine stores"):
        EngineOptions.check_quant(QuantSpec(weight_bits=8))
    with pytest.raises(ValueError, match="quant.kv_bits=4"):
        QuantSpec(kv_bits=4)
