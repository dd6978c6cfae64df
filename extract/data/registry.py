"""The data sources, each declared once here as a ``DataSource``: the dispatch of
``--data PREFIX:LOCATION``, its messages (an unknown kind, a missing extra) and the list of kinds
(``--help``, "use one of ...") all come from these declarations.

A declaration names its opener by module and function (``extract.data.folder:open_folder``),
imported when a source is opened: reading the declarations (``--help``, a bad flag) imports neither
torch nor any source's library. ``open_source`` imports the source's library when it is asked for,
so that a missing one is a one-line error naming its extra.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ExtractError, InvalidRequestError

if TYPE_CHECKING:
    from .source import DataRequest, Source, TextSource


def resolved_path(location: str) -> str:
    """A path, or a pattern (glob, braces) whose literal folders are resolved: absolute, symlinks followed."""
    return str(Path(location).resolve()) if location else location


def _resolve_hf(location: str) -> str:
    path, colon, split = location.partition(":")
    return f"{resolved_path(path)}{colon}{split}"


def _resolve_torchvision(rest: str) -> str:
    name, colon, location = rest.partition(":")
    root, colon_split, split = location.partition(":")
    return f"{name}{colon}{resolved_path(root)}{colon_split}{split}"


@dataclass(frozen=True)
class DataSource:
    """A ``--data`` source (as timm declares a model with ``@register_model``).

    ``PREFIX:LOCATION`` opens it: ``open(location, request)`` calls ``opener``, ``module:function``,
    imported on use. ``library`` is the import name of the optional library it needs and ``extra`` the
    pip extra that installs it. ``resolve`` writes a location with its path absolute and resolved
    (``resolved_path`` where the location is a path).
    """

    prefix: str
    location: str  # how the part after the prefix is written, for messages and --help: "PATTERN_OR_DIR"
    example: str  # a --data value of this kind
    opener: str  # "extract.data.folder:open_folder": (location, request) -> the source, listed
    library: str | None = None
    extra: str | None = None
    # the location with its path resolved, so that one folder given two ways is one job; None: no path
    resolve: Callable[[str], str] | None = None

    @property
    def usage(self) -> str:
        return f"{self.prefix}:{self.location}"

    def open(self, location: str, request: DataRequest) -> Source | TextSource:
        """The source at ``location`` (what follows the prefix), listed, by the source's own opener."""
        module, _, function = self.opener.partition(":")
        return getattr(importlib.import_module(module), function)(location, request)


SOURCES: tuple[DataSource, ...] = (
    DataSource("synthetic", location="N", example="synthetic:512", opener="extract.data.synthetic:open_synthetic"),
    DataSource(
        "imagefolder", location="PATH", example="imagefolder:/data/train", opener="extract.data.folder:open_folder",
        resolve=resolved_path,
    ),
    DataSource(
        "filelist", location="FILE", example="filelist:/data/train.txt", opener="extract.data.filelist:open_filelist",
        resolve=resolved_path,
    ),
    DataSource(
        "torchvision", location="NAME:ROOT[:split]", example="torchvision:CIFAR10:/data:test",
        opener="extract.data.torchvision:open_torchvision", resolve=_resolve_torchvision,
    ),
    DataSource(
        "wds", location="PATTERN_OR_DIR", example="wds:/data/train-{000000..000999}.tar",
        opener="extract.data.shards:open_shards", resolve=resolved_path,
    ),
    DataSource(
        "parquet", location="GLOB", example="parquet:/data/train-*.parquet", opener="extract.data.parquet:open_parquet",
        library="pyarrow", extra="parquet", resolve=resolved_path,
    ),
    DataSource(
        "hf", location="PATH[:split]", example="hf:/data/saved", opener="extract.data.hf:open_hf", library="datasets",
        extra="datasets", resolve=_resolve_hf,
    ),
    DataSource(
        "text", location="GLOB", example="text:/data/corpus/*.jsonl", opener="extract.data.text:open_text",
        resolve=resolved_path,
    ),
)  # fmt: skip
DATA_KINDS = tuple(source.usage for source in SOURCES)
_BY_PREFIX = {source.prefix: source for source in SOURCES}


def declared(prefix: str) -> DataSource:
    """The declaration of the source ``prefix`` names (for a source's own messages: its usage, its example)."""
    return _BY_PREFIX[prefix]


def open_source(request: DataRequest, at: str | None = None) -> Source | TextSource:
    """The source ``request.spec`` names, opened (listed) at its location, or at ``at``: the same spec
    written as the job records it (its path resolved); messages about the spec name it as given."""
    prefix, _, location = (at or request.spec).partition(":")
    source = _BY_PREFIX.get(prefix)
    if source is None:
        raise InvalidRequestError(f"unknown --data '{request.spec}'; use one of {', '.join(DATA_KINDS)}")
    _require(source, request.spec)
    return source.open(location, request)


def resolve_spec(spec: str) -> str:
    """``spec`` with its path resolved (``imagefolder:imgs`` -> ``imagefolder:/home/me/imgs``); a spec
    of an unknown kind, or of a kind with no path, as it is."""
    prefix, colon, location = spec.partition(":")
    source = _BY_PREFIX.get(prefix)
    if source is None or source.resolve is None or not colon:
        return spec
    return f"{prefix}:{source.resolve(location)}"


def _require(source: DataSource, spec: str) -> None:
    if source.library is None:
        return
    try:
        importlib.import_module(source.library)
    except ImportError:
        raise ExtractError(
            f"--data {spec} needs the '{source.library}' package; install it with pip install 'extract[{source.extra}]'"
        ) from None


def data_kinds() -> str:
    """What ``--data`` takes, for ``--help``: every source's usage, in declaration order."""
    return " | ".join(DATA_KINDS)
