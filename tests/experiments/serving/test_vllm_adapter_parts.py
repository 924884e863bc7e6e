"""The vLLM scheduler adapter's plain-Python parts, in the project's venv (no vLLM): the plugin chosen from Hydra
overrides (environment or vLLM's additional_config), the version range, the features refused at start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from experiments.serving.vllm_adapter.plugin import ENV, check_overrides, choose, overrides_from
from experiments.serving.vllm_adapter.support import check_supported, check_version, refused_features, refused_request
from policies.schedulers.priority import PriorityScheduler
from policies.schedulers.sarathi import SarathiScheduler
from policies.schedulers.vllm_v1 import VLLMv1Scheduler


def test_overrides_come_from_the_environment_or_additional_config_never_both():
    assert overrides_from({ENV: "scheduler=priority 'scheduler.max_num_seqs=8'"}, {}) == [
        "scheduler=priority", "scheduler.max_num_seqs=8"]
    assert overrides_from({}, {"twinserve_scheduler": "scheduler=lpm"}) == ["scheduler=lpm"]
    assert overrides_from({}, {"twinserve_scheduler": ["scheduler=lpm", "scheduler.fcfs_threshold=4"]}) == [
        "scheduler=lpm", "scheduler.fcfs_threshold=4"]
    assert overrides_from({}, None) == []
    with pytest.raises(ValueError, match="chosen twice"):
        overrides_from({ENV: "scheduler=lpm"}, {"twinserve_scheduler": "scheduler=static"})
    with pytest.raises(ValueError, match="string or a list of strings"):
        overrides_from({}, {"twinserve_scheduler": 3})


def test_only_the_scheduler_group_carries_into_vllm():
    check_overrides(["scheduler=static", "scheduler.reserve=false", "+scheduler.x=1", "~scheduler.reserve"])
    with pytest.raises(ValueError, match="kv.num_blocks=8.*only the scheduler group"):
        check_overrides(["kv.num_blocks=8"])
    with pytest.raises(ValueError, match="not a Hydra override"):
        check_overrides(["scheduler"])


def test_choose_instantiates_the_group_without_its_budgets():
    default = choose([])
    assert isinstance(default.scheduler, SarathiScheduler)  # conf/config.yaml's default group
    assert (default.max_num_batched_tokens, default.max_num_seqs) == (512, 64)  # conf/scheduler/sarathi.yaml
    pri = choose(["scheduler=priority", "scheduler.max_num_batched_tokens=256"])
    assert isinstance(pri.scheduler, PriorityScheduler) and pri.max_num_batched_tokens == 256
    v1 = choose(["scheduler=vllm_v1", "scheduler.long_prefill_token_threshold=16"])
    assert isinstance(v1.scheduler, VLLMv1Scheduler) and v1.scheduler.long_prefill_token_threshold == 16
    with pytest.raises(ValueError, match="bogus"):
        choose(["scheduler=vllm_v1", "+scheduler.bogus=1"])


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1rc1.dev5+gabc"])
def test_supported_versions(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_versions_outside_the_range_are_refused_with_the_range(version):
    with pytest.raises(ImportError, match=rf"supports vLLM >= 0\.32, < 0\.33; this is vLLM {version}"):
        check_version(version)


def config(**changes):
    """A vLLM config as the checks read it: a plain text model, one GPU, nothing extra."""
    parts = {
        "model_config": SimpleNamespace(is_multimodal_model=False, supports_multimodal_inputs=False,
                                        is_encoder_decoder=False, runner_type="generate"),
        "parallel_config": SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1,
                                           prefill_context_parallel_size=1),
        "speculative_config": None, "kv_transfer_config": None, "ec_transfer_config": None, "lora_config": None}
    return SimpleNamespace(**(parts | changes))


KV = SimpleNamespace(has_mamba_layers=False, kv_cache_groups=[object()])


def test_refused_features_are_named():
    assert refused_features(config(), KV) == []
    mm = config(model_config=SimpleNamespace(is_multimodal_model=True, supports_multimodal_inputs=True,
                                             is_encoder_decoder=False, runner_type="generate"))
    bad = refused_features(config(speculative_config=object(), lora_config=object()), KV)
    assert bad == ["vLLM's speculative decoding (--speculative-config)", "LoRA (--enable-lora)"]
    assert refused_features(mm, KV) == ["multimodal models (encoder inputs)"]
    two_groups = SimpleNamespace(has_mamba_layers=False, kv_cache_groups=[object(), object()])
    assert "2 KV cache groups" in refused_features(config(), two_groups)[0]
    with pytest.raises(ValueError, match="does not support: vLLM's speculative decoding.*structured outputs are "
                                         "refused per request"):
        check_supported(config(speculative_config=object()), KV)


def test_refused_requests():
    assert refused_request(SimpleNamespace(use_structured_output=False, resumable=False,
                                           kv_transfer_params=None)) == ""
    assert "structured outputs" in refused_request(SimpleNamespace(use_structured_output=True))


def test_the_plugin_imports_with_what_vllms_python_has():
    """vLLM's venv has numpy, torch, omegaconf and (docs/serving.md) hydra-core, not the project's other
    dependencies: choosing every shipped plugin must not import scipy, simpy, matplotlib or pandas (sim.cost once
    did, through the MoE load's binomial, and the adapter failed to start)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\n"
            "for name in ('scipy', 'simpy', 'matplotlib', 'pandas'):\n"
            "    sys.modules[name] = None  # any import of them raises ImportError\n"
            "from experiments.serving.vllm_adapter.plugin import choose\n"
            "for s in ('vllm_v1', 'vllm_prefill_first', 'sarathi', 'orca', 'priority', 'lpm', 'static'):\n"
            "    choose([f'scheduler={s}'])\n")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
