"""Data sources behind ``--data``: one module per source, dispatched on the spec's prefix.

``build_dataset(spec, preprocess, ...)`` returns a ``Source``: random access to samples (items are
``(image, label, index, error)``), their ``keys()``, ``classes`` and a listing hash. The listing is
made once per job (rank 0, or split across ranks), not on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ExtractError
from .decode import DECODES, Decoding, Transform
from .listing import Ranks
from .source import Source
from .synthetic import SyntheticImages, SyntheticSource

DATA_KINDS = (
    "synthetic:N", "imagefolder:PATH", "filelist:FILE", "torchvision:NAME:ROOT[:split]", "wds:PATTERN_OR_DIR",
    "parquet:GLOB", "hf:PATH[:split]",
)  # fmt: skip

__all__ = [
    "DATA_KINDS",
    "DECODES",
    "DataOptions",
    "Source",
    "SyntheticImages",
    "build_dataset",
    "reuses_index",
    "saved_indexes",
]
SAVED_INDEX = "wds"  # the shard index's name in the store (``index/wds``), so that a resume does not rescan
LEGACY_SAVED_INDEX = "wds-index.json.gz"  # where stores made before kept it: a file inside the zarr hierarchy


@dataclass(frozen=True)
class DataOptions:
    image_key: str | None = None
    label_key: str | None = None
    decode: str = "pil"
    exif_transpose: bool = False


def _require(library: str, extra: str, spec: str) -> None:
    try:
        __import__(library)
    except ImportError:
        raise ExtractError(
            f"--data {spec} needs the '{library}' package; install it with pip install 'extract[{extra}]'"
        ) from None


def _open(spec: str, image_size: int, options: DataOptions, ranks: Ranks | None, saved: bytes | None) -> Source:
    kind, _, rest = spec.partition(":")
    if kind == "synthetic":
        if not rest.isdigit():
            raise ExtractError(f"--data {spec}: write synthetic:N with N a whole number, e.g. synthetic:512")
        return SyntheticSource(int(rest), image_size)
    if kind == "imagefolder":
        from .folder import open_folder

        return open_folder(rest, ranks)
    if kind == "filelist":
        from .filelist import open_filelist

        return open_filelist(rest, ranks)
    if kind == "torchvision":
        from .torchvision import open_torchvision

        return open_torchvision(rest)
    if kind == "wds":
        from .shards import open_shards

        return open_shards(rest, options.image_key, options.label_key, ranks, saved)
    if kind == "parquet":
        _require("pyarrow", "parquet", spec)
        from .parquet import open_parquet

        return open_parquet(rest, options.image_key, options.label_key, ranks)
    if kind == "hf":
        _require("datasets", "datasets", spec)
        from .hf import HFSource

        path, _, split = rest.partition(":")
        return HFSource(path, split or None, options.image_key, options.label_key)
    raise ExtractError(f"unknown --data '{spec}'; use one of {', '.join(DATA_KINDS)}")


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
    source = _open(spec, image_size, options, ranks, saved_index)
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
