"""`twinserve recover DIR`: the run files of a served session (or a load test) that was killed, from its run journal
(``core.journal``, ``experiments.serving.journal``): ``recover`` writes them as ``.partial`` files with
``run_status: interrupted``, the reason in ``error``, every request that ended, and the requests that were in flight
as CANCELLED (``num_unfinished`` counts them). Anything that serves or drives requests for a long time (the server,
loadgen, a gateway) journals the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from core.journal import JournalContents, has_journal, read_journal, remove_journal
from core.output import INTERRUPTED
from experiments.serving.journal import CONFIG, LOADGEN, SERVE, journal_result


def interrupted_note(contents: JournalContents, reason: str) -> dict[str, Any]:
    return {"error": reason, "num_unfinished": len(contents.in_flight)}


def recover(run_dir: str | Path, reason: str | None = None) -> dict[str, Any]:
    """Turn the journal a session left in ``run_dir`` into its run files (``.partial``, ``run_status:
    interrupted``), then remove the journal; returns the metrics written."""
    from omegaconf import OmegaConf

    out = Path(run_dir)
    if not has_journal(out):
        raise FileNotFoundError(f"{out}: no journal to recover (no journal/requests.jsonl); nothing to do")
    contents = read_journal(out)
    kind = contents.meta.get("kind")
    reason = reason or (f"the {kind or 'session'} stopped without writing its run files (killed or crashed); "
                        f"recovered from its journal")
    cfg = OmegaConf.create(contents.files.get(CONFIG, "{}"))
    if kind == SERVE:
        from experiments.config import RunConfig
        from experiments.run import write_run_dir

        run = RunConfig.from_config(cfg)
        result = journal_result(contents, contents.last_time_s, contents.last_time_s, run.output.tokens,
                                run.metrics.prompt_len_edges)
        metrics = write_run_dir(run, result, out, contents.meta.get("backend"), interrupted_note(contents, reason),
                                run_status=INTERRUPTED, plots=False)
    elif kind == LOADGEN:
        from experiments.serving.loadgen.run import write_loadgen_run

        metrics = write_loadgen_run(cfg, out, contents.states, [], contents.last_time_s, None,
                                    run_status=INTERRUPTED, note=interrupted_note(contents, reason))
    else:
        raise ValueError(f"{out}/journal/meta.json: kind {kind!r} is not one of {SERVE}, {LOADGEN}")
    remove_journal(out)
    return metrics


def main(argv: list[str] | None = None) -> int:
    """``twinserve recover DIR [DIR ...]``: recover each run directory's journal."""
    from experiments.cli import EXIT_USER_ERROR, one_line

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: twinserve recover RUN_DIR [RUN_DIR ...]: write the run files of a session that was killed "
              "(from its journal/)", file=sys.stderr if not args else sys.stdout)
        return 0 if args else EXIT_USER_ERROR
    rc = 0
    for d in args:
        try:
            m = recover(d)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {one_line(e)}", file=sys.stderr)
            rc = EXIT_USER_ERROR
            continue
        print(json.dumps({"run_dir": d, "run_status": m.get("run_status", INTERRUPTED),
                          "num_requests": m.get("num_requests"), "num_unfinished": m.get("num_unfinished")}))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
