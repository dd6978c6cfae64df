"""The zarr v3 store a job writes (layout in DESIGN.md): created by rank 0, written chunk-wise by all.

``FeatureStore`` is the open store: its attributes, its arrays and the writing of a chunk. Its other
concerns live beside it: where a store is made (``paths.py``), its skeleton (``skeleton.py``), creating
and opening it on disk and on object storage (``opening.py``), its objects' integrity
(``integrity.py``, ``store.integrity``), the arrays written whole at creation (``text_arrays.py``,
``store.creation``) and saved listings (``indexes.py``). Once open, done flags, deletion, sizes and
listings go through zarr's store API, never through paths on disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from ..names import Kind
from . import (
    checksum,  # noqa: F401 - zarr reads and writes crc32c through the faster codec once a store is used
    dtypes,
    latents,
    objects,
    opening,
    stats,
)
from .arrays import DIGEST_BYTES, DIGESTS, METADATA, chunk_key, members, row_arrays, undecodable
from .chunks import Plan
from .fence import ROOT_METADATA, lost_lock, writer_of
from .indexes import INDEXES
from .integrity import Integrity
from .location import Location, locate, storage_errors
from .skeleton import Skeleton
from .stats import STATS
from .text_arrays import CreationArrays, TextArrays


class FeatureStore:
    """``features/<layer>``, ``labels`` and ``done`` in one zarr group, plus the job's attributes."""

    def __init__(self, group: zarr.Group, path: str | os.PathLike[str] | Location, writer: str | None = None) -> None:
        self.group = group
        self.location = locate(path)
        self.path: Path | str = self.location.place  # how messages name the store
        self.writer = writer  # the job's token: every write is refused once the store's ``writer`` is not it
        self.opened: dict[str, zarr.Array] = {}  # the arrays opened so far (``array``), by name
        self.integrity = Integrity(self)
        self.creation = CreationArrays(self)
        self._stats_layers: list[str] | None = None
        self._stats_looked = False

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | Location,
        *,
        shapes: Mapping[str, tuple[int, ...]],
        num_samples: int,
        chunk_size: int,
        dtype: str,
        compressor: str,
        attrs: dict[str, Any],
        overwrite: bool = False,
        layouts: Mapping[str, str | None] | None = None,
        keys: Sequence[str] | None = None,
        indexes: Mapping[str, bytes] | None = None,
        kind: Kind = Kind.IMAGES,
        text: TextArrays | None = None,
        latents: Mapping[str, dict[str, Any]] | None = None,
    ) -> FeatureStore:
        """Build the store beside ``path`` and rename it into place: a kill or a full disk at any instant
        leaves either no store or the whole skeleton. ``overwrite`` first moves the old store aside
        (one rename), then deletes it: an interrupted overwrite leaves the old store or nothing.
        ``latents``: each ``--sae`` layer's SAE as ``latents/<layer>`` records it (``latents.py``). On
        object storage the skeleton's root metadata are written last (``opening.py``).
        ``indexes`` are saved listings (name -> bytes) kept in the skeleton for a resume (the shard index)."""
        skeleton = Skeleton(
            dict(shapes), num_samples, chunk_size, dtype, compressor, dict(layouts or {}), keys, dict(indexes or {}),
            Kind(kind), text, dict(latents) if latents else None,
        )  # fmt: skip
        location = locate(path)
        opening.create(location, skeleton, attrs, overwrite)
        return cls.open(location)

    @classmethod
    def open(cls, path: str | os.PathLike[str] | Location, mode: str = "r+", writer: str | None = None) -> FeatureStore:
        """Open and validate: a known format version, every array there, shapes that agree with
        ``num_samples`` and the chunk size. Metadata that disagree are an error, never believed.
        ``writer``: the job's lock token, which the store's ``writer`` must be for any write to happen
        (``fence.py``); set it with ``claim`` first. ``path`` may be a URL on object storage
        (``s3://...``), where an outage past the retries is an ``ObjectStorageError`` naming the request."""
        location = locate(path)
        with storage_errors(location):
            group, attrs = opening.open_group(location, mode, writer)
            store = cls(group, location, writer)
            opening.validate(store, attrs)
        return store

    def claim(self, token: str) -> None:
        """Make ``token`` (a lock's) the store's ``writer``: the previous writer's writes are refused from
        now on. Only the lock's holder calls this, before any chunk is written."""
        self.update_attrs(writer=token)

    def check_writer(self, token: str | None = None) -> None:
        """Raise ``LockLostError`` unless the store's ``writer``, read afresh, is ``token`` (default: ours)."""
        if writer_of(objects.read(self.group.store, ROOT_METADATA)) != (token or self.writer):
            raise lost_lock(self.location)

    @property
    def kind(self) -> Kind:
        """``images``, ``documents`` (text pooled per document) or ``tokens`` (one row per token)."""
        return Kind.of(self.attrs)

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def update_attrs(self, **values: Any) -> None:
        self.group.attrs.update(values)

    @property
    def plan(self) -> Plan:
        return Plan(self.attrs["num_samples"], self.attrs["chunk_size"])

    def array(self, name: str) -> zarr.Array:
        """Array ``name``; ``KeyError`` when there is none, ``StoreDamagedError`` when its metadata are garbage."""
        if name not in self.opened:
            try:
                array = self.group[name]
            except Exception as e:  # noqa: BLE001 - absent, or metadata that zarr cannot decode
                if not self.has(name):
                    raise KeyError(name) from None
                raise undecodable(self.path, name, e) from None
            if not isinstance(array, zarr.Array):
                raise KeyError(name)
            # Every chunk written here is real data: skip zarr's scan of each chunk for "all fill value"
            # (write_empty_chunks=False), which costs as much CPU as zstd-1 encoding it (benchmarks/RESULTS.md).
            self.opened[name] = array.with_config({"write_empty_chunks": True})
        return self.opened[name]

    def has(self, name: str) -> bool:
        """Whether node ``name`` has metadata (decodable or not): one existence check, no decoding."""
        return objects.read(self.group.store, f"{name}/{METADATA}") is not None

    def sample_arrays(self) -> Iterator[tuple[str, zarr.Array]]:
        """Every per-sample array (features, labels, valid and any other with N rows), by path."""
        attrs = self.attrs
        n, kind = attrs["num_samples"], Kind.of(attrs)
        packed, codes = attrs.get("pack") is not None, latents.layers_of(attrs)
        rows = set(row_arrays(kind, attrs.get("layers", []), packed=packed, latents=codes))
        for name, member in members(self.group, self.path):
            if kind.text:
                if name in rows:
                    yield name, self.array(name)
            elif name not in ("done", DIGESTS) and member.shape[:1] == (n,):
                # a saved index of N bytes is no sample array, nor statistics of N chunks of one sample
                if not name.startswith((f"{INDEXES}/", f"{STATS}/")):
                    yield name, self.array(name)

    def chunk_arrays(self) -> list[tuple[str, zarr.Array]]:
        """The arrays written per chunk with one row per chunk (``stats/<layer>``, ``stats/latents/<layer>``),
        by path."""
        paths = [f"{STATS}/{layer}" for layer in self.stats_layers() or []]
        paths += [latents.stats_path(layer) for layer in latents.layers_of(self.attrs)]
        return [(path, self.array(path)) for path in paths]

    def stats_layers(self) -> list[str] | None:
        """The layers that have ``stats/<layer>`` (as the ``stats`` group lists them; in a store from before
        the list, those stored as 1-D rows, ``stats.py``); None for a store written before stores kept
        statistics (it has no ``stats`` group)."""
        if not self._stats_looked:  # asked once per chunk written: look once
            self._stats_looked = True
            if self.has(STATS):
                listed = self.group[STATS].attrs.get("layers")
                layers = self.attrs.get("layers", [])
                self._stats_layers = [
                    layer
                    for layer in layers
                    if (layer in listed if listed is not None else len(self.array(f"features/{layer}").shape) == 2)
                ]
        return None if self._stats_layers is None else list(self._stats_layers)

    def stats_axes(self) -> dict[str, int | None]:
        """Each layer with statistics and its rows' channel axis (None: each sample's flattened row), as a
        device that computes them (``HostStaging``'s ``stats``) needs them."""
        return {layer: self.array(f"{STATS}/{layer}").attrs.get("channel_axis") for layer in self.stats_layers() or []}

    def done_flags(self) -> np.ndarray:
        """``done`` as (K,) bool; a ``done`` object that fails its checksum counts as not done."""
        done = self.array("done")
        try:
            return done[:]
        except ValueError:
            flags = np.zeros(done.shape, dtype=bool)
            for k in range(len(flags)):
                try:
                    flags[k] = done[k]
                except ValueError:
                    pass
            return flags

    def pending_chunks(self) -> list[int]:
        return np.flatnonzero(~self.done_flags()).tolist()

    def write_chunk(
        self,
        chunk: int,
        start: int,
        stop: int,
        features: Mapping[str, np.ndarray],
        labels: np.ndarray | None,
        valid: np.ndarray | None,
        columns: Mapping[str, np.ndarray] | None = None,
        codes: Mapping[str, latents.ChunkCodes] | None = None,
        partials: Mapping[str, stats.Partial] | None = None,
    ) -> dict[str, int]:
        """Write one whole chunk of every array and its layers' statistics (``stats.py``), record its
        objects' digests, then mark it done: a crash before the mark redoes it. Text stores pass no
        labels or valid: theirs were written at creation; a token store passes its token rows'
        ``columns`` (``token_ids``, ``special``...) and its ``--sae`` layers' ``codes`` (``latents.py``).
        ``partials``: statistics of blocks of a layer's rows computed on the device (the same bits; ``stats.py``).
        Returns the ±inf values of each layer with statistics (which count them)."""
        # Every write of the chunk in one coroutine on one loop (objects.run): each array's own
        # ``array[a:b] = v`` is a round trip through zarr's loop, ~1 ms of CPU whatever its size, and a
        # chunk has five to eight of them. The digests are read once the objects are written, ``done`` last.
        writes: list[tuple[zarr.Array, int | slice, Any]] = [
            (self.array(name), slice(start, stop), values) for name, values in (columns or {}).items()
        ]
        infinite = {}
        for layer, values in features.items():
            array = self.array(f"features/{layer}")
            writes.append((array, slice(start, stop), values))
            if layer in (self.stats_layers() or ()):  # of the values as stored: after the cast to its dtype
                rows = self.array(f"{STATS}/{layer}")
                stored = np.asarray(values, dtype=array.dtype)  # bfloat16: its bits, as given
                partial = (partials or {}).get(layer)
                row = stats.chunk_row(stored, rows.attrs.get("channel_axis"), dtypes.is_bfloat16(array), partial)
                writes.append((rows, chunk, row))
                infinite[layer] = stats.infinite(row, stored)
        if labels is not None:
            writes.append((self.array("labels"), slice(start, stop), labels))
        if valid is not None:
            writes.append((self.array("valid"), slice(start, stop), valid))
        if codes:
            latents.write_chunk(self, chunk, start, stop, codes)
        digests = self.integrity.digests_array()
        keys = [chunk_key(self.array(name), chunk) for name in digests.attrs["arrays"]] if digests is not None else []
        done, store = self.array("done"), self.group.store

        async def write() -> None:
            await objects.all_of(array.async_array.setitem(at, values) for array, at, values in writes)
            if digests is not None:
                found = await objects.tails(store, keys, DIGEST_BYTES)
                row = np.array([0 if t is None else int.from_bytes(t, "little") for t in found], dtype=np.uint32)
                await digests.async_array.setitem(chunk, row)
            await done.async_array.setitem(chunk, True)

        objects.run(write())
        return infinite

    def stored_bytes(self) -> int:
        """The bytes under ``features/``: every layer's objects and metadata, and the group's own. (zarr's
        ``Array.nbytes_stored`` summed over the layers would leave out the group's metadata.)"""
        return objects.size(self.group.store, "features/")
