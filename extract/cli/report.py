"""``python -m extract.report``: one self-contained HTML page about a store (``extract.analysis.report``).

    python -m extract.report STORE [--out report.html] [--layers L ...] [--max-samples 5000] [--k 20]

Needs matplotlib: ``pip install 'extract[report]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# the declarations, not the machinery: --help loads no torch (``build_report`` is imported to run)
from ..analysis.options import ReportConfig
from ..names.options import option
from .base import CommandLine, command, values, write_output


@dataclass(frozen=True)
class ReportFiles:
    """What ``report`` reads and writes, besides what the report shows (``ReportConfig``)."""

    store: str = field(metadata=option(positional=True, help="a complete extract store"))
    out: str = field(default="report.html", metadata=option(help="the HTML file to write"))


LINE = CommandLine(
    "python -m extract.report",
    "An HTML report with figures about a store.",
    (ReportFiles, ReportConfig),
)


@command("extract.report")
def main(argv: Sequence[str] | None = None) -> int:
    args = LINE.parse_args(argv)
    files, config = values(args, ReportFiles), values(args, ReportConfig)
    from ..analysis.report import build_report

    report = build_report(files.store, config)
    write_output("--out", files.out, report.html())
    print(f"{files.out}: {len(report.figures)} figures" + "".join(f"; {n}" for n in report.notes))
    return 0
