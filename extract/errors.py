"""The one error type the command line turns into a one-line message and exit status 2."""

from pathlib import Path


class ExtractError(Exception):
    """Bad input or environment: the message names the culprit and the fix."""


def write_output(flag: str, path: str | Path, text: str) -> None:
    """Write a command's output file (``--json``, ``--out``); a path that cannot be written is an
    ``ExtractError`` naming the flag, not a traceback."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise ExtractError(f"{flag} {path}: cannot write it ({e.strerror})") from None
