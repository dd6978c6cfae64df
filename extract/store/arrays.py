"""A store's arrays by name (layout in DESIGN.md): which hold one row per stored row and are written
with each chunk, which are written whole at creation, their dimension names, and the keys of their
objects. Shared by building a store (``skeleton.py``), opening it (``opening.py``), checking it
(``integrity.py``, ``verify.py``) and the class itself (``store.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import zarr

from ..errors import StoreDamagedError
from ..names import Kind
from ..names.layout import Layout
from . import objects
from .latents import row_arrays as latent_arrays
from .schema import STRINGS

METADATA = "zarr.json"
# (K, A) uint32: row k holds the crc32c of chunk k's object in each per-sample array (format 3). The
# checksum codec goes last, so an object's last 4 bytes are its own crc32c: the digest costs a 4-byte
# read of what was just written, not a second hash of the data.
DIGESTS = "digests"
DIGEST_BYTES = 4
# {array: [crc32c of each object]} of the arrays written whole at creation (``document_arrays``)
DOCUMENT_DIGESTS = "document_digests"
TEXT_ARRAYS = ("offsets",)
TOKEN_ARRAYS = ("token_ids", "special")
PACKED_ARRAYS = ("doc", "doc_position")
TEXT_CHUNK = 2**16  # rows per chunk of the per-document and token-id arrays where they are not row arrays


def dimension_names(layer: str, ndim: int, layout: str | None = None, row: str = "sample") -> tuple[str, ...]:
    """Per-layer dimension names: xarray needs them, and layers differ in size along them. ``row`` names
    the first axis: ``sample`` (images), ``document`` (pooled text) or ``token``."""
    names = Layout(layout).dimension_names if layout else ()
    if len(names) != ndim:
        names = {3: Layout.NCHW.dimension_names, 2: Layout.NLC.dimension_names, 1: ("feature",)}.get(
            ndim, tuple(f"dim{i}" for i in range(ndim))
        )
    if row != "sample" and ndim == 1:  # a text layer's row is one vector of its hidden size
        names = ("channel",)
    return (row, *(f"{layer}.{n}" for n in names))


def row_arrays(
    kind: Kind, layers: Iterable[str], keys: bool = True, packed: bool = False, latents: Iterable[str] = ()
) -> list[str]:
    """The arrays with one row per stored row (chunked like the features, written per chunk), in the
    order of the ``digests`` columns: a token store's rows are tokens, its labels are per document
    (``packed``: per context, and each token has its source document and position), and ``latents``'
    SAE codes (``latents.py``) follow."""
    features = [f"features/{layer}" for layer in layers]
    if kind is Kind.TOKENS:
        return [*features, *TOKEN_ARRAYS, *(PACKED_ARRAYS if packed else ()), *latent_arrays(latents)]
    return [*features, "labels", "valid", *(["keys"] if keys else [])]


def document_arrays(kind: Kind, packed: bool, keys: bool) -> list[str]:
    """The arrays written whole at creation and never per chunk, whose objects' digests the store
    records then (``document_digests``): a token store's per-document arrays; a document store's
    offsets (its labels, valid and keys are row arrays, under the per-chunk digests)."""
    if kind is Kind.TOKENS:
        return ["offsets", "labels", "valid", *(["keys"] if keys else []), *(["source_lengths"] if packed else [])]
    return ["offsets"] if kind is Kind.DOCUMENTS else []


def write_keys_in_blocks(array: zarr.Array, keys: Sequence[str]) -> None:
    """``keys`` into ``array``, one object at a time: a lazy sequence of keys (``KeyList``) is never whole."""
    block = array.chunks[0]
    for start in range(0, len(keys), block):
        array[start : start + block] = np.asarray(keys[start : start + block], dtype=STRINGS)


def chunk_key(array: zarr.Array, chunk: int) -> str:
    """The store key of ``array``'s object for data chunk ``chunk`` (its whole row range)."""
    return f"{array.path}/{array.metadata.encode_chunk_key((chunk, *[0] * (array.ndim - 1)))}"


def object_keys(array: zarr.Array) -> list[str]:
    """The keys of every object of a 1-D ``array``, in order."""
    count = -(-array.shape[0] // array.chunks[0]) if array.shape[0] else 0
    return [f"{array.path}/{array.metadata.encode_chunk_key((i,))}" for i in range(count)]


def undecodable(path: Path | str, name: str, error: Exception) -> StoreDamagedError:
    """The error of node ``name`` of the store at ``path`` whose metadata zarr cannot decode."""
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return StoreDamagedError(
        f"{path}/{name}/{METADATA} does not decode as zarr metadata ({type(error).__name__}: {first}); "
        "rerun the job with --overwrite"
    )


def members(group: zarr.Group, path: Path | str) -> list[tuple[str, zarr.Array]]:
    """Every array of the store at ``path``, by path; metadata that do not decode are named, not a JSON trace."""
    try:
        return [(name, m) for name, m in group.members(max_depth=None) if isinstance(m, zarr.Array)]
    except Exception as e:  # noqa: BLE001 - find the node whose metadata zarr choked on
        for key in sorted(objects.listed(group.store, "")):
            node = key.removesuffix(f"/{METADATA}")
            if key.endswith(f"/{METADATA}"):
                try:
                    group[node]
                except Exception as node_error:  # noqa: BLE001
                    raise undecodable(path, node, node_error) from None
        raise undecodable(path, "", e) from None
