"""The flag reference of ``extract run``, rendered from the options' declaration (``extract.job.spec``).

    python -m extract.cli.reference > docs/cli.md     # the reference page

``tests/test_reference.py`` fails when it differs from what the declaration renders, so the
reference cannot drift from the parser the way a hand-written table did.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from .extract import flags

HEADER = "| flag | meaning |\n| --- | --- |\n"
REGENERATE = "python -m extract.cli.reference > docs/cli.md"
DOCS = Path(__file__).resolve().parents[2] / "docs"
# a markdown link whose target is no URL: an anchor (#...) of the page the text was written for, or a path
_LINK = re.compile(r"\[([^\]]*)\]\((?!https?:)([^)]*)\)")


def _slug(title: str) -> str:
    """A heading's anchor as Python-Markdown's toc makes it (mkdocs' default)."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchor_pages(docs: Path = DOCS) -> dict[str, str]:
    """Each heading's anchor in the docs, and the page it is on (the first, where two pages share one)."""
    pages: dict[str, str] = {}
    for page in sorted(docs.glob("*.md")):
        if page.name != "cli.md":
            for line in page.read_text(encoding="utf-8").splitlines():
                if line.startswith("#"):
                    pages.setdefault(_slug(line.lstrip("#")), page.name)
    return pages


def _linked(text: str, pages: dict[str, str]) -> str:
    """The reference text's links as they lead from docs/cli.md: an anchor to the docs page that holds it;
    a path of the repository (outside the docs, which a strict build refuses) as plain text."""

    def link(match: re.Match[str]) -> str:
        words, target = match[1], match[2]
        if target.startswith("#") and target[1:] in pages:
            return f"[{words}]({pages[target[1:]]}{target})"
        return words if target.startswith("#") else f"{words} (`{target}`)"

    return _LINK.sub(link, text)


def flag_table(pages: dict[str, str] | None = None) -> str:
    """The markdown table of every flag of ``extract run``, in --help's order, each with its reference
    text; its links lead to the docs pages that hold their anchors (``pages``: anchor -> page)."""
    pages = _anchor_pages() if pages is None else pages
    rows = []
    for dest, declared, keywords in flags():
        cell = declared.flag or "--" + dest.replace("_", "-")
        if keywords.get("metavar"):
            cell += f" {keywords['metavar']}" + (" ..." if keywords.get("nargs") == "+" else "")
        text = _linked(declared.reference_text(), pages)
        # a bare | would end the cell (markdown tables need it escaped, inside code spans too)
        rows.append(f"| `{cell}` | {text.replace('|', chr(92) + '|')} |\n")
    return HEADER + "".join(rows)


def cli_page() -> str:
    """docs/cli.md: a heading, how it is made, and the table."""
    return (
        "# `extract run`: every flag\n\n"
        "Generated from the job's options as declared in `extract/job/spec.py` (and `--config`, `--list-layers` "
        f"in `extract/cli/extract.py`); do not edit it by hand, regenerate it: `{REGENERATE}`. A TOML job file "
        "(`--config`) takes the same options, named with underscores (`batch_size = 32`).\n\n" + flag_table()
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    sys.stdout.write(cli_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
