"""What every command shares: a parser whose errors are one line, the wrapper that turns a command's
exceptions into one line and an exit status, and the writer of output files.

This module imports nothing of the extraction pipeline: the analysis commands use it too, and must
not load the job, the writer or the lock. What only extraction can raise (``Interrupted``,
``WriterError``) is handled by the failures ``extract.cli.extract`` passes to ``command``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, ParamSpec

from ..errors import ExtractError
from ..store.location import described, from_object_storage

P = ParamSpec("P")
# (the command's name, the exception) -> the exit status; the handler prints its own line, if any
Failure = Callable[[str, Any], int]


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ``ExtractError``s: one line, exit status 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        raise ExtractError(f"{message} (see --help)")


def say(prog: str, text: str) -> None:
    """``PROG: TEXT`` as one line on stderr, flushed at once (ranks and launchers interleave stderr)."""
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


def command(
    prog: str, failures: Mapping[type[BaseException], Failure] | None = None
) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Make ``main`` a command: an ``ExtractError`` becomes ``PROG: error: MESSAGE`` (unless another
    process says it) and its exit status, 2 unless the type says otherwise (1 for a ``LockLostError``),
    unless ``failures`` names its type (a ``WriterError`` says what a rerun does); an exception of a type
    in ``failures`` goes to the first handler (in order) whose type it is; an
    error of object storage past its retries is one line naming the request, exit status 1; anything
    else propagates with its traceback, since it is a bug rather than bad input."""
    failures = dict(failures or {})

    def own_handler(error: ExtractError) -> Failure | None:
        """The handler ``failures`` names for this ``ExtractError``'s own type, if any."""
        return next(
            (h for kind, h in failures.items() if issubclass(kind, ExtractError) and isinstance(error, kind)), None
        )

    def wrap(main: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(main)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except ExtractError as e:  # first: a typed error may also be an OSError or a KeyError
                if handle := own_handler(e):  # an error with a line of its own (``WriterError``)
                    return handle(prog, e)
                if not e.quiet:
                    say(prog, f"error: {e}")
                return e.exit_code
            except tuple(failures) as e:
                handle = next(handle for kind, handle in failures.items() if isinstance(e, kind))
                return handle(prog, e)
            except Exception as e:
                if not from_object_storage(e):
                    raise
                say(prog, f"error: {described(e)}")
                return 1

        return run

    return wrap


def write_output(flag: str, path: str | Path, text: str) -> None:
    """Write a command's output file (``--json``, ``--out``); a path that cannot be written is an
    ``ExtractError`` naming the flag, not a traceback."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise ExtractError(f"{flag} {path}: cannot write it ({e.strerror})") from None
