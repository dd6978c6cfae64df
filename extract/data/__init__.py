"""Data sources behind ``--data``: one module per source, each declaring itself once (a
``DataSource``); ``registry.py`` dispatches on the spec's prefix.

``build_dataset(spec, preprocess, ...)`` returns a ``Source``: random access to samples (items are
``(image, label, index, error)``), their ``keys()``, ``classes``, a listing hash and the folder its
images live in. The listing is made once per job (rank 0, or split across ranks), not on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
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
    "keep_index",
    "kept_index",
]
SAVED_INDEX = "wds-index.json.gz"  # in the store: the shard index, so that a resume does not rescan


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


def kept_index(out: Path, identity: dict[str, Any] | None, spec: str, options: DataOptions) -> bytes | None:
    """The index kept in the store at ``out`` when that store was made from the same ``--data``."""
    same = identity is not None and all(
        identity.get(k) == v
        for k, v in (("data", spec), ("image_key", options.image_key), ("label_key", options.label_key))
    )
    try:
        return (out / SAVED_INDEX).read_bytes() if same else None
    except OSError:
        return None


def keep_index(out: Path, source: Source) -> None:
    """Write the source's index (shards only) into the store, atomically."""
    blob = source.saved_index() if hasattr(source, "saved_index") else None
    if blob is not None:
        partial = out / f"{SAVED_INDEX}.partial"
        partial.write_bytes(blob)
        os.replace(partial, out / SAVED_INDEX)
