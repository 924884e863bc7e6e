"""User errors of the Hydra entry points as one line, not a traceback.

``@user_errors`` goes under ``@hydra.main`` on an entry point's task function: a config or input error raised
while it runs (``ValueError``, which ``core.checks`` raises naming the key; an OmegaConf error on a missing or
unresolvable key; a missing file) is printed as ``error: <message>`` on stderr and the process exits with
``EXIT_USER_ERROR``, with no traceback. ``HYDRA_FULL_ERROR=1`` keeps Hydra's own handling (the full traceback).
Hydra already prints its composition errors (an unknown group option, an override of a key that does not exist)
in a few lines without a traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf.errors import OmegaConfBaseException

EXIT_USER_ERROR = 2
USER_ERRORS = (ValueError, OmegaConfBaseException, FileNotFoundError)

F = TypeVar("F", bound=Callable[..., Any])


def full_error() -> bool:
    """``HYDRA_FULL_ERROR=1``: show the full traceback instead of one line."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message with newlines folded (an OmegaConf message adds ``full_key: ...``)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


def user_errors(task: F) -> F:
    """Wrap a Hydra task function: a user error becomes one line on stderr and exit code 2 (see the module)."""

    @functools.wraps(task)  # Hydra unwraps __wrapped__ to find the calling module and its config path
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return task(*args, **kwargs)
        except USER_ERRORS as e:
            if full_error():
                raise
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]
