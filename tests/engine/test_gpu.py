"""GPU-only engine checks (skipped without CUDA; run by `make gpu-check`): no device-to-host sync inside a step's
forward pass, and no Triton compile or autotune after the executor's warm-up."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from core.kv_cache import KVCacheManager
from core.shapes import ShapedBatch
from core.specs import ModelSpec
from engine.executor import build_engine_executor
from policies.eviction.lru import LRUEviction

pytestmark = pytest.mark.gpu
CONF = Path(__file__).resolve().parents[2] / "conf"
# decode-only (one long context: split-K), mixed (a chunk next to a long decode), prefill after a cached prefix
SHAPES = [dict(decodes=(1500, 40, 7)), dict(prefills=((0, 64),), decodes=(1200,)), dict(prefills=((32, 40),)),
          dict(decodes=(300,) * 9)]


def _executor(quant=None, kv_dtype="auto"):
    spec = ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF / "model" / "tiny.yaml")))
    kv = KVCacheManager(1024, 16, LRUEviction(), False)
    ex = build_engine_executor(spec, kv_manager=kv, kernels="triton", device="cuda", quant=quant, group_size=128,
                               kv_dtype=kv_dtype)
    ex.warmup(2)
    return kv, ex


@pytest.mark.parametrize(("quant", "kv_dtype"), [(None, "auto"), ("w4a16", "auto"), (None, "int8")])
def test_forward_never_syncs_with_the_host(quant, kv_dtype):
    kv, ex = _executor(quant, kv_dtype)
    r = ex.runner
    assert r.model.dtype == torch.bfloat16  # an fp32 model runs in bf16 on a GPU by default
    for i, shape in enumerate(SHAPES):
        shape = ShapedBatch(**shape, name=f"s{i}")
        batch = shape.admit(kv)
        inputs = r.prepare(batch, kv.block_table)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                hidden = r.model(inputs.input_ids, inputs.positions, inputs.meta, r.kv_caches, r.kernels,
                                 rows=inputs.logits_rows)
                r.sampler(r.model.compute_logits(hidden), inputs.sample_states)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        shape.release(kv)


def _compiled_variants() -> int:
    """Compiled kernels and autotuned keys over every Triton kernel of the engine."""
    from kernels import activation, attention, kv_store, norm, rope, w4a16

    n = 0
    for module in (activation, attention, kv_store, norm, rope, w4a16):
        for obj in vars(module).values():
            n += len(getattr(obj, "cache", {}) if type(obj).__name__ == "Autotuner" else {})
            for caches in getattr(obj, "device_caches", {}).values():
                n += len(caches[0])
    return n


@pytest.mark.parametrize("quant", [None, "w4a16"])
def test_warmup_compiles_every_variant(quant):
    kv, ex = _executor(quant)
    before = _compiled_variants()
    for i, shape in enumerate([*SHAPES, dict(decodes=(2,)), dict(prefills=((0, 700),))]):
        shape = ShapedBatch(**shape, name=f"w{i}")
        ex.execute(shape.admit(kv))
        shape.release(kv)
    assert _compiled_variants() == before


@pytest.mark.parametrize("batch", [1, 3, 9, 40])
def test_cuda_graph_decodes_match_eager(batch):
    """Greedy decodes replayed from the bucket's CUDA graph (padded to 1/4/16/48 rows) give the eager step's tokens
    and, up to the split-K summation order, its logits; a graph replay never writes a padding row's KV."""
    spec = ModelSpec.from_mapping(OmegaConf.to_container(OmegaConf.load(CONF / "model" / "tiny.yaml")))
    kv = KVCacheManager(4096, 16, LRUEviction(), False)
    ex = build_engine_executor(spec, kv_manager=kv, kernels="triton", device="cuda", dtype=torch.float32)
    ex.warmup(2, cuda_graphs=True)
    r = ex.runner
    graphs = r.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets
    shape = ShapedBatch(decodes=tuple(50 + 37 * i for i in range(batch)), name="g")
    batch_ = shape.admit(kv)
    before = r.kv_caches[0].k.clone()  # never-written blocks hold garbage (NaNs too): compare bytes
    with torch.inference_mode():
        inputs = r.prepare(batch_, kv.block_table)
        replayed = graphs.run(inputs.input_ids, inputs.positions, inputs.meta).clone()
        r.graphs = None
        eager = r.model.compute_logits(r.model(inputs.input_ids, inputs.positions, inputs.meta, r.kv_caches,
                                               r.kernels, rows=inputs.logits_rows))
    written = set(inputs.meta.slot_mapping.tolist())
    after = r.kv_caches[0].k
    changed = (before.view(torch.uint8) != after.view(torch.uint8)).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {s // 16 for s in written}  # padding rows wrote nothing
    assert replayed.shape == eager.shape
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
    assert replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    shape.release(kv)
