"""Trace readers: Mooncake JSONL, Azure LLM inference CSV and plain request lists (JSONL or CSV).

Readers are lazy generators of ``TraceRow`` (``limit`` stops reading early) and check every line:
malformed input raises ValueError naming the file, the line number and the field. Rows keep the file's
raw time in ``arrival_s``; the replaying workload sorts them (unsorted timestamps are allowed), rebases
and scales. Over-long prompts pass through unchanged: the replica rejects them with a reason.

Formats:
- Mooncake (FAST'25 release): one JSON object per line with ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512 prompt tokens; equal ids = shareable prefix blocks).
- Azure LLM inference 2023: CSV with ``TIMESTAMP`` (``YYYY-MM-DD hh:mm:ss.fffffff``), ``ContextTokens``,
  ``GeneratedTokens``.
- Request list: JSONL objects or CSV rows with ``arrival_s``, ``output_tokens``, one or more of
  ``prompt_tokens`` / ``prompt_token_ids`` / ``hash_ids`` (JSON lists, or space-separated in CSV; give
  ids or hash ids, not both), optional ``id``, ``tenant``, ``warmup``, ``priority``.
"""

from __future__ import annotations

import csv
import difflib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from core.workload.base import resolve_path

log = logging.getLogger(__name__)
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
REQUEST_FIELDS = ("arrival_s", "output_tokens", "prompt_tokens", "prompt_token_ids", "hash_ids", "id", "tenant",
                  "warmup", "priority")
_EPOCH = datetime(1970, 1, 1)


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request as a trace file states it (``arrival_s`` in the file's own time base, seconds)."""

    index: int  # position among the file's rows (0-based)
    line: int  # line number in the file (1-based), for error messages
    arrival_s: float
    prompt_len: int
    output_len: int
    id: str | None = None
    hash_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    tenant: str = ""
    warmup: bool = False
    priority: int = 0


class _Line:
    """Field access for one line of one file, with errors that say where."""

    def __init__(self, file: Path, line: int, row: dict[str, Any], text_values: bool) -> None:
        self.file, self.line, self.row, self.text = file, line, row, text_values

    def fail(self, field: str, msg: str) -> ValueError:
        return ValueError(f"{self.file}:{self.line}: field {field!r}: {msg}")

    def has(self, field: str) -> bool:
        v = self.row.get(field)
        return v is not None and not (self.text and v.strip() == "")

    def int(self, field: str, minimum: int | None = None) -> int:
        if not self.has(field):
            raise self.fail(field, "missing")
        v = self.row[field]
        try:
            if self.text or (isinstance(v, float) and v.is_integer()):
                v = int(v)
            elif isinstance(v, bool) or not isinstance(v, int):
                raise ValueError
        except ValueError:
            raise self.fail(field, f"not an integer: {self.row[field]!r}") from None
        if minimum is not None and v < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {v}")
        return v

    def float(self, field: str) -> float:
        if not self.has(field):
            raise self.fail(field, "missing")
        v = self.row[field]
        try:
            if isinstance(v, bool) or not isinstance(v, int | float | str) or (not self.text and isinstance(v, str)):
                raise ValueError
            x = float(v)
        except ValueError:
            raise self.fail(field, f"not a number: {v!r}") from None
        if x != x or x in (float("inf"), float("-inf")) or x < 0:
            raise self.fail(field, f"must be a finite number >= 0, got {v!r}")
        return x

    def ids(self, field: str) -> tuple[int, ...] | None:
        if not self.has(field):
            return None
        v = self.row[field]
        try:
            items = v.split() if self.text else v
            if not isinstance(items, list):
                raise ValueError
            out = tuple(int(x) if self.text else x for x in items)
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in out):
                raise ValueError
        except ValueError:
            raise self.fail(field, "must be a list of integers >= 0" + (" (space-separated)" if self.text else "")
                            ) from None
        return out

    def bool(self, field: str) -> bool:
        if not self.has(field):
            return False
        v = self.row[field]
        if isinstance(v, bool):
            return v
        s = str(v).strip().lower()
        if s in ("1", "true", "yes"):
            return True
        if s in ("0", "false", "no"):
            return False
        raise self.fail(field, f"not a boolean: {v!r}")


def _text_lines(file: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (line endings kept, as ``csv`` wants them); a line that is not UTF-8 text
    (a binary file, another encoding) fails with file:line."""
    with open(file, "rb") as f:
        for no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{file}:{no}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "a trace is a UTF-8 JSONL or CSV file") from None
            if no == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark (Excel's UTF-8 CSV): not part of the header
            if "\x00" in text:
                raise ValueError(f"{file}:{no}: a NUL byte: a binary file, not a UTF-8 JSONL or CSV trace")
            yield text


def _unencodable(value: Any) -> bool:
    """A string (anywhere in a JSON value) that UTF-8 cannot write: a lone surrogate such as ``"\\ud800"``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_unencodable(k) or _unencodable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_unencodable(v) for v in value)
    return False


def _json_lines(file: Path, limit: int | None) -> Iterator[_Line]:
    n = 0
    for no, text in enumerate(_text_lines(file), start=1):
        if limit is not None and n >= limit:
            return
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{no}: bad JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{file}:{no}: expected a JSON object, got {type(row).__name__}")
        bad = next((k for k, v in row.items() if _unencodable(k) or _unencodable(v)), None)
        if bad is not None:
            raise ValueError(f"{file}:{no}: field {bad!r}: a lone surrogate escape (such as \\ud800), "
                             "which is not text: no output file could hold it")
        n += 1
        yield _Line(file, no, row, text_values=False)


def _csv_lines(file: Path, limit: int | None, required: tuple[str, ...]) -> Iterator[_Line]:
    """CSV rows as fields by header name. A header naming a column twice, or a row with more values than the
    header has columns (an unquoted comma), fails: either would otherwise drop values without a word."""
    reader = csv.DictReader(_text_lines(file))
    header = reader.fieldnames
    if header is None:
        raise ValueError(f"{file}:1: empty file: a CSV trace needs a header row with {list(required)}")
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise ValueError(f"{file}:1: column(s) {twice} named more than once; header: {header}")
    missing = [c for c in required if c not in header]
    if missing:
        raise ValueError(f"{file}:1: missing column(s) {missing}; header: {header}")
    for n, row in enumerate(reader):
        if limit is not None and n >= limit:
            return
        extra = row.get(None)
        if extra:
            raise ValueError(f"{file}:{reader.line_num}: {len(header) + len(extra)} values but the header has "
                             f"{len(header)} columns (extra: {extra}); quote a value that holds a comma")
        yield _Line(file, reader.line_num, row, text_values=True)


def read_mooncake(path: str | Path, limit: int | None = None) -> Iterator[TraceRow]:
    """Mooncake JSONL rows; ``arrival_s`` = timestamp / 1000."""
    file = resolve_path(path)
    for i, ln in enumerate(_json_lines(file, limit)):
        ts = ln.float("timestamp")
        n_in, n_out = ln.int("input_length", 1), ln.int("output_length", 1)
        ids = ln.ids("hash_ids")
        if ids is None:
            raise ln.fail("hash_ids", "missing")
        if len(ids) * MOONCAKE_BLOCK < n_in:
            raise ln.fail("hash_ids", f"{len(ids)} ids x {MOONCAKE_BLOCK} tokens cannot cover input_length {n_in}")
        yield TraceRow(i, ln.line, ts / 1000.0, n_in, n_out, hash_ids=ids)


def _azure_time(ln: _Line) -> tuple[int, float]:
    """TIMESTAMP -> (whole seconds since 1970, fraction); split so 100 ns digits survive float rounding."""
    s = (ln.row.get("TIMESTAMP") or "").strip()
    main, _, frac = s.partition(".")
    try:
        dt = datetime.fromisoformat(main)
        if not frac.isdigit() and frac:
            raise ValueError
    except ValueError:
        raise ln.fail("TIMESTAMP", f"not a 'YYYY-MM-DD hh:mm:ss[.fffffff]' time: {s!r}") from None
    if dt.tzinfo is not None:
        dt = dt.astimezone(UTC).replace(tzinfo=None)
    return (dt - _EPOCH) // timedelta(seconds=1), float("0." + frac) if frac else 0.0


def read_azure(path: str | Path, limit: int | None = None) -> Iterator[TraceRow]:
    """Azure LLM inference CSV rows; ``arrival_s`` = seconds since the first row."""
    file = resolve_path(path)
    t0: tuple[int, float] | None = None
    for i, ln in enumerate(_csv_lines(file, limit, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))):
        sec, frac = _azure_time(ln)
        t0 = t0 or (sec, frac)
        n_in, n_out = ln.int("ContextTokens", 1), ln.int("GeneratedTokens", 1)
        yield TraceRow(i, ln.line, round((sec - t0[0]) + (frac - t0[1]), 7), n_in, n_out)  # 100 ns ticks


def read_request_list(path: str | Path, limit: int | None = None, tokens_per_hash_id: int = 16) -> Iterator[TraceRow]:
    """Explicit requests from JSONL (``.jsonl``/``.json``) or CSV (``.csv``)."""
    file = resolve_path(path)
    if file.suffix == ".csv":
        lines = _csv_lines(file, limit, ("arrival_s", "output_tokens"))
    elif file.suffix in (".jsonl", ".json"):
        lines = _json_lines(file, limit)
    else:
        raise ValueError(f"{file}: request list must end in .jsonl, .json or .csv")
    warned: set[str] = set()
    for i, ln in enumerate(lines):
        _warn_unknown(ln, warned)
        arrival, n_out = ln.float("arrival_s"), ln.int("output_tokens", 1)
        tokens, hids = ln.ids("prompt_token_ids"), ln.ids("hash_ids")
        n_in = ln.int("prompt_tokens", 1) if ln.has("prompt_tokens") else None
        if tokens is not None and hids is not None:
            raise ln.fail("hash_ids", "give prompt_token_ids or hash_ids, not both")
        if tokens is not None:
            if not tokens:
                raise ln.fail("prompt_token_ids", "empty")
            if n_in is not None and n_in != len(tokens):
                raise ln.fail("prompt_tokens", f"{n_in} but prompt_token_ids has {len(tokens)} tokens")
            n_in = len(tokens)
        elif hids is not None:
            n_in = len(hids) * tokens_per_hash_id if n_in is None else n_in
            if len(hids) * tokens_per_hash_id < n_in:
                raise ln.fail("hash_ids", f"{len(hids)} ids x {tokens_per_hash_id} tokens cannot cover {n_in} tokens")
        elif n_in is None:
            raise ln.fail("prompt_tokens", "missing (give prompt_tokens, prompt_token_ids or hash_ids)")
        if n_in < 1:
            raise ln.fail("hash_ids", "empty")
        rid = str(ln.row["id"]).strip() if ln.has("id") else f"r{i}"
        tenant = str(ln.row["tenant"]) if ln.has("tenant") else ""
        priority = ln.int("priority") if ln.has("priority") else 0
        yield TraceRow(i, ln.line, arrival, n_in, n_out, rid, hids, tokens, tenant, ln.bool("warmup"), priority)


def _warn_unknown(ln: _Line, warned: set[str]) -> None:
    """Warn once per file about each field a request list does not know (a typo of an optional one is otherwise
    silently ignored), at the first line that has it."""
    new = [k for k in ln.row if k not in REQUEST_FIELDS and k not in warned and k is not None]
    for k in new:
        warned.add(k)
        close = difflib.get_close_matches(str(k), REQUEST_FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        log.warning("%s:%d: unknown field %r ignored%s; request-list fields: %s", ln.file, ln.line, k, hint,
                    ", ".join(REQUEST_FIELDS))


def read_trace(path: str | Path, limit: int | None = None, tokens_per_hash_id: int = 16) -> Iterator[TraceRow]:
    """Any of the three formats, told apart by suffix and header (Mooncake ``timestamp`` / Azure ``TIMESTAMP``)."""
    file = resolve_path(path)
    lines = _text_lines(file)
    head = next((ln for ln in lines if ln.strip()), "")
    lines.close()
    if file.suffix == ".csv" and "TIMESTAMP" in next(csv.reader([head]), []):
        return read_azure(file, limit)
    if file.suffix in (".jsonl", ".json") and '"timestamp"' in head:
        return read_mooncake(file, limit)
    return read_request_list(file, limit, tokens_per_hash_id)
