"""zarr's ``crc32c`` codec, the same bytes, computed by the ``crc32c`` package.

zarr 3.1's ``Crc32cCodec`` checksums through ``google_crc32c`` (4.5 GB/s here, against 22 for the
``crc32c`` package's hardware path, which releases the GIL) and appends its 4 bytes with ``np.append``,
which flattens, then copies the whole chunk into a fresh array. Writing a chunk paid both; reading one
paid the checksum. ``Crc32cCodec`` here is a subclass with the same name, configuration and metadata
(``{"name": "crc32c"}``): an object it writes is byte for byte the one zarr's would, and each reads
the other's. It is registered in zarr's codec registry and selected through zarr's config
(``codecs.crc32c``), the mechanism zarr gives for a faster implementation of a codec, so every array
opened in this process (written or read, by the store or any reader) uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import zarr
from zarr.codecs import crc32c_
from zarr.registry import register_codec

try:
    from crc32c import crc32c
except ImportError:  # a declared dependency; without it zarr's own codec (google_crc32c) serves, the same bytes
    crc32c = None

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer

CHECKSUM_BYTES = 4


@dataclass(frozen=True)
class Crc32cCodec(crc32c_.Crc32cCodec):
    """zarr's ``crc32c`` codec (a subclass: ``isinstance`` checks against zarr's hold), faster."""

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        data = chunk_bytes.as_numpy_array()
        inner = data[:-CHECKSUM_BYTES]
        stored = bytes(data[-CHECKSUM_BYTES:])
        computed = crc32c(inner).to_bytes(CHECKSUM_BYTES, "little")
        if computed != stored:  # zarr's own message: callers match on it
            raise ValueError(f"Stored and computed checksum do not match. Stored: {stored!r}. Computed: {computed!r}.")
        return chunk_spec.prototype.buffer.from_array_like(inner)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        data = chunk_bytes.as_numpy_array()
        # one copy into the object's final buffer (np.append flattens, then concatenates)
        encoded = np.empty(len(data) + CHECKSUM_BYTES, dtype=np.uint8)
        encoded[: len(data)] = data
        encoded[len(data) :] = np.frombuffer(crc32c(data).to_bytes(CHECKSUM_BYTES, "little"), dtype=np.uint8)
        return chunk_spec.prototype.buffer.from_array_like(encoded)


def value(data: np.ndarray | bytes) -> int:
    """The crc32c of ``data`` as the codec appends it: the ``crc32c`` package's, or zarr's own library's."""
    if crc32c is not None:
        return crc32c(data)
    import google_crc32c

    return google_crc32c.value(bytes(data))


def codec() -> crc32c_.Crc32cCodec:
    """The ``crc32c`` codec a store's arrays are made with: this one, or zarr's without the package (the
    same metadata and bytes)."""
    return Crc32cCodec() if crc32c is not None else crc32c_.Crc32cCodec()


QUALNAME = f"{Crc32cCodec.__module__}.{Crc32cCodec.__qualname__}"


def install() -> None:
    """Register this ``crc32c`` implementation and make zarr select it (idempotent); without the ``crc32c``
    package, zarr's own implementation stays selected."""
    if crc32c is None:
        return
    register_codec("crc32c", Crc32cCodec, qualname=QUALNAME)
    if zarr.config.get("codecs.crc32c", None) != QUALNAME:
        zarr.config.set({"codecs.crc32c": QUALNAME})


install()
