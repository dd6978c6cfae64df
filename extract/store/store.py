"""The zarr v3 store a job writes (layout in DESIGN.md): created by rank 0, written chunk-wise by all.

Every object carries a crc32c checksum (zarr's ``Crc32cCodec`` after compression), so a torn, truncated
or garbage object fails to decode instead of being read as data. The store is built beside its target
and renamed into place, so a crash during creation never leaves half a store at ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from ..capture.layout import Layout
from ..errors import ExtractError, StoreDamagedError, StoreNotFoundError
from .lock import pid_alive

FORMAT = "extract-features"
FORMAT_VERSION = 2  # 2: every object has a crc32c checksum
KNOWN_FORMAT_VERSIONS = (1, 2)
COMPRESSORS = ("zstd", "blosc", "none")
# numpy's variable-width strings: zarr writes them 3x faster than fixed-width "<U" (numpy >= 2)
STRINGS = np.dtypes.StringDType() if hasattr(np.dtypes, "StringDType") else str
SCRATCH = (".creating-", ".trash-")  # sibling directories of a store being built or deleted


def codecs(compressor: str) -> list[Any] | None:
    if compressor == "zstd":
        return [ZstdCodec(level=1)]
    if compressor == "blosc":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]
    if compressor == "none":
        return None
    raise ExtractError(f"unknown --compressor '{compressor}'; choose one of {', '.join(COMPRESSORS)}")


def dimension_names(layer: str, ndim: int, layout: str | None = None) -> tuple[str, ...]:
    """Per-layer dimension names: xarray needs them, and layers differ in size along them."""
    names = Layout(layout).dimension_names if layout else ()
    if len(names) != ndim:
        names = {3: Layout.NCHW.dimension_names, 2: Layout.NLC.dimension_names, 1: ("feature",)}.get(
            ndim, tuple(f"dim{i}" for i in range(ndim))
        )
    return ("sample", *(f"{layer}.{n}" for n in names))


def _checked(compressors: list[Any] | None) -> list[Any]:
    """The checksum goes last: it covers the bytes as stored, after compression."""
    return [*(compressors or []), Crc32cCodec()]


def _store_attrs(path: Path) -> dict[str, Any] | None:
    meta = path / "zarr.json"
    if not meta.is_file():
        return None
    try:
        attrs = json.loads(meta.read_text()).get("attributes", {})
    except (OSError, ValueError):
        return None
    return attrs if attrs.get("format") == FORMAT else None


def check_out_path(path: Path) -> dict[str, Any] | None:
    """Refuse an ``--out`` that cannot become a store, before any compute.

    Returns the attributes of an existing extract store there, or ``None`` when there is none yet.
    Whether an existing store can be written is decided later (a complete one on a read-only mount
    is fine: there is nothing to write).
    """
    if path.is_file():
        raise ExtractError(f"--out {path} is a regular file, not a store; choose another --out")
    if path.is_dir():
        attrs = _store_attrs(path)
        if attrs is None and any(path.iterdir()):
            raise ExtractError(
                f"--out {path} is a directory that is not an extract store; choose a new path (it is never overwritten)"
            )
        return attrs
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExtractError(f"--out {path}: {parent} is a file, not a directory; choose another --out")
    check_writable(parent, f"--out {path}: cannot create it under {parent} (not writable)")
    return None


def sweep_scratch(path: Path) -> None:
    """Delete what a killed creation or overwrite left beside ``path``. Only the lock's holder calls this:
    nobody else can be building or deleting there."""
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        if any(entry.name.startswith(f".{path.name}{kind}") for kind in SCRATCH):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(f".{path.name}.lock-"):  # a lock record a killed claimer never linked
            host, _, pid = entry.name.rpartition("-")
            gone = host.endswith(f"-{socket.gethostname()}") and pid.isdigit() and not pid_alive(int(pid))
            with contextlib.suppress(OSError):
                if gone or time.time() - entry.stat().st_mtime > 60:  # a young one may be a claimer's, mid-claim
                    entry.unlink()


def check_writable(directory: Path, problem: str) -> None:
    # os.access says yes to root even on a read-only filesystem; creating a file tells the truth.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ExtractError(f"{problem} ({e.strerror}); choose another --out") from None


class FeatureStore:
    """``features/<layer>``, ``labels`` and ``done`` in one zarr group, plus the job's attributes."""

    def __init__(self, group: zarr.Group, path: Path) -> None:
        self.group = group
        self.path = path
        self._arrays: dict[str, zarr.Array] = {}

    @classmethod
    def create(
        cls,
        path: Path,
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
        after: Callable[[Path], None] | None = None,
    ) -> FeatureStore:
        """Build the store beside ``path`` and rename it into place: a kill or a full disk at any instant
        leaves either no store or the whole skeleton. ``overwrite`` first moves the old store aside
        (one rename), then deletes it: an interrupted overwrite leaves the old store or nothing.
        ``after(folder)`` adds files to the skeleton before the rename (the shard index)."""
        scratch = path.with_name(f".{path.name}.creating-{os.getpid()}")
        trash = path.with_name(f".{path.name}.trash-{os.getpid()}")
        try:
            cls._build(scratch, shapes, num_samples, chunk_size, dtype, compressor, attrs, layouts, keys)
            if after is not None:
                after(scratch)
            if overwrite and _store_attrs(path) is not None:
                os.rename(path, trash)
            os.rename(scratch, path)  # replaces an absent path or an empty directory
        except OSError as e:
            shutil.rmtree(scratch, ignore_errors=True)
            raise ExtractError(
                f"--out {path}: cannot create the store ({e.strerror or e}); free space or choose another --out"
            ) from None
        shutil.rmtree(trash, ignore_errors=True)
        return cls.open(path)

    @staticmethod
    def _build(
        path: Path,
        shapes: Mapping[str, tuple[int, ...]],
        num_samples: int,
        chunk_size: int,
        dtype: str,
        compressor: str,
        attrs: dict[str, Any],
        layouts: Mapping[str, str | None] | None,
        keys: Sequence[str] | None,
    ) -> None:
        group = zarr.open_group(
            path,
            mode="w",
            attributes={
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                # what opening validates the arrays against, also for callers that pass fewer attributes
                "num_samples": num_samples,
                "chunk_size": chunk_size,
                "layers": list(shapes),
                **attrs,
            },
        )
        features = group.create_group("features")
        for layer, shape in shapes.items():
            features.create_array(
                layer,
                shape=(num_samples, *shape),
                chunks=(chunk_size, *shape),
                dtype=dtype,
                fill_value=np.nan,
                compressors=_checked(codecs(compressor)),
                dimension_names=dimension_names(layer, len(shape), (layouts or {}).get(layer)),
            )
        group.create_array(
            "labels", shape=(num_samples,), chunks=(chunk_size,), dtype="int64", fill_value=-1,
            compressors=_checked(codecs("zstd")), dimension_names=("sample",),
        )  # fmt: skip
        group.create_array(
            "valid", shape=(num_samples,), chunks=(chunk_size,), dtype="bool", fill_value=False,
            compressors=_checked(codecs("zstd")), dimension_names=("sample",),
        )  # fmt: skip
        if keys is not None:  # where each row came from: written whole at creation, chunked like the data
            group.create_array(
                "keys", shape=(num_samples,), chunks=(chunk_size,), dtype=str,
                compressors=_checked(codecs("zstd")), dimension_names=("sample",),
            )[:] = np.asarray(keys, dtype=STRINGS)  # fmt: skip
        num_chunks = -(-num_samples // chunk_size)
        group.create_array(
            "done", shape=(num_chunks,), chunks=(1,), dtype="bool", fill_value=False,
            compressors=[Crc32cCodec()], dimension_names=("chunk",),
        )  # fmt: skip

    @classmethod
    def open(cls, path: Path, mode: str = "r+") -> FeatureStore:
        """Open and validate: a known format version, every array there, shapes that agree with
        ``num_samples`` and the chunk size. Metadata that disagree are an error, never believed."""
        attrs = _store_attrs(path)
        if attrs is None:
            raise (ExtractError if path.exists() else StoreNotFoundError)(f"{path} is not an extract store")
        version = attrs.get("format_version")
        if version not in KNOWN_FORMAT_VERSIONS:
            raise StoreDamagedError(
                f"{path} has format_version {version!r}; this extract knows {', '.join(map(str, KNOWN_FORMAT_VERSIONS))} "
                "(a newer extract wrote it, or its zarr.json was edited)"
            )
        store = cls(zarr.open_group(path, mode=mode), path)
        store._validate(attrs)
        return store

    def _validate(self, attrs: dict[str, Any]) -> None:
        n, c = attrs.get("num_samples"), attrs.get("chunk_size")
        if not (type(n) is int and type(c) is int and n >= 1 and c >= 1):
            raise StoreDamagedError(f"{self.path}: num_samples {n!r} and chunk_size {c!r} must be positive integers")
        num_chunks = -(-n // c)
        expected = {f"features/{layer}": None for layer in attrs.get("layers", [])}
        expected.update(labels=None, valid=None)
        for name in [*expected, "done"]:
            try:
                array = self.array(name)
            except KeyError:
                raise StoreDamagedError(
                    f"{self.path} has no array '{name}': it is damaged or not finished being created; "
                    "rerun the job with --overwrite"
                ) from None
            rows, chunk = (num_chunks, 1) if name == "done" else (n, c)
            if array.shape[:1] != (rows,) or array.chunks[:1] != (chunk,):
                raise StoreDamagedError(
                    f"{self.path}: array '{name}' has shape {list(array.shape)} in chunks of {list(array.chunks)}, "
                    f"but the metadata say num_samples {n} and chunk_size {c}; the store was edited or damaged"
                )

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def update_attrs(self, **values: Any) -> None:
        self.group.attrs.update(values)

    def array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            # Every chunk written here is real data: skip zarr's scan of each chunk for "all fill value"
            # (write_empty_chunks=False), which costs as much CPU as zstd-1 encoding it (benchmarks/RESULTS.md).
            array: zarr.Array = self.group[name]  # type: ignore[assignment]
            self._arrays[name] = array.with_config({"write_empty_chunks": True})
        return self._arrays[name]

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

    def sample_arrays(self) -> Iterator[tuple[str, zarr.Array]]:
        """Every per-sample array (features, labels, valid and any other with N rows), by path."""
        n = self.attrs["num_samples"]
        for name, member in self.group.members(max_depth=None):
            if isinstance(member, zarr.Array) and name != "done" and member.shape[:1] == (n,):
                yield name, self.array(name)

    def object_path(self, array: zarr.Array, chunk: int) -> Path:
        """The file of ``array``'s chunk ``chunk`` (the whole row range of data chunk ``chunk``)."""
        return self.path / array.path / array.metadata.encode_chunk_key((chunk, *[0] * (array.ndim - 1)))

    def missing_objects(self, chunks: list[int] | None = None) -> dict[int, list[str]]:
        """The cheap check: for each done chunk (or each of ``chunks``), the arrays whose object is absent.
        Every chunk written is stored (write_empty_chunks), so an absent one was lost."""
        chunks = np.flatnonzero(self.done_flags()).tolist() if chunks is None else chunks
        missing: dict[int, list[str]] = {}
        for name, array in self.sample_arrays():
            for k in chunks:
                if not self.object_path(array, k).is_file():
                    missing.setdefault(k, []).append(name)
        return missing

    def write_keys(self, chunks: list[int], keys: Sequence[str]) -> None:
        """Rewrite the keys of ``chunks`` (about to be recomputed): ``verify --repair`` clears the chunks
        whose keys object was lost or damaged, and the keys are otherwise only written at creation."""
        if "keys" not in self.group:
            return
        array, size = self.array("keys"), self.attrs["chunk_size"]
        for k in chunks:
            start, stop = k * size, min((k + 1) * size, array.shape[0])
            array[start:stop] = np.asarray(keys[start:stop], dtype=STRINGS)

    def clear_done(self, chunks: list[int]) -> None:
        """Mark ``chunks`` not done (their objects were lost or damaged): a rerun recomputes exactly those."""
        done = self.array("done")
        for k in chunks:
            self.object_path(done, k).unlink(missing_ok=True)  # an absent object reads as False (progress counts files)
        if chunks and self.attrs.get("status") == "complete":
            self.update_attrs(status="running")

    def write_chunk(
        self,
        chunk: int,
        start: int,
        stop: int,
        features: Mapping[str, np.ndarray],
        labels: np.ndarray,
        valid: np.ndarray,
    ) -> None:
        """Write one whole chunk of every array, then mark it done: a crash before the mark redoes it."""
        for layer, values in features.items():
            self.array(f"features/{layer}")[start:stop] = values
        self.array("labels")[start:stop] = labels
        self.array("valid")[start:stop] = valid
        self.array("done")[chunk] = True

    def stored_bytes(self) -> int:
        return sum(f.stat().st_size for f in (self.path / "features").rglob("*") if f.is_file())
