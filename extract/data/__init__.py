"""Data sources behind ``--data``: one module per source, each declaring itself once (a
``DataSource``); ``registry.py`` dispatches on the spec's prefix.

``build_dataset(spec, preprocess, ...)`` returns a ``Source``: random access to samples (items are
``(image, label, index, error)``), their ``keys()``, ``classes``, a listing hash and the folder its
images live in. The listing is made once per job (rank 0, or split across ranks), not on every rank.
"""

from __future__ import annotations

from typing import Any

from ..errors import ExtractError
from .decode import DECODES, Decoding, Transform
from .listing import Ranks
from .registry import DATA_KINDS, open_source
from .source import DataOptions, DataRequest, DataSource, Source
from .synthetic import SyntheticImages

__all__ = [
    "DATA_KINDS",
    "DECODES",
    "DataOptions",
    "DataSource",
    "Source",
    "SyntheticImages",
    "build_dataset",
    "reuses_index",
    "saved_indexes",
]
SAVED_INDEX = "wds"  # the shard index's name in the store (``index/wds``), so that a resume does not rescan
LEGACY_SAVED_INDEX = "wds-index.json.gz"  # where stores made before kept it: a file inside the zarr hierarchy


def build_dataset(
    spec: str,
    preprocess: Transform,
    image_size: int,
    options: DataOptions | None = None,
    *,
    preprocessing: dict[str, Any] | None = None,
    ranks: Ranks | None = None,
    saved_index: bytes | None = None,
) -> Source:
    """Parse ``--data``, list the data once (``ranks``: the process state, to share the listing) and
    attach the decoding; refuses empty data sets. ``saved_index``: a shard index kept with the store."""
    options = options or DataOptions()
    source = open_source(DataRequest(spec, image_size, options, ranks, saved_index))
    if len(source) == 0:
        raise ExtractError(f"--data {spec} is empty; point it at a folder or list with images")
    source.decoding = Decoding(
        preprocess, options.decode, preprocessing=preprocessing, exif_transpose=options.exif_transpose
    )
    source.image_size = image_size
    return source


def reuses_index(identity: dict[str, Any] | None, spec: str, options: DataOptions) -> bool:
    """Whether an index kept with a store made for ``identity`` lists the same ``--data`` as ``spec``."""
    return identity is not None and all(
        identity.get(k) == v
        for k, v in (("data", spec), ("image_key", options.image_key), ("label_key", options.label_key))
    )


def saved_indexes(source: Source) -> dict[str, bytes]:
    """The listings ``source`` can keep with the store, by name (shards: their index)."""
    blob = source.saved_index() if hasattr(source, "saved_index") else None
    return {SAVED_INDEX: blob} if blob is not None else {}
