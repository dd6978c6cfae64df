"""The flag reference of ``extract run``, rendered from the options' declaration (``extract.job.spec``).

    python -m extract.cli.reference > docs/cli.md     # the reference page
    python -m extract.cli.reference --readme          # README.md's flag table, rewritten in place

``tests/test_reference.py`` fails when either differs from what the declaration renders, so the
reference cannot drift from the parser the way a hand-written table did.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .extract import flags

HEADER = "| flag | meaning |\n| --- | --- |\n"
REGENERATE = "python -m extract.cli.reference > docs/cli.md"
REGENERATE_README = "python -m extract.cli.reference --readme"
README = Path(__file__).resolve().parents[2] / "README.md"
# a markdown link's target that is relative to the README: an anchor in it (#...) or a repository path
_LINK = re.compile(r"\]\((?!https?:|/)([^)]*)\)")


def flag_table(base: str = "") -> str:
    """The markdown table of every flag of ``extract run``, in --help's order, each with its reference
    text. The texts' links are written from the README (``#anchor``, ``benchmarks/...``); ``base`` is the
    way from the page the table goes in back to the repository root (``"../"`` for docs/cli.md), so that
    they still lead there."""
    rows = []
    for dest, declared, keywords in flags():
        cell = declared.flag or "--" + dest.replace("_", "-")
        if keywords.get("metavar"):
            cell += f" {keywords['metavar']}" + (" ..." if keywords.get("nargs") == "+" else "")
        text = declared.reference_text()
        if base:
            text = _LINK.sub(lambda m: f"]({base}{'README.md' if m[1].startswith('#') else ''}{m[1]})", text)
        # a bare | would end the cell (markdown tables need it escaped, inside code spans too)
        rows.append(f"| `{cell}` | {text.replace('|', chr(92) + '|')} |\n")
    return HEADER + "".join(rows)


def cli_page() -> str:
    """docs/cli.md: a heading, how it is made, and the table."""
    return (
        "# `extract run`: every flag\n\n"
        "Generated from the job's options as declared in `extract/job/spec.py` (and `--config`, `--list-layers` "
        f"in `extract/cli/extract.py`); do not edit it by hand, regenerate it: `{REGENERATE}`. A TOML job file "
        "(`--config`) takes the same options, named with underscores (`batch_size = 32`).\n\n" + flag_table("../")
    )


def with_readme_table(readme: str) -> str:
    """``readme`` with its flag table (from ``HEADER`` to the first line that is no table row) replaced
    by the generated one; the text around it is kept."""
    start = readme.index(HEADER)
    end = start
    for line in readme[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return readme[:start] + flag_table() + readme[end:]


def readme_table(readme: str) -> str:
    """The flag table as it stands in ``readme`` (what ``with_readme_table`` replaces)."""
    start = readme.index(HEADER)
    rows = []
    for line in readme[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        rows.append(line)
    return "".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--readme"]:
        README.write_text(with_readme_table(README.read_text(encoding="utf-8")), encoding="utf-8")
    elif not args:
        sys.stdout.write(cli_page())
    else:
        print(f"usage: {REGENERATE}  |  {REGENERATE_README}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
