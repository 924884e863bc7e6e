"""Record vLLM v1's own scheduling decisions on seeded random request streams: the reference that
``policies/schedulers/vllm_v1.py`` mirrors (``tests/policies/test_vllm_v1.py`` replays each stream through a
``core.replica.Replica`` and compares step by step).

Runs under the vLLM venv (CPU build; no model is loaded or executed)::

    .venv-vllm/bin/python experiments/calibration/vllm_sched_trace.py --seeds 0-39 \
        --out tests/data/vllm_v1_decisions.json

It drives vLLM's ``Scheduler`` in-process, as ``EngineCore.step`` does: requests arriving at step k are added, then
``schedule()``, then ``update_from_output()`` with a ``ModelRunnerOutput`` that samples a fixed token
(``sampled_token``) for every request whose scheduled chunk reaches its last token. It records, per step, the
tokens scheduled per request, the requests preempted and the requests finished.

Conventions both sides share: a step is one ``schedule()`` call; a request arriving at step k is visible to that
step's ``schedule()``; vLLM's pool of ``num_gpu_blocks`` holds one null block, so the replica's pool has
``num_gpu_blocks - 1`` blocks. Nothing here imports the project or anything beyond the standard library at module
level: the test imports the stream definitions (``make_stream``, ``prompt_tokens``, ``sampled_token``) under the
project's venv.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

VOCAB = 1000  # the tiny model's vocabulary; tokens are drawn from [1, VOCAB)
MAX_STEPS = 20_000  # a stream that has not drained by then is stuck (a bug on one side)
Stream = dict[str, Any]


def make_stream(seed: int) -> Stream:
    """A random stream: scheduler and pool settings under vLLM's key names, and requests (arrival step, shared
    prefix, private suffix, output length). Pools range from roomy to barely one request's lifetime, so some streams
    preempt; shared prefixes (some block-aligned, some whole prompts) make prefix caching matter."""
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8, 16, 32])
    chunked = rng.random() < 0.8
    max_num_seqs = rng.choice([1, 2, 3, 4, 6, 8, 16])
    if chunked:
        budget, max_model_len = max(max_num_seqs, rng.choice([16, 24, 32, 48, 64, 96, 128, 256])), 1024
    else:  # vLLM requires max_num_batched_tokens >= max_model_len without chunked prefill
        budget = max_model_len = rng.choice([64, 96, 128, 256])
    threshold = rng.choice([0, 0, 0, 4, 8, 12, 16, 32, 64])
    # prefixes: whole blocks or not, shared by several requests
    prefixes = [rng.choice([block_size * rng.randint(1, 6), rng.randint(1, 90)]) for _ in range(rng.randint(1, 4))]
    requests, step = [], 0
    for i in range(rng.randint(8, 40)):
        step += 0 if i == 0 or rng.random() < 0.4 else rng.randint(1, 8)
        max_tokens = rng.randint(1, 40)
        room = max_model_len - max_tokens
        kind = rng.random()
        group = rng.randrange(len(prefixes)) if kind < 0.7 else -1
        prefix_len = min(prefixes[group], room) if group >= 0 else 0
        suffix_len = 0 if kind < 0.2 else rng.randint(0 if prefix_len else 1, min(120, room - prefix_len))
        if prefix_len + suffix_len == 0:
            suffix_len = 1
        requests.append({"id": str(i), "arrival": step, "prefix": group, "prefix_len": prefix_len,
                         "suffix_len": suffix_len, "max_tokens": max_tokens})
    lifetimes = [-(-(r["prefix_len"] + r["suffix_len"] + r["max_tokens"] - 1) // block_size) for r in requests]
    largest, total = max(lifetimes), sum(lifetimes)
    pool = rng.choice([largest, largest + rng.randint(1, 8), rng.randint(largest, max(largest, total // 2)), total])
    config = {"block_size": block_size, "num_gpu_blocks": pool + 1, "enable_prefix_caching": rng.random() < 0.85,
              "max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
              "long_prefill_token_threshold": threshold,
              "long_prefill_token_threshold_adaptive": threshold > 0 and rng.random() < 0.3,
              "enable_chunked_prefill": chunked, "scheduler_reserve_full_isl": rng.random() < 0.8}
    return {"seed": seed, "config": config, "sampled": rng.choice(["const", "varied"]), "prefixes": prefixes,
            "requests": requests}


def prompt_tokens(stream: Stream, request: dict[str, Any]) -> list[int]:
    """The request's prompt: the first ``prefix_len`` tokens of its prefix group, then a suffix of its own."""
    seed = stream["seed"]
    prefix = []
    if request["prefix"] >= 0:
        rng = random.Random(f"{seed}/prefix/{request['prefix']}")
        prefix = [rng.randrange(1, VOCAB) for _ in range(request["prefix_len"])]
    rng = random.Random(f"{seed}/suffix/{request['id']}")
    return prefix + [rng.randrange(1, VOCAB) for _ in range(request["suffix_len"])]


def sampled_token(stream: Stream, index: int, position: int) -> int:
    """The token the model "samples" as output ``position`` of the stream's ``index``-th request: one token for all
    (requests with equal prompts then share their output blocks too), or one per request and position."""
    if stream["sampled"] == "const":
        return 7
    return 1 + (index * 37 + position * 11) % (VOCAB - 1)


class _VllmSide:
    """vLLM's Scheduler for one stream's settings, built as ``EngineCore`` builds it (one full-attention KV cache
    group, the request block hasher only with prefix caching), for a one-layer model described by a config.json."""

    def __init__(self, config: dict[str, Any], model_dir: str) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32",
                            max_model_len=config["max_model_len"], seed=0)
        keys = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                "long_prefill_token_threshold_adaptive", "enable_chunked_prefill", "scheduler_reserve_full_isl")
        sched = SchedulerConfig(**{k: config[k] for k in keys}, max_model_len=config["max_model_len"],
                                is_encoder_decoder=False, async_scheduling=False)
        cache = CacheConfig(block_size=config["block_size"], enable_prefix_caching=config["enable_prefix_caching"])
        vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
        # the platform may adjust settings: a changed one would make the recording describe another stream
        got = {k: getattr(vc.scheduler_config, k) for k in keys} | {
            "block_size": vc.cache_config.block_size, "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "max_model_len": vc.model_config.max_model_len}
        want = {k: config[k] for k in got}
        if got != want:
            raise RuntimeError(f"vLLM changed the settings: {want} -> {got}")
        if vc.scheduler_config.get_scheduler_cls() is not Scheduler:
            raise RuntimeError(f"vLLM picked {vc.scheduler_config.get_scheduler_cls()}, not the synchronous Scheduler")
        vc.cache_config.num_gpu_blocks = config["num_gpu_blocks"]
        spec = FullAttentionSpec(block_size=config["block_size"], num_kv_heads=2, head_size=32, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=config["num_gpu_blocks"], kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, vc)
        self.scheduler = Scheduler(vc, kv, StructuredOutputManager(vc), block_size=block_size,
                                   hash_block_size=hash_block_size, log_stats=False)
        self.hasher = None
        if config["enable_prefix_caching"]:
            hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self.hasher = get_request_block_hasher(hash_block_size, hash_fn)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, step: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(request_id, prompt, params, None, arrival_time=float(step),
                                           block_hasher=self.hasher))

    def step(self, token_for: Any) -> dict[str, Any]:
        """One ``EngineCore.step``: schedule, sample ``token_for(request_id, position)`` for every request whose
        chunk completes its sequence, update. Returns the step's record."""
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.scheduler
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = sched.requests[rid]  # num_computed_tokens already counts this step's chunk
            sampled.append([token_for(rid, req.num_output_tokens)] if req.num_computed_tokens >= req.num_tokens
                           else [])
        result = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        finished = sorted(o.request_id for outs in result.values() for o in outs.outputs if o.finished)
        return step_record(dict(out.num_scheduled_tokens), out.preempted_req_ids, finished)


def step_record(scheduled: dict[str, int], preempted: Any, finished: Any) -> dict[str, Any]:
    """One step as the recording stores it: tokens per request (in scheduling order), preempted and finished ids
    (sorted; empty lists left out)."""
    rec: dict[str, Any] = {"s": scheduled}
    if preempted:
        rec["p"] = sorted(preempted)
    if finished:
        rec["f"] = sorted(finished)
    return rec


def record(stream: Stream, model_dir: str) -> list[dict[str, Any]]:
    """vLLM's decisions on ``stream``, one record per step until every request has finished."""
    side = _VllmSide(stream["config"], model_dir)
    requests = stream["requests"]
    index = {r["id"]: i for i, r in enumerate(requests)}
    pending = sorted(requests, key=lambda r: r["arrival"])
    steps: list[dict[str, Any]] = []
    k = 0
    while pending or side.scheduler.get_num_unfinished_requests():
        while pending and pending[0]["arrival"] <= k:
            r = pending.pop(0)
            side.add(r["id"], prompt_tokens(stream, r), r["max_tokens"], k)
        steps.append(side.step(lambda rid, pos: sampled_token(stream, index[rid], pos)))
        k += 1
        if k > MAX_STEPS:
            raise RuntimeError(f"stream {stream['seed']}: not drained after {MAX_STEPS} steps")
    return steps


def write_model_config(directory: str) -> str:
    """A one-layer Llama shape (config.json only: vLLM reads the architecture and max_model_len, loads nothing)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": VOCAB,
           "max_position_embeddings": 4096, "torch_dtype": "float32"}
    (Path(directory) / "config.json").write_text(json.dumps(cfg))
    return directory


def parse_seeds(text: str) -> list[int]:
    """``0-39`` or ``1,5,9`` (or a mix: ``0-9,20``)."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += range(int(lo), int(hi or lo) + 1)
    return seeds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-39", help="stream seeds: 0-39, or 1,5,9")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    import vllm

    streams = []
    with tempfile.TemporaryDirectory() as model_dir:
        write_model_config(model_dir)
        for seed in parse_seeds(args.seeds):
            stream = make_stream(seed)
            stream["steps"] = record(stream, model_dir)
            streams.append(stream)
            print(f"seed {seed}: {len(stream['steps'])} steps", file=sys.stderr)
    args.out.write_text(json.dumps({"vllm": vllm.__version__, "streams": streams}, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
