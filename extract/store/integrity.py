"""What a store's objects say about themselves: which chunks have an object in an array, the digests
(crc32c suffixes) of objects, done chunks whose objects were lost, and the undoing of ``done``.

Every object carries a crc32c checksum (zarr's ``Crc32cCodec`` after compression), so a torn, truncated
or garbage object fails to decode instead of being read as data; its last 4 bytes are its checksum,
which the store records as the object's digest (``digests``) when it marks the chunk done. All of it
goes through zarr's store API (``objects.py``), never through paths on disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.codecs import Crc32cCodec

from . import objects
from .arrays import DIGEST_BYTES, DIGESTS, METADATA, chunk_key, object_keys

if TYPE_CHECKING:  # the store makes its integrity, and imports this module
    from .store import FeatureStore


def decodes(array: zarr.Array, start: int, stop: int) -> bool:
    """Whether rows ``start:stop`` of ``array`` read back: a damaged object fails its codec's check."""
    try:
        array[start:stop]
    except Exception:  # noqa: BLE001 - any codec error means the object is damaged
        return False
    return True


def digests_of(group: zarr.Group, names: Sequence[str]) -> dict[str, list[int | None]]:
    """Each array's objects' crc32c (the 4-byte suffix the checksum codec appends), None where absent."""
    found = {}
    for name in names:
        keys = object_keys(group[name])  # type: ignore[arg-type]
        tails = objects.suffixes(group.store, keys, DIGEST_BYTES)
        found[name] = [None if t is None else int.from_bytes(t, "little") for t in tails]
    return found


class Integrity:
    """``store.integrity``: the objects of the store's chunks (present, lost, their digests), and the
    undoing of ``done`` for chunks whose objects were lost or damaged."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store
        self._chunk_of_key: dict[str, dict[str, int]] = {}
        self._has_digests: bool | None = None

    def stored_chunks(self, name: str, chunks: Iterable[int]) -> set[int]:
        """Which of ``chunks`` have an object in array ``name``: one listing of the array's keys. A 1-D
        array's objects share one parent (``done/c/<k>``), listed as one directory: ten times cheaper than
        a recursive listing on disk, which the progress bar pays every half second."""
        store = self.store
        array, wanted = store.array(name), set(chunks)
        if name not in self._chunk_of_key:  # encoding every key costs more than the listing: once per array
            every = range(store.plan.num_chunks)
            self._chunk_of_key[name] = {chunk_key(array, k): k for k in every}
        chunk_of_key = self._chunk_of_key[name]
        if array.ndim == 1:
            parent = chunk_key(array, 0).rpartition("/")[0]
            listed = {f"{parent}/{child}" for child in objects.children(store.group.store, parent)}
        else:
            listed = objects.listed(store.group.store, f"{array.path}/")
        return {chunk_of_key[key] for key in listed if key in chunk_of_key} & wanted

    def missing_objects(self, chunks: list[int] | None = None) -> dict[int, list[str]]:
        """The cheap check: for each done chunk (or each of ``chunks``), the arrays whose object is absent.
        Every chunk written is stored (write_empty_chunks), so an absent one was lost."""
        store = self.store
        chunks = np.flatnonzero(store.done_flags()).tolist() if chunks is None else chunks
        missing: dict[int, list[str]] = {}
        for name, _ in [*store.sample_arrays(), *store.chunk_arrays()]:
            stored = self.stored_chunks(name, chunks)
            for k in chunks:
                if k not in stored:
                    missing.setdefault(k, []).append(name)
        return missing

    def clear_done(self, chunks: list[int]) -> None:
        """Mark ``chunks`` not done (their objects were lost or damaged): a rerun recomputes exactly those.
        The flags' objects are deleted: an absent ``done`` object reads as False, and the progress bar
        and ``verify`` count the objects present."""
        store = self.store
        done, rows = store.array("done"), self.digests_array()
        digest_rows = [chunk_key(rows, k) for k in chunks] if rows is not None else []
        objects.delete(store.group.store, [chunk_key(done, k) for k in chunks] + digest_rows)
        if chunks and store.attrs.get("status") == "complete":
            store.update_attrs(status="running")

    def digests_array(self) -> zarr.Array | None:
        """``digests`` (format 3), or None for a store written before it (format 2 and older)."""
        if self._has_digests is None:  # asked once per chunk written: look once
            self._has_digests = self.store.has(DIGESTS)
        return self.store.array(DIGESTS) if self._has_digests else None

    def object_digests(self, chunks: Sequence[int], names: Sequence[str]) -> dict[int, list[int | None]]:
        """Per chunk, the digest (the crc32c suffix) of its object in each array ``names``, read now; None
        for an object absent or too short to hold one. One concurrent batch of 4-byte reads."""
        keys = [chunk_key(self.store.array(name), k) for k in chunks for name in names]
        tails = iter(objects.suffixes(self.store.group.store, keys, DIGEST_BYTES))
        return {k: [None if (t := next(tails)) is None else int.from_bytes(t, "little") for _ in names] for k in chunks}

    def restore_checksum(self, name: str) -> None:
        """Put the checksum back last in array ``name``'s codec chain, as ``schema.checked`` builds it (its
        objects were written with it; the metadata lost it). Written through zarr's own metadata model."""
        array = self.store.array(name)
        meta = array.metadata.to_dict()
        meta["codecs"] = [*(c for c in meta["codecs"] if c.get("name") != "crc32c"), Crc32cCodec().to_dict()]
        document = type(array.metadata).from_dict(meta).to_buffer_dict(default_buffer_prototype())[METADATA]
        objects.write(self.store.group.store, f"{array.path}/{METADATA}", document.to_bytes())
        self.store.opened.pop(name, None)  # its metadata changed: open it afresh
