"""The arrays a store writes whole at its creation, never per chunk: a text store's per-document arrays
(``TextArrays``: offsets, labels, valid, packed source lengths) and the keys. Their objects' digests
are recorded at creation (``document_digests``), so that an edit, a swap or a loss is found, and a
resume writes them again from the data (``CreationArrays.rewrite``) rather than trusting them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .arrays import DOCUMENT_DIGESTS, write_keys_in_blocks
from .integrity import decodes, digests_of
from .schema import STRINGS

if TYPE_CHECKING:  # the store makes its creation arrays, and imports this module
    from .store import FeatureStore


@dataclass(frozen=True)
class TextArrays:
    """A text store's per-document arrays, written whole at creation (a token store's token rows are
    written by each chunk's owner, with the chunk): document i is rows ``offsets[i]:offsets[i+1]`` of
    a token store, and has tokens ``offsets[i]:offsets[i+1]`` in a document store."""

    offsets: np.ndarray  # (N_docs + 1,) int64
    labels: np.ndarray  # (N_docs,) int64
    valid: np.ndarray  # (N_docs,) bool
    # packed (--pack): the documents are contexts; each source document's content tokens, from which
    # every context's place in the stream of documents follows (a resume tokenizes nothing to plan)
    source_lengths: np.ndarray | None = None  # (N_source_docs,) int64

    @property
    def packed(self) -> bool:
        return self.source_lengths is not None

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


class CreationArrays:
    """``store.creation``: the arrays written whole at the store's creation, checked against the digests
    recorded then, read back, and written again."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def damage(self) -> list[str]:
        """The arrays written whole at creation (``document_arrays``) whose objects are not the ones
        written then: edited (even through zarr, with a valid checksum), swapped, torn or lost: each
        object's checksum against the digest recorded at creation, and against its contents (these
        arrays hold a few bytes per document)."""
        store = self.store
        recorded = store.attrs.get(DOCUMENT_DIGESTS)
        if not isinstance(recorded, dict):
            return []  # a store from before the digests: nothing to check against
        damaged = []
        for name, digests in recorded.items():
            try:
                now = digests_of(store.group, [name])[name]
            except Exception:  # noqa: BLE001 - its metadata are gone or garbage
                damaged.append(name)
                continue
            if now != digests or not decodes(store.array(name), 0, store.array(name).shape[0]):
                damaged.append(name)  # swapped or edited (another digest), or torn (fails its own checksum)
        return damaged

    def text_arrays(self) -> TextArrays:
        """The per-document arrays as written at creation (check ``damage`` first)."""
        store = self.store
        source = store.array("source_lengths")[:] if store.has("source_lengths") else None
        return TextArrays(store.array("offsets")[:], store.array("labels")[:], store.array("valid")[:], source)

    def rewrite(self, text: TextArrays, keys: Sequence[str] | None, names: Sequence[str]) -> None:
        """Write the arrays ``names`` (of ``document_arrays``) again, whole, from ``text`` and ``keys``
        (the same values and codecs give the same objects as at creation)."""
        store = self.store
        values = {
            "offsets": text.offsets,
            "labels": text.labels,
            "valid": text.valid,
            "source_lengths": text.source_lengths,
        }
        for name in names:
            array = store.array(name)
            if name == "keys":
                assert keys is not None
                write_keys_in_blocks(array, keys)
            else:
                array[:] = np.asarray(values[name]).astype(array.dtype)
        recorded = dict(store.attrs.get(DOCUMENT_DIGESTS) or {})
        recorded.update(digests_of(store.group, list(names)))
        store.update_attrs(**{DOCUMENT_DIGESTS: recorded})

    def rewrite_keys(self, chunks: list[int], keys: Sequence[str]) -> None:
        """Rewrite the keys of ``chunks`` (about to be recomputed): ``verify --repair`` clears the chunks
        whose keys object was lost or damaged, and the keys are otherwise only written at creation."""
        store = self.store
        if not store.has("keys"):
            return
        array, size = store.array("keys"), store.attrs["chunk_size"]
        for k in chunks:
            start, stop = k * size, min((k + 1) * size, array.shape[0])
            array[start:stop] = np.asarray(keys[start:stop], dtype=STRINGS)
