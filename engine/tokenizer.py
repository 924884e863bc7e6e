"""Text in and out: the checkpoint's own tokenizer (never downloaded) and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: str | Path | None) -> Any | None:
    """The Hugging Face tokenizer saved in checkpoint directory ``path``, loaded from disk only; None when the
    directory has no tokenizer files (the server then takes token-id prompts only)."""
    if path is None or not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals decoding all ids at once.

    Each new token re-decodes only a short window: the ids since the last emitted boundary (``prefix``) with and
    without the new ones. The difference is new text, held back while it ends in U+FFFD: a multi-byte character
    split over several byte-level tokens is emitted whole once its last byte arrives. Decoding the window
    together with the previous token keeps the spacing a tokenizer puts between tokens.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already emitted
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
