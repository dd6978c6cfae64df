"""``python -m extract.report``: one self-contained HTML page about a store (``extract.analysis.report``).

    python -m extract.report STORE [--out report.html] [--layers L ...] [--max-samples 5000] [--k 20]

Needs matplotlib: ``pip install 'extract[report]'``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

# the declarations, not the machinery: --help loads no torch (``build_report`` is imported to run)
from ..analysis.options import ReportConfig
from ..names.options import option
from .base import Argument, arguments, command, make_parser, values, write_output

PROG = "python -m extract.report"
DESCRIPTION = "An HTML report with figures about a store."


@dataclass(frozen=True)
class ReportFiles:
    """What ``report`` reads and writes, besides what the report shows (``ReportConfig``)."""

    store: str = field(metadata=option(positional=True, help="a complete extract store"))
    out: str = field(default="report.html", metadata=option(help="the HTML file to write"))


def declared() -> list[Argument]:
    return arguments(ReportFiles, ReportConfig)


def build_parser() -> argparse.ArgumentParser:
    return make_parser(PROG, DESCRIPTION, declared())


@command("extract.report")
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files, config = values(args, ReportFiles), values(args, ReportConfig)
    from ..analysis.report import build_report

    report = build_report(files.store, config)
    write_output("--out", files.out, report.html())
    print(f"{files.out}: {len(report.figures)} figures" + "".join(f"; {n}" for n in report.notes))
    return 0
