"""ModelRunner / EngineExecutor: greedy outputs identical to transformers under any chunking, batching mix,
prefix reuse and recompute (dense, Qwen3 and mixture-of-experts layouts); input validation; executor contract;
input-preparation overhead."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from core.batch import Batch, Chunk
from core.interfaces import Executor
from core.prompt import materialize
from core.request import Request, RequestState, SamplingParams, Status
from engine.attention import allocate_kv_caches
from engine.executor import EngineExecutor, build_engine_executor
from engine.loader import load_model
from engine.runner import ModelRunner
from kernels.cpu_gemm import gemm_library
from kernels.greedy_screen import screen_library
from tests.engine.checkpoints import MOE_LAYOUTS, TINY, tiny_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 96
NEW_TOKENS = 8
RUN_LAYOUTS = ("llama", "qwen2", "qwen3", *MOE_LAYOUTS)  # the layouts every scheduling path is checked on


@dataclass
class Blocks:
    """Minimal block allocator: per-request tables grown on demand; ``share`` copies a prefix of another table."""

    free: list[int] = field(default_factory=lambda: list(range(NUM_BLOCKS - 1, -1, -1)))  # scattered ids
    tables: dict[str, list[int]] = field(default_factory=dict)
    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS

    def ensure(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(request_id, [])
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())

    def share(self, request_id: str, source_id: str, num_blocks: int) -> None:
        self.tables[request_id] = list(self.tables[source_id][:num_blocks])

    def drop(self, request_id: str) -> None:
        self.free += reversed(self.tables.pop(request_id))

    def block_table(self, request_id: str) -> list[int]:
        return self.tables[request_id]


def _state(rid: str, prompt: list[int], max_new: int = NEW_TOKENS) -> RequestState:
    return RequestState(Request(rid, 0.0, len(prompt), max_new, prompt_token_ids=tuple(prompt)))


def run_to_completion(runner: ModelRunner, blocks: Blocks, states: list[RequestState],
                      chunk_size: int | None) -> None:
    """A tiny replica loop: every unfinished request gets its next chunk in every step (mixed prefill/decode)."""
    while active := [s for s in states if s.num_output_tokens < s.request.max_new_tokens]:
        chunks = []
        for s in active:
            n = s.num_remaining_tokens if chunk_size is None else min(chunk_size, s.num_remaining_tokens)
            blocks.ensure(s.id, s.num_computed_tokens + n)
            chunks.append(Chunk.next(s, n))
        batch = Batch(chunks)
        tokens = iter(runner.execute(batch, blocks.block_table))
        for ch in batch.chunks:  # what Replica.apply does
            ch.state.num_computed_tokens = ch.end
            if ch.samples:
                ch.state.output_token_ids.append(next(tokens))
        assert next(tokens, None) is None


def hf_greedy(hf, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # explicit mask: generate would treat pad-id tokens in the prompt as padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, our model) for RUN_LAYOUTS, loaded once per module."""
    out = {}
    for layout in RUN_LAYOUTS:
        hf, path = tiny_checkpoint(tmp_path_factory.mktemp(layout), layout)
        out[layout] = (hf, load_model(path))
    return out


@pytest.fixture(scope="module")
def mixed(tiny):
    """Prompts of different lengths and their transformers greedy continuations, per layout (computed once)."""
    ps = prompts(0, [5, 13, 22])
    return ps, {layout: [hf_greedy(hf, p) for p in ps] for layout, (hf, _) in tiny.items()}


def make_runner(model, kernels: str = "torch", kv_dtype: str = "auto") -> ModelRunner:
    caches = allocate_kv_caches(model.spec, NUM_BLOCKS, BLOCK_SIZE, model.dtype, "cpu", kv_dtype)
    return ModelRunner(model, model.spec, kernels, caches, BLOCK_SIZE, "cpu")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("layout", RUN_LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_chunked_mixed_batch_greedy_matches_transformers(tiny, mixed, layout, chunk_size):
    ps, refs = mixed
    states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
    run_to_completion(make_runner(tiny[layout][1]), Blocks(), states, chunk_size)
    assert [s.output_token_ids for s in states] == refs[layout]


@pytest.mark.parametrize("layout", ["llama", "qwen3", *MOE_LAYOUTS])
def test_cached_prefix_computes_only_the_suffix(tiny, layout):
    hf, model = tiny[layout]
    runner, blocks = make_runner(model), Blocks()
    shared, tail_a, tail_b = prompts(1, [17, 3, 6])
    a = _state("a", shared + tail_a)
    run_to_completion(runner, blocks, [a], None)
    # b reuses a's first 4 full blocks (16 tokens); only its remaining 7 prompt tokens are computed
    b = _state("b", shared + tail_b)
    blocks.share("b", "a", 4)
    b.num_computed_tokens = 16
    fed = []
    real_prepare = runner.prepare
    runner.prepare = lambda batch, bt, *drafts: fed.append(batch.features.num_batched_tokens) or real_prepare(batch, bt)
    run_to_completion(runner, blocks, [b], None)
    assert fed[0] == 7
    assert b.output_token_ids == hf_greedy(hf, shared + tail_b)
    assert a.output_token_ids == hf_greedy(hf, shared + tail_a)


@pytest.mark.parametrize("layout", ["qwen2", "qwen3", *MOE_LAYOUTS])
def test_recompute_after_preemption(tiny, layout):
    """Prompt + outputs so far recomputed into fresh blocks in chunks, then decoding resumes."""
    hf, model = tiny[layout]
    runner, blocks = make_runner(model), Blocks()
    (p,) = prompts(2, [9])
    s = _state("p", p)
    s.request = Request("p", 0.0, len(p), 3, prompt_token_ids=tuple(p))
    run_to_completion(runner, blocks, [s], 4)
    blocks.drop("p")
    s.num_computed_tokens = 0
    s.request = Request("p", 0.0, len(p), NEW_TOKENS, prompt_token_ids=tuple(p))
    run_to_completion(runner, blocks, [s], 5)  # chunk 5 straddles the prompt / output boundary at 9..12
    assert s.output_token_ids == hf_greedy(hf, p)


def test_per_request_sampling_in_mixed_batches(tiny, mixed):
    """Greedy requests batched with random ones still match transformers; a seeded request generates the same
    tokens alone and batched with others (in other chunks); its generator is dropped on release."""
    ps, refs = mixed
    _, model = tiny["llama"]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)

    def make(rid, prompt, sampling=None):
        return RequestState(Request(rid, 0.0, len(prompt), NEW_TOKENS, prompt_token_ids=tuple(prompt),
                                    sampling=sampling))

    alone = make("s", ps[2], seeded)
    run_to_completion(make_runner(model), Blocks(), [alone], None)
    greedy = [make(f"g{i}", p) for i, p in enumerate(ps)]
    batched = make("s", ps[2], seeded)
    others = [make("hot", ps[0], SamplingParams(temperature=1.5)), make("s2", ps[1], SamplingParams(1.0, seed=12))]
    runner = make_runner(model)
    run_to_completion(runner, Blocks(), [*greedy, batched, *others], 7)
    assert [g.output_token_ids for g in greedy] == refs["llama"]
    assert batched.output_token_ids == alone.output_token_ids
    assert alone.output_token_ids != hf_greedy(tiny["llama"][0], ps[2])  # it did sample
    assert set(runner.sampler._seeded) == {"s", "s2"}
    runner.release("s")
    assert set(runner.sampler._seeded) == {"s2"}


def test_materialised_prompts(tiny):
    """Requests without token ids (hash ids, or unique content) feed core.prompt.materialize's tokens."""
    hf, model = tiny["llama"]
    reqs = [Request("h", 0.0, 10, 4, hash_ids=(3, 4, 5), tokens_per_hash_id=4), Request("u", 0.0, 7, 4)]
    states = [RequestState(r) for r in reqs]
    runner = make_runner(model)
    run_to_completion(runner, Blocks(), states, 3)
    for s in states:
        assert s.output_token_ids == hf_greedy(hf, materialize(s.request, TINY["vocab_size"]), 4)
    runner.release("h")
    assert "h" not in runner._prompts and "u" in runner._prompts
    states[1].status = Status.FINISHED  # never released: swept once the cache reaches its prune size
    runner._prune_at = 1
    run_to_completion(runner, Blocks(), [_state("n", [1, 2])], None)
    assert set(runner._prompts) == {"n"}


@pytest.mark.parametrize("chunk_size", [4, None])
def test_native_backend_matches_transformers_and_plans_what_it_needs(tiny, mixed, chunk_size):
    """The native backend: greedy tokens as transformers' (decodes in C, chunked prefills next to decodes through
    the torch path); decode-only steps get no attention plan and no K/V copies. With an int8 cache its attention
    is the torch path's, decode copies included, and its tokens the torch backend's."""
    ps, refs = mixed
    runner = make_runner(tiny["llama"][1], kernels="native")
    states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
    plans, prepare = [], runner.prepare

    def recording(batch, *args):
        inputs = prepare(batch, *args)
        plans.append(inputs.meta.plan)
        return inputs

    runner.prepare = recording
    try:
        run_to_completion(runner, Blocks(), states, chunk_size)
    finally:
        del runner.prepare
    assert [s.output_token_ids for s in states] == refs["llama"]
    assert runner._decode_cache is None and None in plans and any(p is not None for p in plans)
    outs = []
    for kernels in ("torch", "native"):
        states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
        runner = make_runner(tiny["llama"][1], kernels=kernels, kv_dtype="int8")
        run_to_completion(runner, Blocks(), states, chunk_size)
        assert runner._decode_cache is not None and runner._decode_cache.appends > 0
        outs.append([s.output_token_ids for s in states])
    assert outs[0] == outs[1]


def _cpu_matmuls(model) -> list:
    """The CpuLinears a model's steps run: its decoder layers' (experts included) and the LM head's."""
    from engine.moe import Experts

    out = [model.logits_matmul]
    for m in model.model.layers.modules():
        if hasattr(m, "matmul"):
            out.append(m.matmul)
        elif isinstance(m, Experts):
            out += [c for pair in m.matmuls for c in pair]
    return out


@pytest.mark.parametrize("layout", ["llama", "mixtral"])
def test_cpu_gemm_choice_keeps_the_tokens(tiny, mixed, layout):
    """backend.cpu_gemm=native (every GEMM on the native kernel) gives transformers' greedy tokens too, on the
    model's own Linear layers, experts and LM head; switching back restores the per-row-count choice."""
    ps, refs = mixed
    model = tiny[layout][1]
    try:
        model.use_cpu_gemm("native")
        assert all(c.native_only for c in _cpu_matmuls(model))
        model.pack_cpu_weights()  # every weight, each expert's included, packed before the first step
        assert gemm_library() is None or all(c.native is not None for c in _cpu_matmuls(model))
        states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
        run_to_completion(make_runner(model, kernels="native"), Blocks(), states, None)
        assert [s.output_token_ids for s in states] == refs[layout]
        with pytest.raises(ValueError, match="backend.cpu_gemm"):
            model.use_cpu_gemm("mkl")
    finally:
        model.use_cpu_gemm("auto")
    assert not any(c.native_only for c in _cpu_matmuls(model))


class _Counting:
    """Wraps a model's greedy screen: how often it gave tokens."""

    def __init__(self, screen):
        self.screen, self.hits, self.calls = screen, 0, 0

    def __call__(self, hidden, weight):
        self.calls += 1
        out = self.screen(hidden, weight)
        self.hits += out is not None
        return out


@pytest.mark.parametrize("layout", RUN_LAYOUTS)
def test_greedy_screen_keeps_the_tokens(tiny, mixed, layout):
    """backend.greedy_screen: greedy steps take their tokens from the LM head's int8 screen (where the CPU runs it)
    and they are transformers' greedy tokens, chunked or not; off, the screen is never asked."""
    ps, refs = mixed
    model = tiny[layout][1]
    counting = model.greedy_screen = _Counting(model.greedy_screen)
    try:
        for chunk_size in (None, 3):
            states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
            run_to_completion(make_runner(model, kernels="native"), Blocks(), states, chunk_size)
            assert [s.output_token_ids for s in states] == refs[layout]
        assert counting.calls > 0 and counting.hits == (counting.calls if screen_library() is not None else 0)
        model.use_greedy_screen(False)
        assert model.greedy_screen is None and model.greedy_tokens(torch.zeros(1, model.spec.hidden_size)) is None
        states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
        run_to_completion(make_runner(model, kernels="native"), Blocks(), states, None)
        assert [s.output_token_ids for s in states] == refs[layout]
    finally:
        model.greedy_screen = counting.screen


def test_rows_that_sample_or_fail_the_screen_take_the_full_logits(tiny):
    """A batch with a random-sampling request computes every logit (the screen is not asked); a screen that
    declines (None: e.g. a non-finite hidden row) leaves the step to the logits and the sampler."""
    _, model = tiny["llama"]
    counting = model.greedy_screen = _Counting(model.greedy_screen)
    try:
        hot = RequestState(Request("hot", 0.0, 4, 3, prompt_token_ids=(1, 2, 3, 4),
                                   sampling=SamplingParams(temperature=1.0, seed=7)))
        states = [hot, _state("g", [5, 6, 7], 3)]
        run_to_completion(make_runner(model, kernels="native"), Blocks(), states, None)
        assert counting.calls == 0 and all(len(s.output_token_ids) == 3 for s in states)
        model.greedy_screen = lambda hidden, weight: None
        states = [_state("a", [5, 6, 7], 3)]
        run_to_completion(make_runner(model, kernels="native"), Blocks(), states, None)
        reference = [_state("a", [5, 6, 7], 3)]
        model.use_greedy_screen(False)
        run_to_completion(make_runner(model, kernels="native"), Blocks(), reference, None)
        assert states[0].output_token_ids == reference[0].output_token_ids
    finally:
        model.greedy_screen = counting.screen


def test_int8_kv_generation_runs(tiny):
    hf, model = tiny["llama"]
    states = [_state(f"r{i}", p) for i, p in enumerate(prompts(3, [6, 11]))]
    run_to_completion(make_runner(model, kv_dtype="int8"), Blocks(), states, 7)
    assert all(len(s.output_token_ids) == NEW_TOKENS for s in states)


def test_bad_inputs_are_named(tiny):
    _, model = tiny["llama"]
    runner, blocks = make_runner(model), Blocks()
    s = _state("x", [1, 2, 3, 4, 5, 6])
    blocks.ensure("x", 4)  # one block, 6 tokens need two
    with pytest.raises(ValueError, match="request x: 6 tokens need 2 blocks"):
        runner.execute(Batch([Chunk.next(s, 6)]), blocks.block_table)
    big = _state("v", [TINY["vocab_size"]])
    blocks.ensure("v", 1)
    with pytest.raises(ValueError, match=r"request v: prompt token ids must be in \[0, 160\)"):
        runner.execute(Batch([Chunk.next(big, 1)]), blocks.block_table)
    long = _state("l", [1] * (TINY["max_position_embeddings"] + 1))
    with pytest.raises(ValueError, match="request l: position 256 is beyond max_model_len 256"):
        runner.execute(Batch([Chunk.next(long, len(long.request.prompt_token_ids))]), lambda _: list(range(100)))


def test_executor_contract_and_shared_model(tiny):
    hf, model = tiny["llama"]
    ex1 = build_engine_executor(model.spec, kv_manager=Blocks(), model=model)
    ex2 = build_engine_executor(model.spec, kv_manager=Blocks(), model=model)
    assert isinstance(ex1, Executor)
    assert ex1.runner.model is ex2.runner.model
    assert ex1.runner.kv_caches[0].k.data_ptr() != ex2.runner.kv_caches[0].k.data_ptr()
    (p,) = prompts(4, [10])
    for ex in (ex1, ex2):
        s = _state("e", p, 1)
        ex.kv_manager.ensure("e", 10)
        out = ex.execute(Batch([Chunk.next(s, 6)]))  # partial prefill: nothing sampled
        assert out.tokens == [] and out.duration_s > 0
        s.num_computed_tokens = 6
        out = ex.execute(Batch([Chunk.next(s, 4)]))
        assert out.tokens == hf_greedy(hf, p, 1) and out.duration_s > 0
    assert ex1.execute(Batch([])).tokens == []
    with pytest.raises(ValueError, match="block_size"):
        EngineExecutor(ex1.runner, Blocks(block_size=8))


def test_build_engine_executor_random_weights():
    from tests.engine.test_loader import SPEC
    blocks = Blocks()
    ex = build_engine_executor(SPEC, kv_manager=blocks, kv_dtype="int8", seed=3)
    assert ex.runner.kv_caches[0].k.dtype == torch.int8 and len(ex.runner.kv_caches[0].k) == NUM_BLOCKS
    s = _state("z", [5, 6, 7])
    blocks.ensure("z", 3)
    (tok,) = ex.execute(Batch([Chunk.next(s, 3)])).tokens
    assert 0 <= tok < SPEC.vocab_size


def _decode_batch(n: int, context: int) -> tuple[Batch, Blocks]:
    blocks, chunks = Blocks(num_blocks=n * (context // BLOCK_SIZE + 1)), []
    blocks.free = list(range(blocks.num_blocks))
    for i, p in enumerate(prompts(5, [context - 1] * n)):
        s = _state(f"d{i}", p)
        s.output_token_ids.append(1)
        s.num_computed_tokens = context - 1
        blocks.ensure(s.id, context)
        chunks.append(Chunk.next(s, 1))
    return Batch(chunks), blocks


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


@pytest.mark.bench
def test_input_prep_overhead_at_batch_32(tiny):
    """Input preparation (the runner's Python) under 10% of a decode step of 32 sequences on the tiny model."""
    _, model = tiny["llama"]
    batch, blocks = _decode_batch(32, 64)
    caches = allocate_kv_caches(model.spec, blocks.num_blocks, BLOCK_SIZE, model.dtype, "cpu")
    runner = ModelRunner(model, model.spec, "torch", caches, BLOCK_SIZE, "cpu")
    runner.execute(batch, blocks.block_table)  # warm up (and cache prompts)
    prep = _median_time(lambda: runner.prepare(batch, blocks.block_table), 50)
    step = _median_time(lambda: runner.execute(batch, blocks.block_table), 50)
    print(f"prepare {prep * 1e6:.0f} us, step {step * 1e6:.0f} us, share {prep / step:.1%}")
    assert prep < 0.10 * step


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["llama", "qwen3_moe"])  # qwen3_moe: q/k norms, a dense and an MoE layer
def test_triton_backend_mixed_batch_matches_transformers(tiny, mixed, layout):
    ps, refs = mixed
    states = [_state(f"r{i}", p) for i, p in enumerate(ps[:2])]
    run_to_completion(make_runner(tiny[layout][1], kernels="triton"), Blocks(), states, 7)
    assert [s.output_token_ids for s in states] == refs[layout][:2]


@pytest.mark.interpreter
def test_triton_w4a16_engine_matches_torch_w4a16(tiny, mixed):
    """A 4-bit model through the Triton kernels (decode steps of <= GEMV_MAX_M rows take the dot-free GEMV,
    prefill chunks the tl.dot GEMM) gives the torch backend's greedy tokens on the same quantised weights."""
    import copy

    model = copy.deepcopy(tiny["qwen2"][1])  # qwen2: its qkv bias takes the kernels' bias path too
    model.quantize(group_size=32)
    outs = []
    for kernels in ("torch", "triton"):
        states = [_state(f"r{i}", p, 4) for i, p in enumerate(mixed[0][:2])]
        run_to_completion(make_runner(model, kernels=kernels), Blocks(), states, 7)
        outs.append([s.output_token_ids for s in states])
    assert outs[0] == outs[1] and all(len(o) == 4 for o in outs[1])


def test_decode_cache_in_use_and_rebuilt_after_a_failed_step(tiny, mixed):
    """Steady decoding appends to the runner's DecodeCache; a step that fails after some layers appended (and
    others not) leaves no stale copies: its rerun (same lengths, so no continuation) rebuilds them."""
    ps, refs = mixed
    runner, blocks = make_runner(tiny["llama"][1]), Blocks()
    states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
    run_to_completion(runner, blocks, states, None)
    assert [s.output_token_ids for s in states] == refs["llama"]
    assert runner._decode_cache.appends >= NEW_TOKENS - 3

    runner, blocks = make_runner(tiny["llama"][1]), Blocks()
    states = [_state(f"r{i}", p) for i, p in enumerate(ps)]
    attn = runner.model.model.layers[1].self_attn
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 4:  # a decode step (prefill was call 1), after layer 0 appended
            raise RuntimeError("injected")
        return type(attn).attend(attn, *args)

    attn.attend = flaky
    try:
        with pytest.raises(RuntimeError, match="injected"):
            run_to_completion(runner, blocks, states, None)
        run_to_completion(runner, blocks, states, None)  # the failed step reruns: its K/V are rewritten
    finally:
        del attn.attend
    assert [s.output_token_ids for s in states] == refs["llama"]


def test_warmup_leaves_no_stale_decode_copies(tiny):
    """A request that decodes alone, with the warm-up's context length plus one on the warm-up's blocks, must not
    reuse the warm-up's K/V copies (the decode cache names its owners)."""
    from core.kv_cache import KVCacheManager
    from core.loop import ServingLoop
    from core.replica import Replica, SchedulerLimits
    from policies.eviction.lru import LRUEviction
    from policies.routers.round_robin import RoundRobinRouter
    from policies.schedulers.sarathi import SarathiScheduler
    from sim.clock import run_virtual
    from tests.helpers import ListWorkload

    model = tiny["llama"][1]
    outputs = []
    for warm in (0, 2):
        kv = KVCacheManager(32, 16, LRUEviction())
        ex = build_engine_executor(model.spec, kv_manager=kv, model=model)
        ex.warmup(steps=warm, prompt_len=32)
        req = Request("r", 0.0, 33, 6, prompt_token_ids=tuple(range(100, 133)))
        loop = ServingLoop([Replica(0, SarathiScheduler(), kv, SchedulerLimits(64, 4, model.spec.max_model_len))],
                           [ex], RoundRobinRouter(), ListWorkload([req]))
        outputs.append(run_virtual(loop).states[0].output_token_ids)
    assert outputs[0] == outputs[1]
