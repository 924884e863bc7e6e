"""Tensor and expert parallelism on CPU (gloo ranks as processes): the same greedy tokens as one device and as
transformers, under chunked prefill; the shards' arithmetic without processes; a dead rank ends the step with an
error naming it, and no rank process outlives its run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from core.batch import Batch, Chunk
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from engine.loader import load_model
from engine.tp import check_shardable, shard_model
from kernels.ops import get_kernels
from tests.engine.checkpoints import MOE_LAYOUTS, TINY, tiny_checkpoint
from tests.engine.test_runner import Blocks, _state, hf_greedy, prompts, run_to_completion

LENGTHS = [5, 13, 22]
CHUNK = 6  # chunked prefill: prompts over several steps, mixed with other requests' decodes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited (its parent has not reaped it yet)
        return f.read().split(")")[-1].split()[0] != "Z"


def _generate(path, tp: int, ep: int = 1, device: str = "cpu", kernels: str = "torch", **options
              ) -> list[list[int]]:
    blocks = Blocks()
    ex = build_engine_executor(ModelSpec.from_pretrained(path), kv_manager=blocks, kernels=kernels, tp=tp, ep=ep,
                               num_threads=1, device=device, dtype=torch.float32, **options)
    try:
        states = [_state(f"r{i}", p) for i, p in enumerate(prompts(0, LENGTHS))]
        run_to_completion(ex.runner, blocks, states, CHUNK)
    finally:
        ex.close()
    pids = [p.pid for p in (ex.runner.workers.procs if ex.runner.workers else [])]
    assert not [pid for pid in pids if _alive(pid)]
    return [s.output_token_ids for s in states]


# (layout, overrides, tp, ep): a dense model; tp 4 > 2 KV heads (replicated) over a vocabulary 4 does not divide
# (the last rank's slice padded); Qwen3-MoE (q/k norms, a dense layer) by width and by experts; Mixtral by experts
CASES = [("llama", {}, 2, 1), ("llama_tied", {"vocab_size": 161}, 4, 1), ("qwen3_moe", {}, 2, 1),
         ("qwen3_moe", {}, 2, 2), ("mixtral", {}, 2, 2)]


@pytest.mark.parametrize(("layout", "overrides", "tp", "ep"), CASES)
def test_tp_tokens_equal_one_device_and_transformers(tmp_path, layout, overrides, tp, ep):
    hf, path = tiny_checkpoint(tmp_path, layout, **overrides)
    one = _generate(path, 1)
    assert one == [hf_greedy(hf, p) for p in prompts(0, LENGTHS)]
    assert _generate(path, tp, ep) == one


def test_w4a16_and_int8_kv_shards_give_the_one_device_tokens(tmp_path):
    """Quantised after sharding: a rank's 4-bit groups are the whole model's (the group divides each rank's input
    widths), so the tokens are one device's; the int8 KV cache of a rank holds its KV heads."""
    _, path = tiny_checkpoint(tmp_path, "qwen2")
    quant = dict(quant="w4a16", group_size=32, kv_dtype="int8")
    assert _generate(path, 2, **quant) == _generate(path, 1, **quant)
    with pytest.raises(ValueError, match=r"quant.group_size=64 must divide each rank's linear input widths"):
        _generate(path, 2, quant="w4a16", group_size=64)


@pytest.mark.parametrize(("layout", "tp", "ep"), [("qwen2", 2, 1), ("qwen3_moe_top1", 4, 2), ("mixtral", 4, 4)])
def test_shards_sum_to_the_whole_layer(tmp_path, layout, tp, ep):
    """Without processes: each rank's o_proj / MLP / experts partial outputs (what the all-reduce sums) add up to the
    whole layer's, on the CPU expert loop and on the grouped-GEMM path a GPU takes (torch reference, and the Triton
    kernel in the interpreter)."""
    _, path = tiny_checkpoint(tmp_path, layout)
    whole = load_model(path)
    ks = get_kernels("torch")
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    ranks = [shard_model(load_model(path), r, tp, ep) for r in range(tp)]
    for i, layer in enumerate(whole.model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            weights, ids = torch.rand(37, mlp.top_k), torch.randint(0, mlp.experts.num_experts, (37, mlp.top_k))
            ref = mlp.experts(x, weights, ids, ks)
            for grouped in (None, ks, get_kernels("triton")):  # the CPU loop, the grouped GEMM (torch, Triton)
                parts = []
                for r in ranks:
                    ex = r.model.layers[i].mlp.experts
                    n = ex.gate_up_proj.shape[0]
                    local = (ids - ex.first).masked_fill((ids < ex.first) | (ids >= ex.first + n), n)
                    parts.append(ex(x, weights, ids, ks) if grouped is None
                                 else ex._grouped(x, weights, local, grouped))
                torch.testing.assert_close(sum(parts), ref, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(sum(r.model.layers[i].mlp(x, ks) for r in ranks), mlp(x, ks), atol=1e-5,
                                       rtol=1e-5)
        o = torch.randn(37, whole.spec.num_heads * whole.spec.head_dim, generator=torch.Generator().manual_seed(i))
        h = whole.spec.num_heads // tp * whole.spec.head_dim
        torch.testing.assert_close(sum(r.model.layers[i].self_attn.o_proj(o[:, k * h:(k + 1) * h], ks)
                                       for k, r in enumerate(ranks)), layer.self_attn.o_proj(o, ks), atol=1e-5,
                                   rtol=1e-5)


def test_ranks_start_after_the_parent_ran_threaded_gemms(tmp_path):
    """A forked rank never enters the OpenMP pool its parent used (it hung there once): CPU ranks default to one
    thread, forked; the parent on two threads with a pool in use."""
    _, path = tiny_checkpoint(tmp_path, "llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 512)
        for _ in range(3):
            x = torch.tanh(x @ x)
        out = []
        for tp in (1, 2):
            blocks = Blocks()
            ex = build_engine_executor(ModelSpec.from_pretrained(path), kv_manager=blocks, kernels="torch", tp=tp)
            state = _state("a", prompts(0, [9])[0])
            run_to_completion(ex.runner, blocks, [state], None)
            ex.close()
            out.append(state.output_token_ids)
    finally:
        torch.set_num_threads(threads)
    assert out[0] == out[1]


def test_unshardable_widths_are_named(tmp_path):
    _, path = tiny_checkpoint(tmp_path, "mixtral")
    model = load_model(path)
    with pytest.raises(ValueError, match=r"parallel.tp=3 must divide model.num_heads=4"):
        check_shardable(model, 3, 1)
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide"):
        check_shardable(model, 2, 3)


def test_a_killed_rank_ends_the_step_with_an_error_within_seconds(tmp_path):
    _, path = tiny_checkpoint(tmp_path, "llama")
    blocks = Blocks()
    ex = build_engine_executor(ModelSpec.from_pretrained(path), kv_manager=blocks, kernels="torch", tp=2,
                               num_threads=1)
    workers = ex.runner.workers
    state = _state("a", prompts(0, [7])[0])
    blocks.ensure("a", 7)
    os.kill(workers.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 of 2 \(pid \d+\) exited with code -9"):
        while time.monotonic() - t0 < 5:  # until the kill lands (its exit is seen before the next step's send)
            ex.execute(Batch([Chunk.next(state, 7)]))
    assert time.monotonic() - t0 < 5
    assert not workers.procs[0].is_alive()


def test_a_rank_dying_inside_a_collective_is_named(tmp_path):
    """The rank dies while rank 0 is past its check: the failed collective is reported as that rank's death."""
    _, path = tiny_checkpoint(tmp_path, "llama")
    blocks = Blocks()
    ex = build_engine_executor(ModelSpec.from_pretrained(path), kv_manager=blocks, kernels="torch", tp=2,
                               num_threads=1)
    workers, check = ex.runner.workers, ex.runner.workers.check
    workers.check = lambda wait_s=0.0: check(wait_s) if wait_s else None  # skip the check before the send
    os.kill(workers.procs[0].pid, signal.SIGKILL)
    workers.procs[0].join(5)
    state = _state("a", prompts(0, [7])[0])
    blocks.ensure("a", 7)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 of 2 .* exited with code -9"):
        ex.execute(Batch([Chunk.next(state, 7)]))
    assert time.monotonic() - t0 < 5


DRIVER = """
import sys, time
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from tests.engine.test_runner import Blocks
ex = build_engine_executor(ModelSpec.from_pretrained(sys.argv[1]), kv_manager=Blocks(), kernels="torch", tp=2,
                           num_threads=1)
print(ex.runner.workers.procs[0].pid, flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)  # never closed: the interpreter's exit ends the rank
time.sleep(60)
"""


@pytest.mark.slow  # a fresh interpreter imports torch: 20-60 s on a shared 2-core machine
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_rank_outlives_its_driver(tmp_path, how):
    """Rank 0's process exits without closing, or is killed: the other rank is gone within seconds."""
    _, path = tiny_checkpoint(tmp_path, "llama")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(path), how], stdout=subprocess.PIPE, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        pid = int(driver.stdout.readline())
        if how == "kill":
            driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        driver.kill()


def _engine_run(tmp_path, *overrides):
    from experiments.run import run
    from tests.experiments.test_run import cfg_with

    run(cfg_with("backend=engine", "model=tiny", "backend.num_threads=1", "workload.num_requests=6",
                 "workload.prompt_len.mean=24", "workload.output_len.mean=6", "output.plots=false", *overrides),
        tmp_path)
    return (tmp_path / "outputs.jsonl").read_text(), (tmp_path / "steps.csv").read_text().splitlines()


def test_a_tp_run_writes_its_rank_count_and_the_one_device_tokens(tmp_path):
    """Through the experiment path, two replicas on one pair of ranks: the tokens of the one-device run, steps.csv
    and metrics.json carrying tp and ep, the step times on the wall clock (a rank's thread time leaves out its
    waits)."""
    from core.output import read_metrics

    one, steps_one = _engine_run(tmp_path / "tp1", "replicas=2")
    two, steps_two = _engine_run(tmp_path / "tp2", "replicas=2", "parallel.tp=2")
    assert two == one
    assert "tp" not in steps_one[0].split(",") and steps_two[0].split(",")[-2:] == ["tp", "ep"]
    assert all(row.endswith(",2,1") for row in steps_two[1:])
    metrics = read_metrics(tmp_path / "tp2" / "metrics.json")
    assert metrics["parallel"] == {"tp": 2, "pp": 1, "dp": 1, "ep": 1} and metrics["engine_clock"] == "wall"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_layers_on_the_triton_grouped_gemm_give_the_cpu_tokens(tmp_path, layout, monkeypatch):
    """CUDA + triton: every MoE layer's experts run as the two grouped GEMMs (counted), fp32, transformers' tokens."""
    from engine.moe import Experts

    hf, path = tiny_checkpoint(tmp_path, layout)
    calls = []
    grouped = Experts._grouped
    monkeypatch.setattr(Experts, "_grouped", lambda self, *a: calls.append(1) or grouped(self, *a))
    assert _generate(path, 1, device="cuda", kernels="triton") == [hf_greedy(hf, p) for p in prompts(0, LENGTHS)]
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(("layout", "ep"), [("llama", 1), ("qwen3_moe", 2)])
def test_tp2_over_nccl_gives_the_one_gpu_tokens(tmp_path, layout, ep):
    _, path = tiny_checkpoint(tmp_path, layout)
    one = _generate(path, 1, device="cuda", kernels="triton")
    assert _generate(path, 2, ep, device="cuda", kernels="triton") == one


@pytest.mark.slow  # a profile, a paired training run, replay and sim on the tiny engine at tp 2: minutes here
def test_compare_runs_unchanged_on_a_tp_run(tmp_path):
    """experiments.compare at parallel.tp=2: the profile and the training run on the ranks (the paired runs share
    them as two replicas), the replay of the TP run's steps identical (logic error zero), a fitted calibration."""
    from experiments.calibration.compare import compare
    from tests.experiments.calibration.test_compare import cfg_with

    cfg = cfg_with("parallel.tp=2", "backend.num_threads=1", "workload.num_requests=6", "workload.output_len.mean=6",
                   "compare.rates=[]", 'compare.train=["workload.num_requests=40","workload.seed=1"]',
                   "calibrate.repeats=1", "calibrate.warmup=1", "calibrate.fits=[linear]",
                   "calibrate.grid.prefill_lens=[16,128]", "calibrate.grid.prefill_cached=[0]",
                   "calibrate.grid.decode_batch_sizes=[1,4]", "calibrate.grid.decode_contexts=[64,256]",
                   "calibrate.grid.mixed_chunks=[32]", "calibrate.grid.mixed_decodes=[2]")
    summary = compare(cfg, tmp_path)
    assert summary["logic"]["identical"] and summary["calibration"]["fitted_here"]
    assert (tmp_path / "engine" / "steps.csv").read_text().splitlines()[0].endswith(",tp,ep")


def test_tp_benchmark_smoke():
    """experiments.bench_tp at its smallest: tp 2's tokens equal tp 1's, its collectives counted (the step
    broadcast, the embedding's all-reduce, two per layer, the logits' gather)."""
    from experiments.benchmarks.tp import main

    out = main(["--hidden", "64", "--layers", "1", "--vocab", "256", "--batch", "2", "--prompt", "8", "--output", "4",
                "--repeats", "1"])
    assert out["tp_1"]["collectives_per_step"] == 0 and out["tp_2"]["collectives_per_step"] == 1 + 1 + 2 + 1
    assert out["tp_2"]["tokens_equal_tp1"] and out["tp_2"]["collective_ms_per_step"] > 0


@pytest.mark.slow  # two engine runs with speculation: ~15 s here
def test_ngram_speculation_under_tp_gives_the_one_device_tokens(tmp_path):
    """Draft verification on rank 0 over the gathered logits: the ranks run the same verify step."""
    one, _ = _engine_run(tmp_path / "tp1", "spec=ngram")
    two, _ = _engine_run(tmp_path / "tp2", "spec=ngram", "parallel.tp=2")
    assert two == one


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tp=2", "parallel.pp=2"], r"parallel.pp=2: the engine runs tensor \(parallel.tp\) and expert"),
    (["model=qwen3_30b_a3b", "model.path=null", "parallel.dp=2", "parallel.ep=2"], r"parallel.dp=2: the engine"),
    (["parallel.tp=2", "cluster=pd", "cluster.prefill_replicas=1", "cluster.decode_replicas=1"],
     r"parallel.tp=2 with cluster=pd"),
    (["parallel.tp=2", "engine_clock=thread"], r"engine_clock=thread needs .* parallel.tp=1"),
])
def test_what_the_engine_does_not_parallelise_is_refused_by_key(tmp_path, overrides, message):
    from experiments.run import run
    from tests.experiments.test_run import cfg_with

    with pytest.raises(ValueError, match=message):
        run(cfg_with("backend=engine", "model=tiny", "backend.num_threads=1", "workload.num_requests=2",
                     "output.plots=false", *overrides), tmp_path)
