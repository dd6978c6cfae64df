"""Whole chunks of an uncompressed layer on local disk read straight into the caller's buffer, their
checksums verified in place: what zarr would return, at the disk's speed.

A layer written with ``--compressor none`` has the codec chain ``bytes`` (little-endian) + ``crc32c``: each
chunk's object is the chunk's rows in C order, padded to the full chunk shape at the array's end, then
the crc32c of those bytes, 4 bytes little-endian (zarr's ``Crc32cCodec``). zarr reads the object into a
fresh buffer, checks it, and copies the rows out; here the object is mapped (``mmap``), its checksum
computed over the mapping, in the page cache, with the hardware-accelerated ``crc32c`` package (22 GB/s
here against 4.5 for ``google_crc32c``, which zarr uses; ``benchmarks/token_stream.py``), and its rows
copied from there into the caller's: one copy, as from a numpy memmap.

The object's size is checked before it is mapped. An object truncated while it is mapped would end the
process with SIGBUS, as for any memmap; the readers take only complete stores, which nothing rewrites.

Anything else is left to zarr (and everything, where the ``crc32c`` package is missing: see its import): another codec (a compressor, sharding, a transpose), another store (object
storage, a wrapper), chunks that split a row, big-endian bytes, a destination that is not one contiguous
block, or an object that is absent (zarr reads it as the fill value; the checked read decides whether
that is damage). A checksum that does not match raises ``ChecksumMismatch``, a ``ValueError`` as zarr's
codec raises: ``CheckedReads.checked`` then names the chunk, as for a zarr read.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.storage import LocalStore

from .placed import check

try:  # hardware crc32c (SSE4.2 / ARMv8), releases the GIL on large buffers
    from crc32c import crc32c as _crc32c
except ImportError:  # a broken install (it is a dependency): zarr reads every chunk, as it did before
    _crc32c = None
# No fallback to ``google_crc32c`` (zarr's own): its C extension takes only read-only ``bytes``-like objects,
# not a slice of a mapping (TypeError; its pure-Python build kept the slice exported, and closing the mapping
# raised BufferError: issue 47), so it would need a copy of every object first, which is zarr's read: the
# same cost, zarr's code. Without the package the direct read stands aside (``direct_chunks``: None).


def _extend(crc: int, data: memoryview) -> int:
    return _crc32c(data, crc)  # type: ignore[misc] - only called when the package is there


CHECKSUM_BYTES = 4


class ChecksumMismatch(ValueError):
    """An object's bytes do not match its stored crc32c, or it is not the size its chunk must be."""


@dataclass(frozen=True)
class DirectChunks:
    """The chunk objects of a 1-row-chunked, uncompressed, checksummed zarr v3 array in a local folder."""

    array: zarr.Array
    folder: Path  # the array's folder
    chunk_rows: int
    row_bytes: int
    # the array's geometry, read once: zarr's properties rebuild them from its metadata at every call
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    def object_path(self, chunk: int) -> Path:
        key = self.array.metadata.encode_chunk_key((chunk, *(0,) * (self.array.ndim - 1)))
        return self.folder / key

    def key(self, chunk: int) -> str:
        """The store key of chunk ``chunk``'s object, as messages name it."""
        return f"{self.array.path}/{self.array.metadata.encode_chunk_key((chunk, *(0,) * (self.array.ndim - 1)))}"

    def read(
        self, chunk: int, into: np.ndarray, fallback: Callable[[], np.ndarray], recorded: int | None = None
    ) -> np.ndarray:
        """Chunk ``chunk``'s rows into the first rows of ``into`` (C-contiguous, the array's dtype and row
        shape) and return them; ``fallback()`` (zarr's read) when the object is absent or ``into`` does not
        fit. Raises ``ChecksumMismatch`` for an object that fails its checksum or has the wrong size, and
        ``Misplaced`` for one whose crc32c is not ``recorded``, the digest the store recorded for the chunk
        (None: nothing to compare with)."""
        start = chunk * self.chunk_rows
        rows = min(self.chunk_rows, self.shape[0] - start)
        target = into[:rows]
        if not _fits(target, self.dtype, self.shape):
            return fallback()
        path = self.object_path(chunk)
        try:
            file = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return fallback()
        expected = self.chunk_bytes + CHECKSUM_BYTES
        try:
            if os.fstat(file).st_size != expected:
                raise ChecksumMismatch(f"{path} is not {expected} bytes long")
            # mapped, not read: the copy reads the page cache where it lies, which costs 0.15 CPU-s/GB here
            # against 0.23 for readinto's kernel copy and then the checksum (benchmarks/token_stream.py --direct)
            with mmap.mmap(file, expected, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as data:
                rows_bytes = target.reshape(-1).view(np.uint8)
                rows_bytes[:] = np.frombuffer(data, np.uint8, count=rows_bytes.size)
                # the checksum of the copy, not of the mapping: the copy's bytes are still in the CPU's cache
                # (0.12 CPU-s/GB for map + copy + crc against 0.15 the other way round), and they are the
                # bytes the caller gets; the padding of a last chunk is only in the mapping
                crc = _extend(0, memoryview(rows_bytes))
                if rows_bytes.size < self.chunk_bytes:
                    with data[rows_bytes.size : self.chunk_bytes] as padding:
                        crc = _extend(crc, padding)
                stored = int.from_bytes(data[self.chunk_bytes :], "little")
            if stored != crc:
                raise ChecksumMismatch(f"stored crc32c {stored:#010x}, computed {crc:#010x}")
            check(self.key(chunk), chunk, crc, recorded)  # its place: the crc computed anyway
        finally:
            os.close(file)
        return target


def direct_chunks(array: zarr.Array) -> DirectChunks | None:
    """``array``'s direct reader, or None when zarr must read it (see the module's docstring)."""
    metadata = array.metadata
    if _crc32c is None:  # see the import
        return None
    if getattr(metadata, "zarr_format", None) != 3 or not isinstance(array.store, LocalStore):
        return None
    codecs = tuple(metadata.codecs)
    if len(codecs) != 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], Crc32cCodec):
        return None
    dtype = np.dtype(array.dtype)
    little = codecs[0].endian is None or codecs[0].endian.value == "little"
    if dtype.hasobject or dtype.kind not in "biuf" or (dtype.itemsize > 1 and not little) or sys.byteorder != "little":
        return None
    if array.ndim < 1 or tuple(array.chunks[1:]) != tuple(array.shape[1:]):
        return None
    row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * dtype.itemsize
    folder = Path(array.store.root) / array.path
    return DirectChunks(array, folder, int(array.chunks[0]), row_bytes, dtype, tuple(array.shape))


def _fits(target: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    return (
        target.flags.c_contiguous
        and target.dtype == dtype
        and target.shape[1:] == shape[1:]
        and target.dtype.byteorder in "=|<"
    )
