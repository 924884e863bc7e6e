"""outputs.jsonl of an engine run: what the model was fed and what it generated, as text when possible."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from core.prompt import materialize
from core.request import RequestState
from core.specs import ModelSpec


def _tokenizer(spec: ModelSpec):
    """The checkpoint's tokenizer if it ships one and transformers is installed; else None."""
    if not spec.path or not any((Path(spec.path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec.path)
    except Exception:  # a broken or unsupported tokenizer must not fail the run
        return None


def outputs_jsonl(states: Iterable[RequestState], spec: ModelSpec, seed: int) -> str:
    """outputs.jsonl's text: one JSON line per request (ids, status, prompt and output token ids, texts)."""
    tok = _tokenizer(spec)
    lines = []
    for s in sorted(states, key=lambda s: (s.request.arrival_s, s.id)):
        row = {"id": s.id, "status": s.status.value,
               "prompt_token_ids": materialize(s.request, spec.vocab_size, seed),
               "output_token_ids": list(s.output_token_ids)}
        if tok is not None:
            row["prompt_text"] = tok.decode(row["prompt_token_ids"])
            row["output_text"] = tok.decode(row["output_token_ids"])
        lines.append(json.dumps(row) + "\n")
    return "".join(lines)


def write_outputs(path: str | Path, states: Iterable[RequestState], spec: ModelSpec, seed: int) -> Path:
    path = Path(path)
    path.write_text(outputs_jsonl(states, spec, seed))
    return path
