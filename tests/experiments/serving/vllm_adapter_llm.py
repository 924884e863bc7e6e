"""vLLM-CPU with a real (tiny) checkpoint, offline (``vllm.LLM``), greedy: the generated token ids of a prompt set
under vLLM's own scheduler or under the twinserve adapter. Run under .venv-vllm with the repository on PYTHONPATH::

    .venv-vllm/bin/python tests/experiments/serving/vllm_adapter_llm.py CKPT RESULT.json < job.json

A job: ``{"prompts": [[ids], ...], "max_tokens": 16, "runs": [{"scheduler": "own" | "<overrides>", "engine":
{extra LLM arguments}}, ...]}``; the runs share one process (one import of vLLM), each its own engine. Writes a JSON
list, per run ``{"outputs": [[ids], ...], "scheduler": class name, "preemptions": n}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

ADAPTER = "experiments.serving.vllm_adapter.scheduler.TwinserveScheduler"


def main() -> None:
    ckpt, out = sys.argv[1], Path(sys.argv[2])
    job = json.load(sys.stdin)
    results = []
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and the scheduler) in this process
    from vllm import LLM, SamplingParams, TokensPrompt

    for run in job["runs"]:
        args = {"model": ckpt, "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0,
                "max_num_batched_tokens": 512, "max_num_seqs": 16, **run.get("engine", {})}
        if run["scheduler"] != "own":
            args |= {"scheduler_cls": ADAPTER, "additional_config": {"twinserve_scheduler": run["scheduler"]}}
        llm = LLM(**args)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        preemptions = 0
        schedule = sched.schedule

        def counting(*a, _schedule=schedule, **k):
            nonlocal preemptions
            out = _schedule(*a, **k)
            preemptions += len(out.preempted_req_ids or ())
            return out

        sched.schedule = counting
        params = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 16), ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        results.append({"outputs": [list(o.outputs[0].token_ids) for o in outs], "scheduler": type(sched).__name__,
                        "preemptions": preemptions})
        del llm, sched
        gc.collect()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
