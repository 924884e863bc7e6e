"""A run journal: a long-running session's ended requests and steps, appended to its run directory as they happen.

A server (and loadgen) cannot keep every request of a session in memory for one write at the end (a few KB a
request, without bound), nor rewrite them all on every flush. Instead its loop hands each event to a ``RunJournal``
(``core.loop.ServingLoop.journal_to``), which appends one JSON line to a file under ``<run dir>/journal/``:

- ``requests.jsonl``: ``{"admit": request}`` when a request is queued (so a crash knows it was in flight), and
  ``{"end": state}`` when it reaches a terminal status (with ``"request"`` too when it ended without being queued:
  rejected at once);
- ``steps.jsonl``: one list per step, steps.csv's row (``StepRecord.columns()``).

Each line is written with one ``os.write`` as the event happens: a SIGKILL loses nothing that had ended (only what
was in flight, recorded as admitted); ``flush`` (on the session's flush interval) fsyncs, for a machine crash.
Floats are JSON's ``repr`` (exact round trip), ids and texts JSON-escaped (any string, lone surrogates included).

At the end the journal is read back (``read_journal``) into the request states and the step log the run files are
written from, byte-identical to what the same states kept in memory give; ``in_flight`` requests (admitted, never
ended: the session was killed) come back as CANCELLED states with no tokens, so every request is accounted for.
A reader of run directories that finds a journal and no complete run says to recover it (``twinserve recover``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from core.records import StepLog
from core.request import RepeatedTokens, Request, RequestState, Status

JOURNAL_DIR = "journal"
REQUESTS, STEPS, META = "requests.jsonl", "steps.jsonl", "meta.json"
IN_FLIGHT_REASON = "in flight when the session stopped (recovered from its journal)"
_REQUEST_SKIP = {"sampling"}  # how the engine sampled: not part of any run file
_STATE_SKIP = {"request", "id", "status", "output_token_ids", "token_times", "block_hashes", "stop_token_ids",
               "folded"}
_TUPLES = ("prompt_token_ids", "hash_ids", "stop_token_ids")
_REQUEST_FIELDS = tuple(f.name for f in fields(Request) if f.name not in _REQUEST_SKIP)
_STATE_FIELDS = tuple(f.name for f in fields(RequestState) if f.name not in _STATE_SKIP)


def safe_text(s: str) -> str:
    """``s`` unchanged when UTF-8 can encode it; else with what it cannot as backslash escapes: a raw byte of an
    HTTP header (Python decodes ``\\xff`` as the lone surrogate ``\\udcff``) as ``\\xff``, any other lone surrogate
    as ``\\udXXX``. So a client's id can never break a write of the run files."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:
        raw = s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


class SeenIds:
    """The request ids a session has seen, in about 8 bytes each (a 64-bit hash: two different ids collide with
    odds about n^2 / 2^65, i.e. never), so a long session can refuse a reused id without keeping every id string.
    New ids go into a small set, merged into a sorted int64 array once it holds an eighth as many."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.int64)
        self._recent: set[int] = set()

    @staticmethod
    def _key(request_id: str) -> int:
        digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def __contains__(self, request_id: object) -> bool:
        k = self._key(str(request_id))
        if k in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, k))
        return i < len(self._sorted) and int(self._sorted[i]) == k

    def add(self, request_id: str) -> None:
        self._recent.add(self._key(request_id))
        if len(self._recent) >= max(4096, len(self._sorted) // 8):
            new = np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))
            self._sorted = np.union1d(self._sorted, new)
            self._recent = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)


def request_record(r: Request) -> dict[str, Any]:
    d = {k: getattr(r, k) for k in _REQUEST_FIELDS}
    for k in _TUPLES:
        if d[k] is not None:
            d[k] = list(d[k])
    return d


def state_record(s: RequestState) -> dict[str, Any]:
    """What the run files need of an ended request's state (its request apart), as JSON types."""
    d: dict[str, Any] = {"id": s.id, "status": s.status.value}
    d.update((k, getattr(s, k)) for k in _STATE_FIELDS)
    out = s.output_token_ids
    if isinstance(out, RepeatedTokens) or (len(out) > 1 and out.count(out[0]) == len(out)):
        d["repeat_token"] = [out[0], len(out)]  # the simulator's placeholder tokens: two numbers, not n
    else:
        d["output_token_ids"] = list(out)
    d["token_times"] = list(s.token_times)
    if s.folded is not None:
        d["folded"] = [s.folded.max_stall_s, s.folded.last_token_s]
    return d


def request_from(d: dict[str, Any]) -> Request:
    kw = {k: d[k] for k in _REQUEST_FIELDS if k in d}
    for k in _TUPLES:
        if kw.get(k) is not None:
            kw[k] = tuple(kw[k])
    return Request(**kw)


def state_from(d: dict[str, Any], request: Request) -> RequestState:
    from core.request import FoldedTimes

    s = RequestState(request, status=Status(d["status"]), **{k: d[k] for k in _STATE_FIELDS if k in d})
    if "repeat_token" in d:
        s.output_token_ids = RepeatedTokens(*d["repeat_token"])
    else:
        s.output_token_ids = list(d["output_token_ids"])
    times = d["token_times"]
    s.token_times = array("d", times) if all(type(t) is float for t in times) else list(times)
    if "folded" in d:
        s.folded = FoldedTimes(*d["folded"])
    return s


class RunJournal:
    """Appends a session's events under ``run_dir/journal/`` (see the module). ``admit``, ``end`` and ``add`` (a
    step: ``StepLog.add``'s arguments, so a loop's ``steps`` can be the journal) are called on one thread (the
    loop's); ``flush`` and ``close`` from any. ``meta``: what a recovery needs besides the events (the kind of
    session, its backend), written to meta.json; ``files``: more files to put there (the resolved config)."""

    def __init__(self, run_dir: str | Path, meta: dict[str, Any], files: dict[str, str] | None = None) -> None:
        self.dir = Path(run_dir) / JOURNAL_DIR
        if (self.dir / REQUESTS).exists():
            raise ValueError(f"{self.dir} holds the journal of an earlier session that did not finish; run "
                             f"`twinserve recover {self.dir.parent}` first, or choose another run directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, text in {META: json.dumps(meta, sort_keys=True) + "\n", **(files or {})}.items():
            (self.dir / name).write_text(text)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self._req = os.open(self.dir / REQUESTS, flags, 0o644)
        self._steps = os.open(self.dir / STEPS, flags, 0o644)
        self._live: set[str] = set()  # admitted, not ended (their end records leave the request out)
        self.ids = SeenIds()  # every id of the session (ServingLoop's duplicate check)
        self.num_ended = 0
        self.num_steps = 0
        self._lock = threading.Lock()  # close vs. a late write from the loop thread
        self._closed = False

    def _write(self, fd: int, record: Any) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8", "surrogatepass")
        with self._lock:
            if not self._closed:
                os.write(fd, line)

    def admit(self, state: RequestState) -> None:
        """A request was queued (it may end later, or be in flight when the session dies)."""
        self._live.add(state.id)
        self._write(self._req, {"admit": request_record(state.request)})

    def end(self, state: RequestState) -> None:
        """A request reached a terminal status."""
        rec: dict[str, Any] = {"end": state_record(state)}
        if state.id in self._live:
            self._live.discard(state.id)
        else:
            rec["request"] = request_record(state.request)
        self.num_ended += 1
        self._write(self._req, rec)

    def add(self, replica: int, start_s: float, duration_s: float, features: Sequence[int], kv_blocks_used: int,
            num_preempted: int) -> None:
        """A step (``StepLog.add``'s arguments)."""
        self.num_steps += 1
        self._write(self._steps, [replica, start_s, duration_s, *features, kv_blocks_used, num_preempted])

    def __len__(self) -> int:
        return self.num_steps

    @property
    def num_live(self) -> int:
        return len(self._live)

    def flush(self) -> None:
        """Make what was written durable (the lines are already in the files: a killed process loses none)."""
        with self._lock:
            if not self._closed:
                os.fsync(self._req)
                os.fsync(self._steps)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._req, self._steps):
                os.fsync(fd)
                os.close(fd)


@dataclass
class JournalContents:
    """A journal read back: the states in admission order (the order a loop keeps them in), the ended ones in the
    order they ended (an ITL pool folds them in that order), in-flight requests as CANCELLED states, the steps."""

    states: list[RequestState]
    ended: list[RequestState]
    in_flight: list[RequestState]
    steps: StepLog
    meta: dict[str, Any]
    last_time_s: float  # the latest time any record carries (0 with none)
    torn_lines: int = 0  # a last line cut short by a kill (ignored)
    files: dict[str, str] = field(default_factory=dict)


def has_journal(run_dir: str | Path) -> bool:
    return (Path(run_dir) / JOURNAL_DIR / REQUESTS).is_file()


def _lines(path: Path) -> tuple[list[Any], int]:
    """The JSON records of a journal file; a last line cut short (the process was killed while writing it) is
    dropped and counted; a bad line elsewhere is an error naming file:line."""
    if not path.is_file():
        return [], 0
    raw = path.read_bytes().split(b"\n")
    out, torn = [], 0
    for i, line in enumerate(raw, start=1):
        if not line:
            continue
        try:
            out.append(json.loads(line.decode("utf-8", "surrogatepass")))
        except ValueError as e:
            if i == len(raw):  # no newline after it: the write was cut
                torn += 1
                continue
            raise ValueError(f"{path}:{i}: not a journal record ({e})") from None
    return out, torn


def read_journal(run_dir: str | Path) -> JournalContents:
    """Read ``run_dir``'s journal (see the module)."""
    d = Path(run_dir) / JOURNAL_DIR
    if not (d / REQUESTS).is_file():
        raise FileNotFoundError(f"no journal in {run_dir} (no {JOURNAL_DIR}/{REQUESTS})")
    meta = json.loads((d / META).read_text()) if (d / META).is_file() else {}
    records, torn = _lines(d / REQUESTS)
    order: dict[str, int] = {}  # id -> admission position
    admitted: dict[str, Request] = {}
    ended: list[RequestState] = []
    last = 0.0
    for n, rec in enumerate(records, start=1):
        if "admit" in rec:
            req = request_from(rec["admit"])
            admitted[req.id] = req
            order[req.id] = n
            last = max(last, req.arrival_s)
        elif "end" in rec:
            e = rec["end"]
            req = request_from(rec["request"]) if "request" in rec else admitted.pop(e["id"], None)
            if req is None:
                raise ValueError(f"{d / REQUESTS}:{n}: request {e['id']!r} ended but was never admitted")
            order.setdefault(req.id, n)
            state = state_from(e, req)
            ended.append(state)
            last = max([last, *(t for t in (state.finish_s, state.last_token_s) if t is not None)])
        else:
            raise ValueError(f"{d / REQUESTS}:{n}: not a journal record (neither admit nor end)")
    in_flight = []
    for req in admitted.values():
        s = RequestState(req, status=Status.CANCELLED, reason=IN_FLIGHT_REASON)
        s.finish_s = None
        in_flight.append(s)
    steps = StepLog()
    rows, torn_steps = _lines(d / STEPS)
    for row in rows:
        steps.add(row[0], row[1], row[2], row[3:-2], row[-2], row[-1])
        last = max(last, row[1] + row[2])
    states = sorted([*ended, *in_flight], key=lambda s: order[s.id])
    files = {p.name: p.read_text() for p in sorted(d.iterdir())
             if p.is_file() and p.name not in (REQUESTS, STEPS, META)}
    return JournalContents(states, ended, in_flight, steps, meta, last, torn + torn_steps, files)


def remove_journal(run_dir: str | Path) -> None:
    """Delete a journal once its run files are written."""
    d = Path(run_dir) / JOURNAL_DIR
    for p in d.iterdir() if d.is_dir() else ():
        p.unlink()
    if d.is_dir():
        d.rmdir()
