"""The ``extract`` command's first step: a Ctrl-C during the slow imports ends it with one line.

Python's own handler would raise ``KeyboardInterrupt`` inside whatever module is being imported: a
traceback, or a half-imported numpy that fails later with a ``RecursionError``. This module imports
only the standard library, so the handler is in place before torch, numpy or zarr start loading; and
under a launcher it first makes sure the rank dies with its launcher (``extract.job.launcher``).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from ..job.launcher import guard_launcher

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def _interrupted(signum: int, frame: FrameType | None) -> None:
    # os.write and os._exit: the signal may land inside a print or an import, where neither sys.stderr
    # nor the interpreter's shutdown can be trusted; nothing is written before the job's own handlers.
    # A Ctrl-C reaches every rank (the launcher forwards it): rank 0 speaks for the job.
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"extract: interrupted; rerun the same command to resume\n")
    os._exit(INTERRUPTED)


def exit_on_interrupt() -> None:
    """Until the job installs its own handlers, SIGINT ends the process at once: one line, exit 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted)


def main() -> int:
    """The ``extract`` console script and ``python -m extract``."""
    guard_launcher()
    exit_on_interrupt()
    from .extract import main as extract_main

    return extract_main()
