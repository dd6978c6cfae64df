"""A new store's skeleton (layout in DESIGN.md): the arrays of each of the three kinds, all empty but
those written whole at creation (the keys, a text store's per-document arrays, the saved indexes),
and the attributes opening checks them against. ``FeatureStore.create`` builds it beside the store's
path and renames it into place, or on object storage writes it with its root metadata last."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec

from ..names import Kind
from . import dtypes, latents, stats
from .arrays import (
    DIGESTS,
    DOCUMENT_DIGESTS,
    TEXT_CHUNK,
    dimension_names,
    document_arrays,
    row_arrays,
    write_keys_in_blocks,
)
from .chunks import Plan
from .indexes import INDEXES, write_indexes
from .integrity import digests_of
from .schema import FORMAT, FORMAT_VERSION, STRINGS, checked, codecs, identity_digests
from .stats import STATS
from .text_arrays import TextArrays


@dataclass(frozen=True)
class Skeleton:
    """The arrays of a new store, all empty but ``keys`` and the saved indexes (written whole)."""

    shapes: dict[str, tuple[int, ...]]
    num_samples: int
    chunk_size: int
    dtype: str
    compressor: str
    layouts: dict[str, str | None]
    keys: Sequence[str] | None
    indexes: dict[str, bytes]
    kind: Kind = Kind.IMAGES
    text: TextArrays | None = None
    latents: dict[str, dict[str, Any]] | None = None  # --sae: each layer's SAE as its group records it (``latents.py``)

    def build(self, path: Path | zarr.abc.store.Store, attrs: dict[str, Any]) -> None:
        group = zarr.open_group(
            path,
            mode="w",
            attributes={
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                # what opening validates the arrays against, also for callers that pass fewer attributes
                "num_samples": self.num_samples,
                "chunk_size": self.chunk_size,
                "layers": list(self.shapes),
                "kind": self.kind,
                **({latents.ATTRIBUTE: self.latents} if self.latents else {}),
                **attrs,
            },
        )
        self._features(group.create_group("features"))
        if self.text is None:
            self._per_sample(group)
        else:
            self._text(group, self.text)
        num_chunks = Plan(self.num_samples, self.chunk_size).num_chunks
        group.create_array(
            "done", shape=(num_chunks,), chunks=(1,), dtype="bool",
            fill_value=False, compressors=[Crc32cCodec()], dimension_names=("chunk",),
        )  # fmt: skip
        packed = self.text is not None and self.text.packed
        codes = dict(self.latents or {})
        columns = row_arrays(self.kind, self.shapes, keys=self.keys is not None, packed=packed, latents=codes)
        columns += self._stats(group, num_chunks)
        columns += latents.create(group, codes, self.num_samples, self.chunk_size)
        group.create_array(
            DIGESTS, shape=(num_chunks, len(columns)), chunks=(1, len(columns)), dtype="uint32", fill_value=0,
            compressors=[Crc32cCodec()], dimension_names=("chunk", "array"), attributes={"arrays": columns},
        )  # fmt: skip
        if self.indexes:
            write_indexes(group.create_group(INDEXES), self.indexes)
        arrays = [name for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)]
        group.attrs.update({"identity_sha256": identity_digests(dict(group.attrs), arrays)})

    def _features(self, features: zarr.Group) -> None:
        for layer, shape in self.shapes.items():
            features.create_array(
                layer,
                shape=(self.num_samples, *shape),
                chunks=(self.chunk_size, *shape),
                dtype=dtypes.zarr_dtype(self.dtype),  # bfloat16: its bits (``dtypes.py``)
                fill_value=dtypes.fill_value(self.dtype),
                attributes=dtypes.attributes(self.dtype),
                compressors=checked(codecs(self.compressor)),
                dimension_names=dimension_names(layer, len(shape), self.layouts.get(layer), self.kind.row),
            )

    def _stats(self, root: zarr.Group, num_chunks: int) -> list[str]:
        """The ``stats`` group (stores from before it have none), with ``stats/<layer>`` for each layer
        stored as 1-D rows or, per position, in a known layout (``stats.py``): one row per chunk, one object
        each, written with the chunk. The group's ``layers`` lists them (stores from before per-position
        statistics list none: theirs are the 1-D layers). Returns their paths, for the digests' columns."""
        layers = [layer for layer, shape in self.shapes.items() if stats.has_stats(shape, self.layouts.get(layer))]
        group, paths = root.create_group(STATS, attributes={"layers": layers}), []
        for layer in layers:
            shape, layout = self.shapes[layer], self.layouts.get(layer)
            features = stats.row_features(shape, layout)
            width = stats.width(features)
            group.create_array(
                layer, shape=(num_chunks, width), chunks=(1, width), dtype="float64", fill_value=np.nan,
                compressors=checked(codecs("zstd")), dimension_names=("chunk", f"{layer}.statistic"),
                attributes={
                    "columns": stats.columns(features), "shape": [features],
                    "channel_axis": stats.channel_axis(shape, layout),
                },
            )  # fmt: skip
            paths.append(f"{STATS}/{layer}")
        return paths

    def _per_sample(self, group: zarr.Group) -> None:
        n, c = self.num_samples, self.chunk_size
        group.create_array(
            "labels", shape=(n,), chunks=(c,), dtype="int64", fill_value=-1,
            compressors=checked(codecs("zstd")), dimension_names=("sample",),
        )  # fmt: skip
        group.create_array(
            "valid", shape=(n,), chunks=(c,), dtype="bool", fill_value=False,
            compressors=checked(codecs("zstd")), dimension_names=("sample",),
        )  # fmt: skip
        if self.keys is not None:  # where each row came from: written whole at creation, chunked like the data
            group.create_array(
                "keys", shape=(n,), chunks=(c,), dtype=str,
                compressors=checked(codecs("zstd")), dimension_names=("sample",),
            )[:] = np.asarray(self.keys, dtype=STRINGS)  # fmt: skip

    def _text(self, group: zarr.Group, text: TextArrays) -> None:
        """A text store's arrays. The per-document ones are written whole here, chunked by ``TEXT_CHUNK``
        in a token store (by the features' chunks in a document store, where rows are documents). A
        token store's token rows (``token_ids``, ``special``; packed: ``doc``, ``doc_position``) are
        chunked like the features and left empty: each chunk's owner writes them with the chunk. A
        document store keeps its documents' lengths (``offsets``), not their token ids."""
        tokens = self.kind is Kind.TOKENS
        zstd = checked(codecs("zstd"))

        def whole(name: str, values: np.ndarray, dimension: str, rows: bool, **options: Any) -> None:
            # A row array has the features' chunks however few its rows (opening checks it); another is
            # cut to its length, since zarr stores an edge chunk padded to the whole chunk's shape.
            chunk = self.chunk_size if rows else max(1, min(TEXT_CHUNK, len(values)))
            group.create_array(
                name, shape=values.shape, chunks=(chunk,), dtype=options.pop("dtype", values.dtype),
                compressors=zstd, dimension_names=(dimension,), config={"write_empty_chunks": True}, **options,
            )[:] = values  # fmt: skip

        whole("offsets", text.offsets.astype(np.int64), "document_edge", rows=False)
        if tokens:
            columns = {"token_ids": ("int32", 0), "special": ("bool", False)}
            if text.packed:
                columns.update(doc=("int32", -1), doc_position=("int32", -1))
            for name, (dtype, fill) in columns.items():
                group.create_array(
                    name, shape=(text.num_tokens,), chunks=(self.chunk_size,), dtype=dtype, fill_value=fill,
                    compressors=zstd, dimension_names=("token",),
                )  # fmt: skip
        if text.source_lengths is not None:
            whole("source_lengths", text.source_lengths.astype(np.int64), "source_document", rows=False)
        whole("labels", text.labels.astype(np.int64), "document", rows=not tokens)
        whole("valid", text.valid.astype(bool), "document", rows=not tokens)
        if self.keys is not None:  # packed: the source documents' keys, which ``doc`` indexes
            keys_dimension = "source_document" if text.packed else "document"
            chunk = self.chunk_size if not tokens else max(1, min(TEXT_CHUNK, len(self.keys)))
            keys = group.create_array(
                "keys", shape=(len(self.keys),), chunks=(chunk,), dtype=str, compressors=zstd,
                dimension_names=(keys_dimension,), config={"write_empty_chunks": True},
            )  # fmt: skip
            write_keys_in_blocks(keys, self.keys)
        names = document_arrays(self.kind, text.packed, self.keys is not None)
        group.attrs.update({DOCUMENT_DIGESTS: digests_of(group, names)})
