"""The data sources, each declared once in its own module as a ``DataSource``: the dispatch of
``--data PREFIX:LOCATION``, its messages (an unknown kind, a missing extra) and the list of kinds
(``--help``, "use one of ...") all come from those declarations.

Declaring imports no optional library: ``open_source`` imports the source's library when it is
asked for, so that a missing one is a one-line error naming its extra.
"""

from __future__ import annotations

import importlib

from ..errors import ExtractError
from . import filelist, folder, hf, parquet, shards, synthetic, text, torchvision
from .source import DataRequest, DataSource, Source, TextSource

SOURCES: tuple[DataSource, ...] = (
    synthetic.SOURCE, folder.SOURCE, filelist.SOURCE, torchvision.SOURCE, shards.SOURCE, parquet.SOURCE, hf.SOURCE,
    text.SOURCE,
)  # fmt: skip
DATA_KINDS = tuple(source.usage for source in SOURCES)
_BY_PREFIX = {source.prefix: source for source in SOURCES}


def open_source(request: DataRequest, at: str | None = None) -> Source | TextSource:
    """The source ``request.spec`` names, opened (listed) at its location, or at ``at``: the same spec
    written as the job records it (its path resolved); messages about the spec name it as given."""
    prefix, _, location = (at or request.spec).partition(":")
    source = _BY_PREFIX.get(prefix)
    if source is None:
        raise ExtractError(f"unknown --data '{request.spec}'; use one of {', '.join(DATA_KINDS)}")
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
