"""experiments.config: the composed config parsed once into typed records, and the command-line spellings of a model
checkpoint (``model=DIR`` and ``model.path=DIR`` alike, in every entry point)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core import arithmetic
from experiments.cli import COMMANDS, checkpoint_paths_to_overrides
from experiments.config import CONF_DIR, KVConfig, OutputConfig, RunConfig, schema_of

ROOT = Path(__file__).resolve().parents[2]
LLAMA_31_8B = {  # the public config.json of meta-llama/Llama-3.1-8B (bf16)
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256, "hidden_act": "silu", "eos_token_id": 128001}


def composed(*overrides: str, name: str = "config"):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return tmp_path


@pytest.mark.parametrize("spelling", ["model=DIR", "model.path=DIR"])
def test_a_bf16_checkpoint_is_sized_as_bf16_on_a_24gb_device(llama_dir, spelling):
    """Llama-3.1-8B's 8.03B bf16 parameters are 16.1 GB: they fit a 24 GB device and leave KV, whichever way the
    directory is named on the command line (an fp32 reading would be 32.1 GB and refused)."""
    argv = checkpoint_paths_to_overrides([spelling.replace("DIR", str(llama_dir)), "backend=sim",
                                          "hardware.mem_bytes=24e9"])
    run = RunConfig.from_config(composed(*argv))
    assert run.model.dtype == "bfloat16" and run.model.num_layers == 32
    weights = arithmetic.weight_bytes(run.model)
    assert weights == pytest.approx(2 * 8.03e9, rel=0.01)
    kv_budget = 24e9 * 0.9 - weights
    assert run.num_kv_blocks == int(kv_budget // arithmetic.kv_bytes_per_block(run.model, 16, 16))
    assert run.num_kv_blocks * 16 * 131072 == pytest.approx(kv_budget, rel=0.01)  # 128 KiB of bf16 KV per token


def test_an_explicit_dtype_overrides_the_checkpoints(llama_dir):
    argv = checkpoint_paths_to_overrides([f"model={llama_dir}", "model.dtype=float32", "hardware.mem_bytes=24e9"])
    with pytest.raises(ValueError, match="32.1 GB of weights in float32"):
        RunConfig.from_config(composed(*argv))


def test_the_records_are_the_configs_values_checked():
    run = RunConfig.from_config(composed("kv.num_blocks=96", "replicas=3", "quant.kv_bits=8", "output.tokens=none"))
    assert (run.kv.num_blocks, run.num_kv_blocks, run.cluster.num_replicas) == (96, 96, 3)
    assert run.quant.kv_bits == 8 and run.output.tokens == "none" and run.sim is not None and run.engine is None
    assert run.kv_bytes_per_token == arithmetic.kv_bytes_per_token(run.model, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.kv.block_size = 32  # type: ignore[misc]
    with pytest.raises(ValueError, match="kv.block_size=0"):
        KVConfig(block_size=0)
    with pytest.raises(ValueError, match="output.format='xml'"):
        OutputConfig(format="xml")


def test_schema_mirrors_the_record():
    schema = OmegaConf.structured(schema_of(KVConfig))
    assert list(schema) == [f.name for f in dataclasses.fields(KVConfig)]
    assert OmegaConf.to_container(schema) == dataclasses.asdict(KVConfig())
    with pytest.raises(Exception, match="block_size"):
        OmegaConf.merge(schema, {"block_size": "sixteen"})


def test_the_engine_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="quant.weight_bits=8: the engine"):
        RunConfig.from_config(composed("backend=engine", "quant.weight_bits=8"))
    run = RunConfig.from_config(composed("backend=sim", "quant.weight_bits=8"))  # a simulator what-if
    assert run.quant.weight_bits == 8


COMMAND_LINES = [[sys.executable, "-m", f"experiments.{name}", "--help"] for name in COMMANDS]

@pytest.mark.parametrize("cmd", COMMAND_LINES, ids=[c[2] for c in COMMAND_LINES])
def test_every_documented_command_answers_help(cmd):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_twinserve_names_every_command():
    assert {c[2].removeprefix("experiments.") for c in COMMAND_LINES} <= set(COMMANDS)
    out = subprocess.run([sys.executable, "-c", "from experiments.cli import twinserve; raise SystemExit(twinserve())",
                          "run", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "== Config ==" in out.stdout


def test_parallel_is_checked_against_the_model():
    run = RunConfig.from_config(composed("model=llama3_8b", "hardware=h100", "cost_model=roofline", "parallel.tp=4",
                                         "parallel.pp=2"))
    assert run.parallel.devices == 8 and run.config.cost_model.tp == 4  # the roofline reads parallel.tp
    with pytest.raises(ValueError, match="parallel.tp=3 must divide model.num_heads=32"):
        RunConfig.from_config(composed("model=llama3_8b", "hardware=h100", "parallel.tp=3"))
    with pytest.raises(ValueError, match="parallel.ep=2: model llama3_8b has no experts"):
        RunConfig.from_config(composed("model=llama3_8b", "hardware=h100", "parallel.tp=2", "parallel.ep=2"))
    with pytest.raises(ValueError, match="parallel.ep=4 must divide parallel.tp x parallel.dp = 2"):
        RunConfig.from_config(composed("model=qwen3_30b_a3b", "hardware=h100", "parallel.tp=2", "parallel.ep=4"))
    moe = RunConfig.from_config(composed("model=qwen3_30b_a3b", "hardware=h100", "parallel.tp=2", "parallel.ep=2"))
    assert moe.parallel.ep == 2
    with pytest.raises(ValueError, match=r"parallel.dp=2: model llama3_8b has no experts.*replicas=2"):
        RunConfig.from_config(composed("model=llama3_8b", "hardware=h100", "parallel.dp=2"))
    dp = RunConfig.from_config(composed("model=qwen3_30b_a3b", "hardware=h100", "parallel.dp=2", "parallel.ep=1"))
    assert dp.parallel.devices == 2  # an MoE model's ranks meet at its experts, expert-parallel or not


def test_weights_beyond_the_device_ask_for_a_wider_split():
    """Llama-3-70B (2 x 70.55e9 bytes) at tp 2 holds ~70.6 GB a device: below an H100's 80 GB, so a larger memory
    fraction helps; at tp 1 (~141 GB) none does, and the message names the split and quantisation keys instead."""
    with pytest.raises(ValueError, match=r"70.6 GB of weights per device.*\(64 GB\); raise it, or set kv.num_blocks"):
        RunConfig.from_config(composed("model=llama3_70b", "hardware=h100", "parallel.tp=2", "kv.memory_fraction=0.8"))
    with pytest.raises(ValueError, match=r"141 GB of weights.*more than the device's 80 GB: raise parallel.tp or "
                                         r"parallel.pp .*quant.weight_bits"):
        RunConfig.from_config(composed("model=llama3_70b", "hardware=h100"))


@pytest.mark.parametrize("seed", ["abc", "-1", "1.5"])
def test_a_bad_seed_is_named_as_seed(seed):
    """backend.noise_seed defaults to ${seed}: the error must name the key the user set, not a bare int() error
    or the derived key."""
    with pytest.raises(ValueError, match=r"^seed=('abc'|-1|1\.5); allowed: an integer >= 0$"):
        RunConfig.from_config(composed(f"seed={seed}"))
