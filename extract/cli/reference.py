"""The flag reference of every command, rendered from the options' declarations (``extract.job.spec``
for ``extract run``, the dataclasses each command's module declares or imports for the others).

    python -m extract.cli.reference > docs/cli.md     # the reference page

``tests/test_reference.py`` fails when it differs from what the declaration renders, so the
reference cannot drift from the parser the way a hand-written table did.
"""

from __future__ import annotations

import importlib
import re
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from .base import Argument
from .extract import declared as run_flags
from .startup import COMMANDS

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


def flag_table(pages: dict[str, str] | None = None, declared: Sequence[Argument] | None = None) -> str:
    """The markdown table of a command's flags (``declared``; ``extract run``'s if None), in --help's order,
    each with its reference text and declared default; its links lead to the docs pages that hold their
    anchors (``pages``: anchor -> page)."""
    pages = _anchor_pages() if pages is None else pages
    rows = []
    for argument in run_flags() if declared is None else declared:
        text = _linked(argument.reference(), pages)
        # a bare | would end the cell (markdown tables need it escaped, inside code spans too)
        rows.append(f"| `{argument.cell()}` | {text.replace('|', chr(92) + '|')} |\n")
    return HEADER + "".join(rows)


def command_flags() -> dict[str, list[Argument]]:
    """Every command but ``run`` (and ``list-layers``, which is ``run --list-layers``) with its flags."""
    found = {}
    for name, (module, _) in COMMANDS.items():
        if module != "extract":
            found[name] = importlib.import_module(f"extract.cli.{module}").LINE.arguments()
    return found


def cli_page() -> str:
    """docs/cli.md: a heading, how it is made, and a table per command."""
    pages = _anchor_pages()
    sections = [
        f"## `extract {name}`\n\n{COMMANDS[name][1][0].upper()}{COMMANDS[name][1][1:]}. "
        f"Also `python -m extract.{COMMANDS[name][0]}`.\n\n{flag_table(pages, declared)}"
        for name, declared in command_flags().items()
    ]
    return (
        "# Every command's flags\n\n"
        "Generated from the options as declared: `extract run`'s in `extract/job/spec.py` (and `--config`, "
        "`--list-layers` in `extract/cli/extract.py`), the other commands' in the dataclasses their modules in "
        "`extract/cli/` name (`extract/analysis/options.py`, `extract/store/verifying.py`); do not edit it by "
        f"hand, regenerate it: `{REGENERATE}`. A flag is a dataclass field with `option(help=...)` in its "
        "metadata (`extract/names/options.py`): its default is the field's, which `--help` and this page show; "
        "a command is a module of `extract/cli/` with a `LINE` (`CommandLine`: its dataclasses) and a thin "
        "`main()`, named in `COMMANDS` (`extract/cli/startup.py`).\n\n"
        "## `extract run`\n\n"
        "Extract a model's layers over a dataset into a store; `extract list-layers` is `extract run "
        "--list-layers`. A TOML job file (`--config`) takes the same options, named with underscores "
        "(`batch_size = 32`).\n\n" + flag_table(pages) + "\n" + "\n".join(sections)
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
