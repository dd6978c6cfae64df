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


# extract <command>: each a thin main() over a library function; ``run`` is also what flags alone mean
COMMANDS = {
    "run": ("extract", "extract a model's layers over a dataset into a store (the default: flags alone run it)"),
    "list-layers": ("extract", "print every module of a model with its output shape and layout, then exit"),
    "verify": ("verify", "check a store's chunks and metadata; --repair clears what a rerun recomputes"),
    "probe": ("probe", "linear or k-NN probe accuracy for each layer of a store"),
    "compare": ("compare", "linear CKA between the layers of one store or two"),
    "report": ("report", "an HTML report with figures about a store"),
    "export": ("export", "a packed token store's layer as SAELens's activation cache"),
    "top": ("top", "each SAE latent's top activating tokens with their contexts (Parquet, JSON, HTML)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: extract <command> [options]   (extract --model ... --layers ... alone is `extract run`)",
            "",
            "commands:",
            *lines,
            "",
            "`extract <command> --help` for a command's options; under a launcher: "
            "accelerate launch [--multi_gpu --num_processes N] -m extract run ...",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """The ``extract`` console script and ``python -m extract``: ``extract <command> [options]``, where a
    command is one of ``COMMANDS``; options alone (``extract --model ...``) run a job, as they always did."""
    guard_launcher()
    exit_on_interrupt()
    import importlib
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    name = args[0] if args and args[0] in COMMANDS else "run"
    rest = args[1:] if args and args[0] in COMMANDS else args
    if name == "list-layers":
        rest = [*rest, "--list-layers"]
    module = importlib.import_module(f"extract.cli.{COMMANDS[name][0]}")
    return module.main(rest)
