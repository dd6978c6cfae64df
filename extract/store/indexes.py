"""Saved listings: a data source's index (the shard index) kept in the store, so that a resume or a
report reads it back instead of listing the data again. Each is ``index/<name>``, a uint8 array: a
member of the hierarchy, so zarr (and object storage) sees nothing it does not know, with a checksum
like every other object."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import zarr

from . import objects
from .location import Location, open_store
from .schema import checked, codecs

INDEXES = "index"  # the group of saved listings (``index/<name>``, uint8): not per-sample arrays
INDEX_CHUNK_BYTES = 16 * 2**20


def write_indexes(group: zarr.Group, indexes: Mapping[str, bytes]) -> None:
    """Each of ``indexes`` (name -> bytes) as ``<group>/<name>``."""
    for name, blob in indexes.items():
        group.create_array(
            name, shape=(len(blob),), chunks=(max(1, min(len(blob), INDEX_CHUNK_BYTES)),), dtype="uint8",
            compressors=checked(codecs("zstd")),
        )[:] = np.frombuffer(blob, dtype=np.uint8)  # fmt: skip


def saved_index(where: str | os.PathLike[str] | Location, name: str, legacy: str | None = None) -> bytes | None:
    """The index ``name`` saved in the store at ``where``, or None. ``legacy``: the key that stores from
    before ``index/<name>`` kept it under (an object inside the hierarchy that zarr warns about). The
    index only saves a rescan, so one that cannot be read is None, and the data is listed again."""
    try:
        group = zarr.open_group(open_store(where, read_only=True), mode="r")
        if f"{INDEXES}/{name}" in group:
            return group[f"{INDEXES}/{name}"][:].tobytes()  # type: ignore[union-attr]
        return objects.read(group.store, legacy) if legacy is not None else None
    except Exception:  # noqa: BLE001 - absent, unreadable or failing its checksum: list the data again
        return None
