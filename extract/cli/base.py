"""What every command shares: a parser whose errors are one line, and the writer of output files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from ..errors import ExtractError


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ``ExtractError``s: one line, exit status 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        raise ExtractError(f"{message} (see --help)")


def write_output(flag: str, path: str | Path, text: str) -> None:
    """Write a command's output file (``--json``, ``--out``); a path that cannot be written is an
    ``ExtractError`` naming the flag, not a traceback."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise ExtractError(f"{flag} {path}: cannot write it ({e.strerror})") from None
