"""Every read of a chunk object checks that it is the object the store recorded for that chunk (issue 45).

When a job marks a chunk done, the store records in ``digests`` the crc32c of the chunk's object in each
per-row array (the checksum codec's 4-byte suffix: ``store/integrity.py``). A torn or flipped object fails
its own checksum; a *misplaced* one (swapped with another chunk's, copied over another, taken from
another store of the same shape, what a botched ``rsync`` or a copy between buckets makes) passes it,
and would be read as the chunk's data. So a read compares the suffix of each object it decodes with the
digest recorded for that chunk:

- on zarr's path, ``PlacedStore`` wraps the array's store: the object is fetched once (one GET on object
  storage), its last 4 bytes compared with the recorded digest, and the same bytes handed to the array's
  codec pipeline, which checks the crc32c and decodes them;
- on the direct path (``direct.py``) the object's crc32c is computed there anyway: the comparison is one
  integer more.

A mismatch raises ``Misplaced``, which the checked reads (``checked.py``) turn into a ``StoreDamagedError``
naming the array, the chunk and the fix. A store written before digests (format 2 and older) has nothing
to compare with, and reads as before. A chunk not marked done (a partial store) has no recorded digest
yet: its objects are checked by their checksums only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import zarr
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import StorePath, WrapperStore

from ..store import checksum
from ..store.arrays import DIGEST_BYTES

# the recorded digest of chunk k of an array: None where there is none to compare with
Recorded = Callable[[int], "int | None"]


class Misplaced(ValueError):
    """Chunk ``chunk``'s object ``key`` ends with crc32c ``found``, not the ``recorded`` digest (None: the
    chunk's digests row is missing or fails its own check, so the object's place cannot be checked)."""

    def __init__(self, key: str, chunk: int, found: int | None, recorded: int | None) -> None:
        self.key, self.chunk, self.found, self.recorded = key, chunk, found, recorded
        super().__init__(self.problem)

    @property
    def problem(self) -> str:
        if self.recorded is None:
            return (
                f"cannot be checked: its digests row (digests/c/{self.chunk}/0) is missing or fails its check, "
                f"so whether {self.key} is its object is unknown"
            )
        found = "none" if self.found is None else f"{self.found:#010x}"
        return (
            f"is not the object the store recorded: {self.key} ends with crc32c {found}, its digest says "
            f"{self.recorded:#010x} (swapped with another chunk's, copied over it, or from another store)"
        )


UNREADABLE = -1  # a done chunk whose digests row cannot be read: any object of it is refused


def suffix_of(data: np.ndarray | memoryview | bytes) -> int:
    """The crc32c suffix of an object's bytes, as the store records it."""
    return int.from_bytes(bytes(data[-DIGEST_BYTES:]), "little")


def check(key: str, chunk: int, found: int | None, recorded: int | None) -> None:
    """Raise ``Misplaced`` unless ``found`` (an object's suffix) is ``recorded`` (None: nothing to check)."""
    if recorded is None:
        return
    if recorded == UNREADABLE:
        raise Misplaced(key, chunk, found, None)
    if found != recorded:
        raise Misplaced(key, chunk, found, recorded)


class PlacedStore(WrapperStore[Store]):
    """``store``, checking each whole object of array ``path`` it returns against ``recorded`` (by chunk)."""

    def __init__(self, store: Store, array: zarr.Array, recorded: Recorded) -> None:
        super().__init__(store)
        self._prefix = f"{array.path}/"
        self._recorded = recorded

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        buffer = await self._store.get(key, prototype, byte_range)
        if buffer is None or byte_range is not None or not key.startswith(self._prefix):
            # absent: zarr's fill value, which the checked read decides about (a lost object); a range is
            # part of an object (a shard's index), whose suffix is not the object's
            return buffer
        name = key[len(self._prefix) :]
        if name == "zarr.json":
            return buffer
        chunk = _first_index(name)
        recorded = self._recorded(chunk)
        if recorded is not None:
            data = buffer.as_numpy_array()
            found = suffix_of(data) if len(data) >= DIGEST_BYTES else None
            if found != recorded and intact(data):
                check(key, chunk, found, recorded)
            # a torn, truncated or flipped object is not another chunk's: zarr's codec says it fails its check
        return buffer


def intact(data: np.ndarray) -> bool:
    """Whether an object's bytes end with the crc32c of the rest (an object some chunk's write made). Only
    for an object whose suffix is not the recorded one: the common read never pays for it."""
    return len(data) >= DIGEST_BYTES and checksum.value(data[:-DIGEST_BYTES]) == suffix_of(data)


def _first_index(name: str) -> int:
    """The row index of a chunk key: ``c/3/0`` or ``c.3.0`` (v3's default encoding), ``3.0`` or ``3/0`` (v2's).
    zarr 3.1's own ``decode_chunk_key`` keeps the separator after the ``c`` and fails on ``c/3/0``."""
    parts = name.replace(".", "/").split("/")
    return int(parts[1] if parts[0] == "c" else parts[0])


def placed(array: zarr.Array, recorded: Recorded) -> zarr.Array:
    """``array`` reading through ``PlacedStore``: the same metadata, codec pipeline and configuration.
    ``zarr.Array(AsyncArray(metadata, store_path, config))`` is zarr's own constructor of an array."""
    store = PlacedStore(array.store, array, recorded)
    return zarr.Array(zarr.AsyncArray(array.metadata, StorePath(store, array.path), array.config))
