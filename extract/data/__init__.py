"""Data sources behind ``--data``: one module per source, each declaring itself once (a
``DataSource``); ``registry.py`` dispatches on the spec's prefix.

``build_dataset(spec, preprocess, ...)`` returns a ``Source``: random access to samples (items are
``(image, label, index, error)``), their ``keys()``, ``classes``, a listing hash and the folder its
images live in; or, for text (``text:GLOB``, an ``hf:`` dataset with a text column), a ``TextSource``
whose ``documents(start, stop)`` streams ``Document``s, with the same keys, classes and hash. The
listing is made once per job (rank 0, or split across ranks), not on every rank. It is opened at ``job_data(spec)``, the spec with its path resolved, which the job's identity records:
the same folder given as a relative or an absolute path is the same job.

A job lists its data before it builds the model (``open_dataset``: no model is needed for it) and
gives an image source the model's transform afterwards (``attach_decoding``); ``build_dataset`` is
the two at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ExtractError
from ..names import DECODES
from .registry import DATA_KINDS, DataSource, open_source, resolve_spec

if TYPE_CHECKING:
    from ..processes import Processes
    from .decode import Transform
    from .source import DataOptions, Document, Source, TextSource
    from .synthetic import SyntheticImages

# name -> the module of this package that defines it, imported on first use (PEP 562): importing the
# package (and its light registry) loads no torch, so that ``extract run --help`` stays light
_LAZY = {
    "Decoding": "decode",
    "Transform": "decode",
    "DataOptions": "source",
    "DataRequest": "source",
    "Document": "source",
    "Source": "source",
    "TextSource": "source",
    "SyntheticImages": "synthetic",
}

__all__ = [
    "DATA_KINDS",
    "DECODES",
    "DataOptions",
    "DataSource",
    "Document",
    "Source",
    "SyntheticImages",
    "TextSource",
    "attach_decoding",
    "build_dataset",
    "job_data",
    "open_dataset",
    "reuses_index",
    "saved_indexes",
]
SAVED_INDEX = "wds"  # the shard index's name in the store (``index/wds``), so that a resume does not rescan
LEGACY_SAVED_INDEX = "wds-index.json.gz"  # where stores made before kept it: a file inside the zarr hierarchy


def build_dataset(
    spec: str,
    preprocess: Transform | None,
    image_size: int,
    options: DataOptions | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
    ranks: Processes | None = None,
    saved_index: bytes | None = None,
    recorded: str | None = None,
) -> Source | TextSource:
    """Parse ``--data``, list the data once (``ranks``: the process state, to share the listing) and
    attach the decoding (images; a text source gets none: the model's tokenizer reads its documents);
    refuses empty data sets. ``saved_index``: a shard index kept with the store;
    ``recorded``: the data its identity records (see ``job_data``). The source's ``spec`` is the data
    as the job's identity records it."""
    from .source import DataOptions

    options = options or DataOptions()
    source = open_dataset(spec, options, ranks=ranks, saved_index=saved_index, recorded=recorded)
    return attach_decoding(source, preprocess, image_size, options, preprocessing=preprocessing)


def open_dataset(
    spec: str,
    options: DataOptions | None = None,
    *,
    ranks: Processes | None = None,
    saved_index: bytes | None = None,
    recorded: str | None = None,
) -> Source | TextSource:
    """``build_dataset`` without the model: the data listed (and refused where it is empty or bad),
    its images not yet given a transform (``attach_decoding``)."""
    from .source import DataOptions, DataRequest, TextSource

    options = options or DataOptions()
    recorded_as = job_data(spec, recorded)
    source = open_source(DataRequest(spec, options, ranks, saved_index), at=recorded_as)
    if len(source) == 0:
        with_what = (
            "files or a dataset with documents" if isinstance(source, TextSource) else "a folder or list with images"
        )
        raise ExtractError(f"--data {spec} is empty; point it at {with_what}")
    source.spec = recorded_as
    return source


def attach_decoding(
    source: Source | TextSource,
    preprocess: Transform | None,
    image_size: int,
    options: DataOptions | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
) -> Source | TextSource:
    """An image source given the model's transform at its input size; a text source as it is (the
    model's tokenizer reads its documents)."""
    from .decode import Decoding
    from .source import DataOptions, TextSource

    if isinstance(source, TextSource):
        return source
    options = options or DataOptions()
    source.decoding = Decoding(
        preprocess, options.decode, preprocessing=preprocessing, exif_transpose=options.exif_transpose
    )
    source.image_size = image_size
    return source


def job_data(spec: str, recorded: str | None = None) -> str:
    """The ``--data`` a job's identity records: ``spec`` with its path resolved. A store made before
    paths were resolved records the path as it was given: where that ``recorded`` path, resolved here,
    is the same, it is kept, so that the store's listing and fingerprint stay its own and it resumes."""
    resolved = resolve_spec(spec)
    if recorded is not None and recorded != resolved and resolve_spec(recorded) == resolved:
        return recorded
    return resolved


def reuses_index(identity: dict[str, Any] | None, spec: str, options: DataOptions) -> bool:
    """Whether an index kept with a store made for ``identity`` lists the same ``--data`` as ``spec``."""
    if identity is None:
        return False
    recorded = identity.get("data")
    return all(
        identity.get(k) == v
        for k, v in (
            ("data", job_data(spec, recorded)), ("image_key", options.image_key), ("label_key", options.label_key)
        )
    )  # fmt: skip


def saved_indexes(source: Source) -> dict[str, bytes]:
    """The listings ``source`` can keep with the store, by name (shards: their index)."""
    blob = source.saved_index() if hasattr(source, "saved_index") else None
    return {SAVED_INDEX: blob} if blob is not None else {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
