"""Start-up without torch (issue 37): every command's ``--help`` (and ``extract --help``) is printed by a
process that never imports torch, numpy's heavy users or any source's library; the sources are declared
without importing their modules. Times are in benchmarks/startup.py, never here."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT, patience

from extract.cli.startup import COMMANDS

HEAVY = ("torch", "torchvision", "transformers", "zarr", "timm", "open_clip", "datasets", "pyarrow")


def imported_by_help(argv: list[str]) -> tuple[str, list[str]]:
    """What ``extract ARGV`` prints, and which of ``HEAVY`` its process imported, run in a fresh interpreter."""
    code = (
        "import contextlib, io, sys\n"
        "from extract.cli.startup import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        f"        code = main({argv!r})\n"
        "    except SystemExit as e:\n"
        "        code = e.code\n"
        f"print(code, sorted(set({HEAVY!r}) & set(sys.modules)), repr(out.getvalue()))\n"
    )
    result = patience.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, quiet=120)
    assert result.returncode == 0, result.stderr
    status, _, rest = result.stdout.strip().partition(" ")
    loaded, _, printed = rest.partition("] ")
    assert status in ("0", "None"), result.stdout
    return eval(printed), [name.strip(" '") for name in loaded.strip("[").split(",") if name.strip(" '")]


@pytest.mark.parametrize("command", [*COMMANDS, None])
def test_help_imports_no_torch(command):
    printed, loaded = imported_by_help(["--help"] if command is None else [command, "--help"])
    assert loaded == [], f"extract {command or ''} --help imported {loaded}"
    assert printed.startswith("usage:")  # the help itself, not an error


def test_run_help_lists_every_declared_source():
    """The sources' declarations (``registry.py``) give ``--help`` its kinds without importing a source."""
    from extract.data.registry import SOURCES as DATA
    from extract.models.registry import SOURCES as MODELS

    printed, _ = imported_by_help(["run", "--help"])
    text = " ".join(printed.split())
    assert all(source.usage in text for source in DATA), text
    assert all(" ".join(source.usage.split()) in text for source in MODELS), text


def test_a_bad_flag_is_refused_without_torch():
    code = (
        "import sys\nfrom extract.cli.startup import main\n"
        "status = main(['run', '--layers', 'layer4', '--batch-size', 'many'])\n"
        "print(status, 'torch' in sys.modules)\n"
    )
    result = patience.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, quiet=120)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert "--batch-size" in result.stderr and len(result.stderr.strip().splitlines()) == 1
