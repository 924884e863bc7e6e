"""What the adapter supports: the vLLM versions it was written against, and the features it refuses at start (their
scheduling lives in the parts of vLLM's ``Scheduler.schedule`` the adapter replaces). Plain Python: the checks read
attributes of vLLM's config objects and never import vLLM."""

from __future__ import annotations

import re
from typing import Any

SUPPORTED = ((0, 32), (0, 33))  # [lowest, highest): vLLM 0.32.x, whose scheduler internals the adapter calls


def check_version(version: str) -> None:
    """Refuse a vLLM outside ``SUPPORTED`` (its private scheduler API changes between minor releases)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    lo, hi = SUPPORTED
    if m is None or not lo <= (int(m[1]), int(m[2])) < hi:
        raise ImportError(f"twinserve's vLLM scheduler adapter supports vLLM >= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}; "
                          f"this is vLLM {version}")


def refused_features(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    """The features of this vLLM configuration the adapter does not carry, named as vLLM's options name them."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    checks = [
        (vllm_config.speculative_config is not None, "vLLM's speculative decoding (--speculative-config)"),
        (getattr(model, "is_multimodal_model", False) or getattr(model, "supports_multimodal_inputs", False),
         "multimodal models (encoder inputs)"),
        (getattr(model, "is_encoder_decoder", False), "encoder-decoder models"),
        (getattr(model, "runner_type", "generate") != "generate", f"the {getattr(model, 'runner_type', '')!r} runner "
                                                                  "(pooling models)"),
        (vllm_config.kv_transfer_config is not None, "KV connectors (--kv-transfer-config: P/D, offloading)"),
        (getattr(vllm_config, "ec_transfer_config", None) is not None,
         "encoder-cache connectors (--ec-transfer-config)"),
        (vllm_config.lora_config is not None, "LoRA (--enable-lora)"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism (--pipeline-parallel-size > 1)"),
        (getattr(parallel, "decode_context_parallel_size", 1) > 1
         or getattr(parallel, "prefill_context_parallel_size", 1) > 1, "context parallelism"),
        (getattr(kv_cache_config, "has_mamba_layers", False), "Mamba / hybrid models"),
        (len(kv_cache_config.kv_cache_groups) != 1,
         f"{len(kv_cache_config.kv_cache_groups)} KV cache groups (sliding-window or hybrid attention; one "
         "full-attention group is supported)"),
    ]
    return [name for bad, name in checks if bad]


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    refused = refused_features(vllm_config, kv_cache_config)
    if refused:
        raise ValueError("twinserve's vLLM scheduler adapter does not support: " + "; ".join(refused) +
                         " (structured outputs are refused per request). Run vLLM's own scheduler for these.")


# Per request: refused when added (the request ends with an error; the others run on).
def refused_request(request: Any) -> str:
    """Why a request cannot run under the adapter ('' if it can)."""
    if getattr(request, "use_structured_output", False):
        return "structured outputs (guided decoding / response_format)"
    if getattr(request, "resumable", False):
        return "streaming-input sessions"
    if getattr(request, "kv_transfer_params", None):
        return "kv_transfer_params"
    return ""
