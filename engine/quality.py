"""Quality gate for quantised inference: how far W4A16 weights and / or an int8 KV cache move an engine model's
outputs from the same model unquantised, on a fixed prompt set.

Per prompt, the reference (unquantised weights, model-dtype KV) prefills the prompt and greedily generates
``new_tokens`` tokens. Each quantised candidate is then run twice on its own fresh KV cache:

- teacher-forced: the prompt as one prefill step, then the reference's generated tokens one decode step at a time,
  so both models predict the same positions (prompt positions through the prefill path, continuation positions
  through the decode path, which reads the candidate's own, possibly int8, cache). Logit errors, top-1 agreement
  and KL divergence are taken over all these positions;
- free-running greedy: the candidate generates ``new_tokens`` tokens itself; they are compared with the
  reference's position by position (after a first difference the two continuations usually part ways, so
  ``greedy_first_divergence`` is reported too).

The model runs through the same ``forward`` / kernels / paged KV cache as in serving; only the batching is simpler
(one sequence, identity block table).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core.checks import check_int
from core.specs import ModelSpec
from engine.attention import AttentionMetadata, allocate_kv_caches
from engine.loader import QUANT_MODES, build_model, load_model
from engine.model import Linear, LlamaForCausalLM
from kernels.ops import KernelSet, get_kernels

SETTING_PARTS = {"none": {}, "w4a16": {"quant": "w4a16"}, "kv_int8": {"kv_dtype": "int8"}}


@dataclass(frozen=True)
class QuantSetting:
    """One quantised configuration compared with the unquantised model."""

    name: str
    quant: str | None = None  # None | "w4a16"
    group_size: int = 128
    kv_dtype: str = "auto"  # "auto" (model dtype) | "int8"

    @classmethod
    def parse(cls, name: str, group_size: int = 128) -> QuantSetting:
        """``"w4a16"``, ``"kv_int8"``, ``"w4a16+kv_int8"`` or ``"none"`` (parts joined by ``+``)."""
        fields: dict = {}
        for part in str(name).split("+"):
            if part not in SETTING_PARTS:
                raise ValueError(f"quant setting {name!r}: unknown part {part!r}; allowed parts: "
                                 f"{list(SETTING_PARTS)} joined by '+'")
            fields |= SETTING_PARTS[part]
        return cls(str(name), group_size=group_size, **fields)


@dataclass(frozen=True)
class QualityMetrics:
    """One setting against the reference. Logit errors are over every compared (position, vocab) entry."""

    setting: str
    positions: int  # teacher-forced positions compared (prompt + continuation, all prompts)
    max_abs_logit_err: float
    mean_abs_logit_err: float
    rel_logit_err: float  # ||quant - ref||_2 / ||ref||_2 over all compared logits
    max_rel_logit_err: float  # max |quant - ref| / max |ref|
    top1_agreement: float  # share of positions whose argmax token is the reference's
    kl_mean: float  # mean over positions of KL(p_ref || p_quant), nats
    kl_max: float
    greedy_token_agreement: float  # share of free-running greedy tokens equal to the reference's at that index
    greedy_exact: float  # share of prompts whose whole greedy continuation equals the reference's
    greedy_first_divergence: float  # mean index of the first differing greedy token (new_tokens if none)


@dataclass(frozen=True)
class QualityReport:
    model: str
    dtype: str
    kernels: str
    num_prompts: int
    prompt_tokens: int  # summed over prompts
    new_tokens: int
    rows: list[QualityMetrics]

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    def format_table(self) -> str:
        head = ["setting", "positions", "max|dlogit|", "mean|dlogit|", "rel err", "top-1 agree", "KL mean",
                "KL max", "greedy agree", "greedy exact", "1st diverge"]
        rows = [[r.setting, str(r.positions), f"{r.max_abs_logit_err:.4g}", f"{r.mean_abs_logit_err:.4g}",
                 f"{r.rel_logit_err:.3%}", f"{r.top1_agreement:.3f}", f"{r.kl_mean:.3g}", f"{r.kl_max:.3g}",
                 f"{r.greedy_token_agreement:.3f}", f"{r.greedy_exact:.2f}", f"{r.greedy_first_divergence:.1f}"]
                for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        title = (f"{self.model} ({self.dtype}, {self.kernels} kernels): {self.num_prompts} prompts, "
                 f"{self.prompt_tokens} prompt tokens, {self.new_tokens} new tokens each; vs the unquantised model")
        return "\n".join([title] + ["  " + "  ".join(c.rjust(w) for c, w in zip(x, widths, strict=True))
                                    for x in [head, *rows]])


class _Sequence:
    """One sequence on one model with its own paged KV cache: ``feed`` tokens, get their logits."""

    def __init__(self, model: LlamaForCausalLM, kernels: KernelSet, kv_dtype: str, max_tokens: int,
                 block_size: int) -> None:
        num_blocks = -(-max_tokens // block_size)
        self.model, self.kernels = model, kernels
        self.caches = allocate_kv_caches(model.spec, num_blocks, block_size, model.dtype, model.device, kv_dtype)
        self.table = torch.arange(num_blocks, dtype=torch.int32, device=model.device)[None]
        self.pos = 0

    @torch.inference_mode()
    def feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of the fed tokens, appended after what was fed before."""
        dev, start, n = self.model.device, self.pos, len(token_ids)
        end = start + n
        positions = torch.arange(start, end, device=dev)
        # identity block table: block i holds positions [i * block_size, (i + 1) * block_size), so slot = position
        meta = AttentionMetadata(positions, torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 torch.tensor([end], dtype=torch.int32, device=dev), self.table, n, end)
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=dev)
        hidden = self.model(ids, positions, meta, self.caches, self.kernels)
        self.pos = end
        return self.model.compute_logits(hidden).float()


def _greedy(seq: _Sequence, prompt: Sequence[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation and the logits of every fed position (prompt rows, then one row per fed token)."""
    logits = [seq.feed(prompt)]
    tokens = [int(logits[-1][-1].argmax())]
    while len(tokens) < new_tokens:
        logits.append(seq.feed(tokens[-1:]))
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, logits


def _teacher_forced(seq: _Sequence, prompt: Sequence[int], continuation: Sequence[int]) -> list[torch.Tensor]:
    logits = [seq.feed(prompt)]
    logits += [seq.feed([t]) for t in continuation]
    return logits


def compare(reference: LlamaForCausalLM, candidate: LlamaForCausalLM, prompts: Sequence[Sequence[int]], *,
            name: str = "candidate", new_tokens: int = 16, reference_kv_dtype: str = "auto",
            candidate_kv_dtype: str = "auto", kernels: str | KernelSet = "torch",
            block_size: int = 16) -> QualityMetrics:
    """``candidate`` (with its KV dtype) against ``reference`` on ``prompts``; see the module docstring."""
    spec = reference.spec
    if candidate.spec.vocab_size != spec.vocab_size:
        raise ValueError(f"vocab sizes differ: reference {spec.vocab_size}, candidate {candidate.spec.vocab_size}")
    _check_prompts(prompts, spec, new_tokens)
    ks = get_kernels(kernels) if isinstance(kernels, str) else kernels
    diffs, refs, agree, kls = [], [], 0, []
    greedy_same = exact = first_div = 0
    for prompt in prompts:
        n = len(prompt) + new_tokens
        ref_tokens, ref_logits = _greedy(_Sequence(reference, ks, reference_kv_dtype, n, block_size), prompt,
                                         new_tokens)
        cand_logits = _teacher_forced(_Sequence(candidate, ks, candidate_kv_dtype, n, block_size), prompt,
                                      ref_tokens[:-1])
        r, c = torch.cat(ref_logits), torch.cat(cand_logits)
        diffs.append((c - r).flatten())
        refs.append(r.flatten())
        agree += int((c.argmax(-1) == r.argmax(-1)).sum())
        log_p, log_q = torch.log_softmax(r.double(), -1), torch.log_softmax(c.double(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        cand_tokens, _ = _greedy(_Sequence(candidate, ks, candidate_kv_dtype, n, block_size), prompt, new_tokens)
        same = [a == b for a, b in zip(ref_tokens, cand_tokens, strict=True)]
        greedy_same += sum(same)
        exact += all(same)
        first_div += same.index(False) if not all(same) else new_tokens
    d, r, kl = torch.cat(diffs), torch.cat(refs), torch.cat(kls)
    positions = len(kl)
    return QualityMetrics(
        setting=name, positions=positions,
        max_abs_logit_err=float(d.abs().max()), mean_abs_logit_err=float(d.abs().mean()),
        rel_logit_err=float(d.norm() / r.norm()), max_rel_logit_err=float(d.abs().max() / r.abs().max()),
        top1_agreement=agree / positions, kl_mean=float(kl.mean()), kl_max=float(kl.max()),
        greedy_token_agreement=greedy_same / (new_tokens * len(prompts)), greedy_exact=exact / len(prompts),
        greedy_first_divergence=first_div / len(prompts))


def _check_prompts(prompts: Sequence[Sequence[int]], spec: ModelSpec, new_tokens: int) -> None:
    check_int(new_tokens, "quality.new_tokens", 1)
    if not prompts:
        raise ValueError("quality: the prompt set is empty")
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"quality: prompt {i} is empty")
        if min(p) < 0 or max(p) >= spec.vocab_size:
            raise ValueError(f"quality: prompt {i} has token ids outside [0, {spec.vocab_size})")
        if len(p) + new_tokens > spec.max_model_len:
            raise ValueError(f"quality: prompt {i} ({len(p)} tokens) + new_tokens={new_tokens} exceeds "
                             f"max_model_len={spec.max_model_len}")


def synthetic_prompts(vocab_size: int, num_prompts: int = 8, prompt_len: int = 64, seed: int = 0) -> list[list[int]]:
    """A fixed, seeded prompt set of uniformly random token ids (for models without a tokenizer / real text)."""
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"quality: num_prompts={num_prompts} and prompt_len={prompt_len} must be >= 1")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=g).tolist()


def load_prompts(path: str | Path, tokenizer_dir: str | Path | None = None) -> list[list[int]]:
    """Prompts from a JSON list whose items are token-id lists, or strings tokenised with the Hugging Face
    tokenizer saved in ``tokenizer_dir`` (the checkpoint directory; local files only)."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"quality.prompts_file={path}: expected a non-empty JSON list")
    if all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in items):
        return items
    if not all(isinstance(x, str) for x in items):
        raise ValueError(f"quality.prompts_file={path}: items must all be token-id lists or all be strings")
    if tokenizer_dir is None:
        raise ValueError(f"quality.prompts_file={path} holds text; tokenising it needs a checkpoint directory "
                         "with a tokenizer (model.path)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    return [tok(x)["input_ids"] for x in items]


def reference_model(model: LlamaForCausalLM | ModelSpec | str | Path, *, seed: int = 0,
                    dtype: torch.dtype | None = None, device: str = "cpu") -> LlamaForCausalLM:
    """The unquantised model: as given, loaded from a checkpoint directory, or built from a spec (its ``path``,
    else seeded random weights)."""
    if isinstance(model, LlamaForCausalLM):
        if any(m.qweight is not None for m in model.modules() if isinstance(m, Linear)):
            raise ValueError("quality: the reference model is already W4A16-quantised; pass the unquantised one")
        return model
    if isinstance(model, ModelSpec):
        return build_model(model, seed=seed, dtype=dtype, device=device)
    return load_model(model, dtype=dtype, device=device)


def quality_report(model: LlamaForCausalLM | ModelSpec | str | Path, prompts: Sequence[Sequence[int]],
                   settings: Sequence[QuantSetting | str], *, group_size: int = 128, new_tokens: int = 16,
                   seed: int = 0, dtype: torch.dtype | None = None, device: str = "cpu", kernels: str = "torch",
                   block_size: int = 16) -> QualityReport:
    """Every setting (a QuantSetting or its name, parsed with ``group_size``) against the unquantised model.

    W4A16 candidates are copies of the reference quantised in place, exactly as ``build_model(quant="w4a16")``
    does at load time; KV-only settings reuse the reference's weights with an int8 cache.
    """
    ref = reference_model(model, seed=seed, dtype=dtype, device=device)
    parsed = [s if isinstance(s, QuantSetting) else QuantSetting.parse(s, group_size) for s in settings]
    if not parsed:
        raise ValueError("quality: no quant settings to compare")
    quantised: dict[int, LlamaForCausalLM] = {}
    rows = []
    for s in parsed:
        if (s.quant or "none") not in QUANT_MODES:
            raise ValueError(f"quant setting {s.name!r}: quant={s.quant!r}; allowed: {list(QUANT_MODES)}")
        cand = ref
        if s.quant == "w4a16":
            if s.group_size not in quantised:
                quantised[s.group_size] = copy.deepcopy(ref)
                quantised[s.group_size].quantize(s.group_size)
            cand = quantised[s.group_size]
        rows.append(compare(ref, cand, prompts, name=s.name, new_tokens=new_tokens, candidate_kv_dtype=s.kv_dtype,
                            kernels=kernels, block_size=block_size))
    return QualityReport(ref.spec.name, str(ref.dtype).removeprefix("torch."), kernels, len(prompts),
                         sum(len(p) for p in prompts), new_tokens, rows)
