"""What every command shares: the parser built from its options' declaration (``option(...)`` metadata on
dataclass fields, ``extract.names.options``), whose errors are one line, the wrapper that turns a command's
exceptions into one line and an exit status, and the writer of output files.

This module imports nothing of the extraction pipeline: the analysis commands use it too, and must
not load the job, the writer or the lock. What only extraction can raise (``Interrupted``,
``WriterError``) is handled by the failures ``extract.cli.extract`` passes to ``command``.
"""

from __future__ import annotations

import argparse
import collections.abc
import functools
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, NoReturn, ParamSpec, TypeVar, get_args, get_origin

from ..errors import ExtractError
from ..names.options import Option, declared_options, default_of
from ..store.location import described, from_object_storage

P = ParamSpec("P")
T = TypeVar("T")
# (the command's name, the exception) -> the exit status; the handler prints its own line, if any
Failure = Callable[[str, Any], int]


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ``ExtractError``s: one line, exit status 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        raise ExtractError(f"{message} (see --help)")


@dataclass(frozen=True)
class Argument:
    """One flag (or positional argument) of a command: where its value goes, its declaration, argparse's
    keywords for it, and the default --help and the reference show (None: none to show)."""

    dest: str
    declared: Option
    keywords: dict[str, Any]
    shown_default: Any = None

    @property
    def names(self) -> list[str]:
        if self.declared.positional:
            return [self.dest]
        flag = self.declared.flag or "--" + self.dest.replace("_", "-")
        return [self.declared.short, flag] if self.declared.short else [flag]

    def help(self) -> str:
        """--help's text: the declared help, then the declared default (argparse formats it: % doubled)."""
        return (self.declared.help_text() + self._default()).replace("%", "%%")

    def reference(self) -> str:
        """The reference's text (markdown): the declared reference, which says the default in its own
        words where it is written apart from the help; else the help, then the declared default."""
        return self.declared.reference_text() + ("" if self.declared.reference is not None else self._default())

    def cell(self) -> str:
        """How the reference names it: the flag and its value, as --help's usage does."""
        metavar = self.keywords.get("metavar")
        if self.declared.positional:
            return str(metavar or self.dest.upper())
        name = ", ".join(self.names)
        if metavar is None and self.declared.choices:  # as --help's usage names them
            metavar = "{" + ",".join(self.declared.choices) + "}"
        if metavar:
            name += " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
            name += " ..." if self.keywords.get("nargs") == "+" else ""
        return name

    def _default(self) -> str:
        value = self.shown_default
        if value is None or isinstance(value, bool) or value in ((), []):
            return ""
        if isinstance(value, float) and value.is_integer():  # 1800 seconds, a step of 1: as a user writes them
            value = int(value)
        if isinstance(value, (list, tuple)):  # as it is given: 0.01,0.03 for a parsed list, else spaced
            value = ("," if self.declared.parse else " ").join(map(str, value))
        return f" (default {value})"


def _hint(cls: type, annotation: Any) -> Any:
    """A field's type, evaluated in its module; one that names what is imported only for annotations
    (``torch.device``) is read as text, which is what its flag takes."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, vars(sys.modules[cls.__module__]))  # the module's own annotation, as typing does
    except (NameError, AttributeError):
        return str


def _kinds(kind: Any) -> tuple[Any, ...]:
    """``kind`` and, for a union, each of its members."""
    return (kind, *get_args(kind))


def arguments(*declarations: type, defaults: bool = True) -> list[Argument]:
    """The arguments of the dataclasses ``declarations`` (in field order), their kind following each field's
    type: a boolean is a switch that turns its default over, a list takes one or more values, int, float
    and Path are parsed. --help shows each field's default. ``defaults``: the parser's defaults are the
    fields'; without, every one is None, so that ``extract run`` tells a flag given from one left out."""
    found = []
    for cls in declarations:
        for f, declared in declared_options(cls):
            kind, keywords = _hint(cls, f.type), {}
            default = default_of(f)
            if kind is bool:  # --overwrite, --no-truncate
                keywords["action"] = "store_false" if default is True else "store_true"
            else:
                lists = {get_origin(k) for k in _kinds(kind)} & {list, collections.abc.Sequence}
                items = [a for k in _kinds(kind) if get_origin(k) in lists for a in get_args(k)]
                if declared.nargs is not None:
                    keywords["nargs"] = declared.nargs
                elif lists and declared.parse is None:
                    keywords["nargs"] = "+"  # --layers, --pool (one value, or one per layer)
                elif declared.positional and default is not MISSING:
                    keywords["nargs"] = "?"
                parsed = [t for t in (int, float, Path) if t in (*_kinds(kind), *items)]
                if declared.parse is not None or parsed:
                    keywords["type"] = declared.parse or parsed[0]
                if declared.metavar is not None:
                    keywords["metavar"] = declared.metavar
                if declared.choices is not None:
                    keywords["choices"] = declared.choices
            if declared.required:
                keywords["required"] = True
            if not declared.positional or default is not MISSING:
                keywords["default"] = default if defaults and default is not MISSING else None
            found.append(Argument(f.name, declared, keywords, None if default is MISSING else default))
    return found


def make_parser(
    prog: str,
    description: str,
    declared: Sequence[Argument],
    *,
    epilog: str | None = None,
    parser: type[argparse.ArgumentParser] = Parser,
) -> argparse.ArgumentParser:
    """A command's parser from its arguments (``arguments``): one builder for every command."""
    p = parser(prog=prog, description=description, epilog=epilog)
    groups: dict[str, Any] = {}
    for argument in declared:
        group = argument.declared.group
        if group is not None and group not in groups:
            groups[group] = p.add_argument_group(group)
        target = p if group is None else groups[group]
        names = argument.names
        dest = {} if argument.declared.positional else {"dest": argument.dest}
        target.add_argument(*names, **dest, help=argument.help(), **argument.keywords)
    return p


@dataclass(frozen=True)
class CommandLine:
    """A command's line: its name in usage, what it does, and the dataclasses that declare its options
    (their fields, in order, are its arguments); its parser and its section of docs/cli.md come from it."""

    prog: str
    description: str
    declarations: tuple[type, ...]
    parser: type[argparse.ArgumentParser] = Parser

    def arguments(self) -> list[Argument]:
        return arguments(*self.declarations)

    def build_parser(self) -> argparse.ArgumentParser:
        return make_parser(self.prog, self.description, self.arguments(), parser=self.parser)

    def parse_args(self, argv: Sequence[str] | None) -> argparse.Namespace:
        """The parsed arguments, for ``values`` to make each declaration's dataclass of."""
        return self.build_parser().parse_args(argv)


def values(args: argparse.Namespace, cls: type[T]) -> T:
    """The dataclass ``cls`` from the parsed arguments: the Namespace stays in the command line."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})  # type: ignore[arg-type]


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
