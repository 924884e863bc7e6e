"""A system we did not write: vLLM for CPU (in its own venv, .venv-vllm; see docs/serving.md) serves the same tiny
checkpoint as our server. Greedy outputs are token-identical, and loadgen measures both. Slow (vLLM takes minutes
to start); skipped when .venv-vllm is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from experiments.serving.server.process import ROOT, free_port
from experiments.serving.server.process import ServerProcess as Server
from tests.helpers import wait_healthy

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PY.exists(), reason="vLLM for CPU not installed in .venv-vllm")]
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from experiments.benchmarks.tiny_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("peer"), num_layers=2, hidden_size=256, vocab_size=4000)


@pytest.fixture(scope="module")
def vllm(ckpt, tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("vllm") / "vllm.log").open("w")
    args = ["--model", str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--host", "127.0.0.1",
            "--port", str(port)]
    proc = subprocess.Popen([str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", *args], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 600)
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}; see {log.name}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_greedy_outputs_token_identical_and_loadgen_measures_both(ckpt, vllm, tmp_path):
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.serving.loadgen.run import run_loadgen

    ours = Server(ckpt, tmp_path / "ours", "kv.num_blocks=512")
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(6, 4000, (int(n),), generator=g).tolist() for n in torch.randint(8, 100, (8,))]
        outputs = {}
        for name, url in (("vllm", vllm), ("ours", ours.url)):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            outputs[name] = [client.completions.create(
                model=str(ckpt), prompt=p, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].model_extra["token_ids"]
                for p in prompts]
        assert outputs["vllm"] == outputs["ours"]
        for name, url in (("vllm", vllm), ("ours", ours.url)):
            with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
                cfg = compose("loadgen", overrides=[f"target.url={url}", f"model.path={ckpt}", "output.plots=false",
                                                    "output.progress=false", "workload.num_requests=12",
                                                    "workload.prompt_len.max=200", "workload.output_len.max=32",
                                                    "+target.extra_body.return_token_ids=true"])
            m = run_loadgen(cfg, tmp_path / f"lg_{name}")
            assert m["num_completed"] == 12 and m["num_token_count_mismatch"] == 0
    finally:
        assert ours.stop() == 0
    assert Path(tmp_path / "lg_vllm" / "bench_serve.json").is_file()


def test_loadgen_scrapes_vllm_telemetry_and_the_simulator_takes_its_kv_pool(ckpt, vllm, tmp_path):
    """vLLM's /metrics around a loadgen run: its KV pool (cache_config_info) and the request phases of exactly the
    run's requests; the simulator of that run gets the same pool."""
    from hydra import compose, initialize_config_dir

    from experiments.build import CONF_DIR
    from experiments.calibration.simfit import telemetry_overrides
    from experiments.serving.loadgen.run import run_loadgen
    from experiments.serving.loadgen.scrape import read_summary

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("loadgen", overrides=[f"target.url={vllm}", f"model.path={ckpt}", "output.plots=false",
                                            "output.progress=false", "workload.num_requests=10",
                                            "workload.prompt_len.max=200", "workload.output_len.max=16"])
    run_loadgen(cfg, tmp_path / "lg")
    s = read_summary(tmp_path / "lg")
    assert s["num_gpu_blocks"] > 0 and s["block_size"] > 0
    assert s["queue_count"] == s["prefill_count"] == s["decode_count"] == 10
    assert s["generation_tokens_total"] > 0 and s["iterations"] > 0
    assert telemetry_overrides(tmp_path / "lg")[:2] == [f"kv.block_size={s['block_size']}",
                                                        f"kv.num_blocks={s['num_gpu_blocks']}"]
