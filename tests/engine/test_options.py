"""engine.executor.EngineOptions: the backend section, checked with messages naming backend.<key>."""

import pytest
import torch
from omegaconf import OmegaConf

from engine.executor import EngineOptions
from experiments.build import CONF_DIR


def test_the_shipped_engine_config_reads_as_options():
    o = EngineOptions.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF_DIR / "backend" / "engine.yaml")))
    assert (o.kernels, o.device, o.dtype, o.quant, o.kv_dtype, o.warmup_steps) == ("auto", "cpu", None, None, "auto", 2)
    assert o.torch_dtype is None and o.sampling.greedy


def test_whole_floats_count_and_dtypes_map():
    o = EngineOptions(top_k=50.0, warmup_steps=1.0, dtype="bfloat16")
    assert (o.top_k, o.warmup_steps) == (50, 1) and type(o.top_k) is int and o.torch_dtype is torch.bfloat16


@pytest.mark.parametrize("backend, key", [
    ({"nope": 1}, "unknown keys ['nope']"), ({"dtype": "fp8"}, "backend.dtype"),
    ({"kv_dtype": "fp8"}, "backend.kv_dtype"),
    ({"cpu_gemm": "onednn"}, "backend.cpu_gemm"), ({"greedy_screen": "yes"}, "backend.greedy_screen"),
    ({"quant": "w8a8"}, "backend.quant"), ({"quant_group_size": 0}, "backend.quant_group_size"),
    ({"temperature": -1}, "backend.temperature"), ({"top_p": 0}, "backend.top_p"), ({"top_k": 1.5}, "backend.top_k"),
    ({"warmup_steps": -1}, "backend.warmup_steps"), ({"num_threads": "4"}, "backend.num_threads"),
    ({"kernels": "cuda"}, "backend.kernels"), ({"ignore_eos": "yes"}, "backend.ignore_eos"),
    ({"name": "sim"}, "backend.name"),
])
def test_bad_options_name_the_key(backend, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        EngineOptions.from_mapping(backend)
