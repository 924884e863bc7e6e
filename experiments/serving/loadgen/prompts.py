"""The prompt of a request as sent: exactly its ``prompt_len`` token ids, or text that tokenizes to that many tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from core.prompt import materialize
from core.request import Request
from experiments.serving.loadgen.target import Target


class TextPrompts:
    """Text that tokenizes to a given number of tokens with ``tokenizer`` (a transformers tokenizer).

    A pool of "words" is picked from the vocabulary: tokens that decode to a plain ASCII alphanumeric piece
    and survive a round trip repeated (decode([i, i, i]) encodes back to [i, i, i]), e.g. " the" for byte-level
    BPE. Token id t of a prompt becomes word ``pool[t % len(pool)]``, so prompts sharing token prefixes share text
    prefixes (the server's prefix cache sees the workload's sharing). The tokens the tokenizer adds (BOS) count:
    the text holds n - ``num_special_tokens_to_add()`` words. A text whose count is off after decoding is corrected
    by adding or dropping words (a few rounds); ``text(ids, n)`` returns (text, tokens it encodes to), the nearest
    count when n cannot be met (n = 1 with a BOS-adding tokenizer).
    """

    def __init__(self, tokenizer: Any, pool_size: int = 1024, max_scan: int = 200_000) -> None:
        self.tok = tokenizer
        self.num_special = int(tokenizer.num_special_tokens_to_add(pair=False))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        pool: list[int] = []
        for i in range(min(len(tokenizer), max_scan)):
            if i in special:
                continue
            piece = tokenizer.decode([i])
            word = piece.strip()
            if not word or not word.isascii() or not word.isalnum():
                continue
            if self._encode(tokenizer.decode([i, i, i])) != [i, i, i]:
                continue
            pool.append(i)
            if len(pool) >= pool_size:
                break
        if not pool:
            raise ValueError("target.tokenizer: found no vocabulary entry that round-trips as a word; "
                             "use target.prompt_mode=tokens")
        self.pool = pool

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def count(self, text: str) -> int:
        """Tokens the server's tokenizer gives ``text``, added special tokens included."""
        return len(self._encode(text)) + self.num_special

    def text(self, token_ids: Sequence[int], n: int) -> tuple[str, int]:
        pool, k = self.pool, len(self.pool)
        words = [pool[t % k] for t in token_ids]
        target = max(1, n - self.num_special)
        m, best = target, None
        for _ in range(8):
            ids = (words + [pool[(len(words) + j) % k] for j in range(m - len(words))])[:m]
            text = self.tok.decode(ids)
            got = self.count(text)
            if best is None or abs(got - n) < abs(best[1] - n):
                best = (text, got)
            if got == n:
                break
            m = max(1, m + n - got)
        return best


def load_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer from a local directory (``engine.tokenizer``: no download)."""
    from engine.tokenizer import load_tokenizer as load

    tok = load(path)
    if tok is None:
        raise ValueError(f"target.tokenizer={str(path)!r}: no tokenizer files in that directory")
    return tok


class Prompts:
    """The ``prompt`` field for a request: token ids (tokens mode) or text (text mode), exactly prompt_len long."""

    def __init__(self, mode: str, vocab_size: int, seed: int = 0, text: TextPrompts | None = None) -> None:
        if mode == "text" and text is None:
            raise ValueError("target.prompt_mode=text needs a tokenizer (target.tokenizer or model.path)")
        self.mode, self.vocab_size, self.seed, self.text = mode, vocab_size, seed, text
        self.num_length_off = 0  # text prompts whose token count could not be made exact

    def __call__(self, req: Request) -> list[int] | str:
        ids = materialize(req, self.vocab_size, self.seed)
        if self.mode == "tokens":
            return ids
        text, got = self.text.text(ids, req.prompt_len)
        self.num_length_off += got != req.prompt_len
        return text



def build_prompts(cfg: DictConfig, target: Target, vocab_size: int) -> Prompts:
    """Tokens or text prompts for ``target``; the vocabulary comes from the tokenizer when one is named
    (``target.tokenizer``, else ``model.path`` in text mode), else it is the model's ``vocab_size``."""
    tok_dir = target.tokenizer
    if tok_dir is None and target.prompt_mode == "text":
        tok_dir = cfg.model.get("path")
        if not tok_dir:
            raise ValueError("target.prompt_mode=text needs target.tokenizer=DIR (a local tokenizer directory) "
                             "or model.path=DIR")
    seed = int(cfg.get("seed", 0))
    if tok_dir is None:
        return Prompts("tokens", vocab_size, seed)
    tok = load_tokenizer(tok_dir)
    text = TextPrompts(tok) if target.prompt_mode == "text" else None
    return Prompts(target.prompt_mode, len(tok), seed, text)
