"""A session's run journal (``core.journal``) on the run path: started by the server and loadgen, turned into the
usual run files at a clean end (``journal_result``); `twinserve recover` (``experiments.serving.recover``) handles a
killed session's.

While a session runs, its run directory holds ``journal/`` and a small metrics.json whose ``run_status`` is
``running`` (``write_status``: counts so far, rewritten every ``serve.flush_interval_s``). At a clean end the journal
becomes the usual run files (the same bytes the states kept in memory would give) and is removed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from core.journal import JournalContents, RunJournal
from core.loop import RunResult
from core.metrics import ITLPool
from core.output import RUNNING, dumps_metrics, remove_run_files

SERVE, LOADGEN = "serve", "loadgen"  # meta.json's "kind": which writer turns the journal into run files
CONFIG = "config.yaml"


def open_journal(out_dir: str | Path, kind: str, backend: str, config_text: str) -> RunJournal:
    """Start a session's journal in ``out_dir`` (the run files an earlier run left there are removed: the directory
    is this session's) and say so in metrics.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    journal = RunJournal(out, {"kind": kind, "backend": backend}, {CONFIG: config_text})
    remove_run_files(out)
    write_status(out, journal, backend)
    return journal


def write_status(out_dir: str | Path, journal: RunJournal, backend: str) -> None:
    """metrics.json while the session runs (atomic): ``running``, requests ended and in flight so far."""
    out = Path(out_dir)
    status = {"run_status": RUNNING, "backend": backend, "journal": f"{journal.dir.name}/",
              "num_requests": journal.num_ended, "num_unfinished": journal.num_live, "num_steps": journal.num_steps}
    tmp = out / ".metrics.json.tmp"
    tmp.write_text(dumps_metrics(status))
    os.replace(tmp, out / "metrics.json")


def journal_result(contents: JournalContents, end_s: float, wall_s: float, tokens: str,
                   prompt_len_edges: Sequence[int]) -> RunResult:
    """The run result a journal holds: every request (in flight ones CANCELLED) and step; with ``tokens`` ``none``,
    the ITL pool the loop would have kept (each ended request folded in the order it ended)."""
    pool = None
    if tokens == "none":
        pool = ITLPool(prompt_len_edges)
        for s in contents.ended:
            pool.fold(s)
    return RunResult(contents.states, contents.steps, end_s, wall_s, itl_pool=pool)
