"""How an option is declared: a dataclass field's ``option(...)`` metadata gives its flag, help, check and
reference text, so that one declaration makes the command line (``extract.cli.base.arguments``), the
flag reference (docs/cli.md) and, for ``extract run``, the job file's keys.

Here, below every stage, because the job (``extract.job.spec.JobSpec``), the analysis
(``extract.analysis.options``) and the store (``extract.store.verifying``) all declare options, and the
analysis and the store may not import the job. Standard library only: ``--help`` loads no library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

# A text, or a function making it: some help lists what registries hold, known only once their sources are
# imported; resolving it when the parser is built keeps ``import extract`` from importing every source.
Text = str | Callable[[], str]
# A check of one option's value (never None): raises ExtractError naming the flag it is given.
Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Option:
    """How an option appears on the command line and in the flag reference. The flag's kind (switch,
    list, number) follows the field's type unless ``nargs`` or ``parse`` say otherwise."""

    help: Text  # --help's text; never a copy of the default, which --help and the reference add themselves
    metavar: str | tuple[str, ...] | None = None  # --help's name for the value (argparse's, the dest in capitals)
    flag: str | None = None  # the flag, when it is not --field-name (a boolean on by default: --no-NAME)
    check: Check | None = None  # run by JobSpec.validate on a value that is not None
    reference: Text | None = None  # the reference's longer text (markdown; README links as #anchor); help if None
    positional: bool = False  # an argument, not a flag (optional when the field has a default)
    short: str | None = None  # a one-letter flag besides the long one (-k)
    nargs: int | str | None = None  # how many values, when the type does not say (--to FORMAT DIR)
    parse: Callable[[str], Any] | None = None  # the value from its text, when the type's own is not it (1,5,9)
    choices: tuple[str, ...] | None = None  # argparse refuses the others (its own message)
    required: bool = False  # a flag that must be given
    group: str | None = None  # --help's heading for the flags that only one mode uses (linear, knn)

    def help_text(self) -> str:
        return self.help if isinstance(self.help, str) else self.help()

    def reference_text(self) -> str:
        text = self.help if self.reference is None else self.reference
        return text if isinstance(text, str) else text()


def option(
    *,
    help: Text,
    metavar: str | tuple[str, ...] | None = None,
    flag: str | None = None,
    check: Check | None = None,
    reference: Text | None = None,
    positional: bool = False,
    short: str | None = None,
    nargs: int | str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    required: bool = False,
    group: str | None = None,
) -> dict[str, Option]:
    """A declared field's metadata: ``field(default=..., metadata=option(help=...))``."""
    declared = Option(
        help=help, metavar=metavar, flag=flag, check=check, reference=reference, positional=positional, short=short,
        nargs=nargs, parse=parse, choices=choices, required=required, group=group,
    )  # fmt: skip
    return {"option": declared}


def declared_options(cls: type) -> list[tuple[Field[Any], Option]]:
    """Every field of the dataclass ``cls`` with its declaration, in field order (--help's and the
    reference's order). A field without one is a bug, not a choice: it would be an option nobody can give."""
    declared = []
    for f in fields(cls):
        if not isinstance(f.metadata.get("option"), Option):
            raise TypeError(f"{cls.__name__}.{f.name} has no option(...) in its field metadata")
        declared.append((f, f.metadata["option"]))
    return declared


def flag_of(f: Field[Any]) -> str:
    """A field's flag: its own, or ``--`` and its name with dashes (a TOML key keeps the underscores)."""
    declared: Option = f.metadata["option"]
    return declared.flag or "--" + f.name.replace("_", "-")


def default_of(f: Field[Any]) -> Any:
    """A field's default (made afresh from its factory), or ``MISSING`` where it has none."""
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING
