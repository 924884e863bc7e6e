"""The profiling grid: which step shapes ``experiments.calibrate`` times (``calibrate.grid``).

Each shape is a set of prefill chunks (a chunk of ``n`` tokens after ``c`` cached ones) and decodes (one token
attending to a context). The grid's ``auto`` values span the model's context and the scheduler's budget and sequence
limit; shapes beyond the KV pool are left out with a note (``grid.json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.shapes import shape_blocks
from experiments.config import RunConfig, plain

GRID_KEYS = ("prefill_lens", "prefill_cached", "decode_batch_sizes", "decode_contexts", "mixed_chunks",
             "mixed_decodes", "mixed_context", "verify_drafts")
AUTO = "auto"
AUTO_KEYS = ("prefill_lens", "prefill_cached", "decode_batch_sizes", "decode_contexts")


@dataclass(frozen=True)
class Shape:
    """One profiled step: prefill chunks as (cached tokens, chunk tokens) and decodes as the context each attends
    to (its new token included)."""

    group: str  # prefill | decode | mixed | verify
    label: str
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    drafts: int = 0  # verify: draft tokens each decode verifies (speculative decoding)

    def blocks(self, block_size: int) -> int:
        return shape_blocks(self.prefills, [t + self.drafts for t in self.decodes], block_size)


def _ints(grid: Mapping[str, Any], key: str, lo: int) -> list[int]:
    v = grid.get(key, [])
    vals = [v] if isinstance(v, int) else list(v or [])
    if any(isinstance(x, bool) or not isinstance(x, int) or x < lo for x in vals):
        raise ValueError(f"calibrate.grid.{key}={vals!r}; allowed: integers >= {lo}, or auto")
    return vals


def geometric(lo: int, hi: int, ratio: int) -> list[int]:
    """lo, lo*ratio, lo*ratio², ... below ``hi``, then ``hi`` itself ([] when hi < lo)."""
    out, x = [], lo
    while x < hi:
        out.append(x)
        x *= ratio
    return out + [hi] if hi >= lo else out


def auto_grid(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, list[int]]:
    """What ``auto`` stands for in ``calibrate.grid``: the whole range a run of this model and scheduler reaches.

    - prefill_lens: 8, 16, 32, ... up to the scheduler's token budget (a step's prefill never exceeds it);
    - prefill_cached: 0, 128, 512, 2048, ... (x4) up to max_model_len minus the budget (the context a chunk of a
      long prompt, or a suffix after a prefix-cache hit, attends to);
    - decode_batch_sizes: 1, 2, 4, ... up to max_num_seqs;
    - decode_contexts: 32, 128, 512, ... (x4) up to max_model_len.
    """
    budget = min(max_num_batched_tokens, max_model_len)
    return {"prefill_lens": geometric(8, budget, 2),
            "prefill_cached": [0] + geometric(128, max_model_len - budget, 4),
            "decode_batch_sizes": geometric(1, max_num_seqs, 2),
            "decode_contexts": geometric(32, max_model_len, 4)}


def resolve_grid(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None) -> dict[str, Any]:
    """``grid`` with every ``auto`` value replaced (``auto_grid``); auto needs the scheduler limits."""
    grid = dict(grid)
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise ValueError(f"calibrate.grid: unknown keys {unknown}; allowed: {list(GRID_KEYS)}")
    autos = [k for k, v in grid.items() if v == AUTO]
    if autos:
        bad = sorted(set(autos) - set(AUTO_KEYS))
        if bad:
            raise ValueError(f"calibrate.grid.{bad[0]}=auto is not supported; auto applies to {list(AUTO_KEYS)}")
        if max_num_batched_tokens is None or max_num_seqs is None:
            raise ValueError("calibrate.grid: auto values need the scheduler's max_num_batched_tokens and max_num_seqs")
        grid.update({k: v for k, v in auto_grid(max_model_len, max_num_batched_tokens, max_num_seqs).items()
                     if k in autos})
    return grid


def grid_plan(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
              max_num_seqs: int | None = None, max_blocks: int | None = None,
              block_size: int = 16) -> tuple[list[Shape], list[str]]:
    """The profile's shapes and a note per shape left out: prefill lens x cached context, decode batch x context,
    and mixed steps (one chunk after ``mixed_context`` cached tokens plus decodes at ``mixed_context``).

    A single value beyond ``max_model_len`` is an error; a combination beyond it (a chunk after a long cached
    context) is skipped, as is a shape needing more KV blocks than ``max_blocks`` (the run's KV pool: a batch that
    big never happens there)."""
    grid = resolve_grid(grid, max_model_len, max_num_batched_tokens, max_num_seqs)
    lens, cached = _ints(grid, "prefill_lens", 1), _ints(grid, "prefill_cached", 0) or [0]
    batches, contexts = _ints(grid, "decode_batch_sizes", 1), _ints(grid, "decode_contexts", 2)
    chunks, mixed_dec = _ints(grid, "mixed_chunks", 1), _ints(grid, "mixed_decodes", 1)
    mixed_ctx = _ints(grid, "mixed_context", 2) or [256]
    if len(mixed_ctx) != 1:
        raise ValueError(f"calibrate.grid.mixed_context={mixed_ctx}; allowed: one integer >= 2")
    ctx = mixed_ctx[0]
    for key, vals, extra in (("prefill_lens", lens, 0), ("decode_contexts", contexts, 0),
                             ("mixed_context", mixed_ctx, 0), ("prefill_cached", cached, 1)):
        too_long = [v for v in vals if v + extra > max_model_len]
        if too_long:
            raise ValueError(f"calibrate.grid.{key}: {too_long} needs more positions than the model's "
                             f"max_model_len {max_model_len}")
    shapes = [Shape("prefill", f"n={n},c={c}", prefills=((c, n),)) for c in cached for n in lens]
    shapes += [Shape("decode", f"b={b},ctx={t}", decodes=(t,) * b) for b in batches for t in contexts]
    shapes += [Shape("mixed", f"n={n},c={ctx},b={b},ctx={ctx}", prefills=((ctx, n),), decodes=(ctx,) * b)
               for n in chunks for b in mixed_dec]
    shapes += [Shape("verify", f"b={b},ctx={t},k={k}", decodes=(t,) * b, drafts=k)
               for k in _ints(grid, "verify_drafts", 1) for b in batches for t in contexts]
    if not shapes:
        raise ValueError("calibrate.grid describes no shapes; give prefill_lens and/or decode_batch_sizes x "
                         "decode_contexts")
    kept, notes = [], []
    for s in shapes:
        longest = max([c + n for c, n in s.prefills] + [t + s.drafts for t in s.decodes])
        if longest > max_model_len:
            notes.append(f"{s.group} {s.label}: {longest} positions > max_model_len {max_model_len}")
        elif max_blocks is not None and s.blocks(block_size) > max_blocks:
            notes.append(f"{s.group} {s.label}: {s.blocks(block_size)} KV blocks > the pool's {max_blocks}")
        else:
            kept.append(s)
    if not kept:
        raise ValueError(f"calibrate.grid: no shape fits ({'; '.join(notes[:3])}, ...)")
    return kept, notes


def grid_shapes(grid: Mapping[str, Any], max_model_len: int, max_num_batched_tokens: int | None = None,
                max_num_seqs: int | None = None, max_blocks: int | None = None, block_size: int = 16) -> list[Shape]:
    """``grid_plan``'s shapes."""
    return grid_plan(grid, max_model_len, max_num_batched_tokens, max_num_seqs, max_blocks, block_size)[0]


def config_grid(run: RunConfig, grid: Mapping[str, Any]) -> tuple[list[Shape], list[str], dict[str, Any]]:
    """``calibrate.grid`` for this run: (shapes, notes on the shapes left out, the grid with auto resolved). Auto
    values follow the model's max_model_len and the scheduler's limits; ``verify_drafts: auto`` is the run's
    speculative decoding draft length (none without it); shapes beyond the KV pool are left out."""
    grid = dict(plain(grid))
    if grid.get("verify_drafts") == AUTO:
        grid["verify_drafts"] = [run.speculation.max_drafts] if run.speculation.method else []
    limits = (run.model.max_model_len, run.limits.max_num_batched_tokens, run.limits.max_num_seqs)
    shapes, notes = grid_plan(grid, *limits, max_blocks=run.num_kv_blocks, block_size=run.kv.block_size)
    return shapes, notes, resolve_grid(grid, *limits)
