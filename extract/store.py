"""The zarr v3 store a job writes (layout in DESIGN.md): created by rank 0, written chunk-wise by all."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

from .errors import ExtractError
from .lock import check_unlocked

FORMAT = "extract-features"
FORMAT_VERSION = 1
COMPRESSORS = ("zstd", "blosc", "none")
KEYS_CHUNK = 2**16
# numpy's variable-width strings: zarr writes them 3x faster than fixed-width "<U" (numpy >= 2)
STRINGS = np.dtypes.StringDType() if hasattr(np.dtypes, "StringDType") else str


def codecs(compressor: str) -> list[Any] | None:
    if compressor == "zstd":
        return [ZstdCodec(level=1)]
    if compressor == "blosc":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]
    if compressor == "none":
        return None
    raise ExtractError(f"unknown --compressor '{compressor}'; choose one of {', '.join(COMPRESSORS)}")


DIMENSIONS = {
    "NCHW": ("channel", "height", "width"),
    "NHWC": ("height", "width", "channel"),
    "NLC": ("token", "dim"),
    "NCL": ("dim", "token"),
}


def dimension_names(layer: str, ndim: int, layout: str | None = None) -> tuple[str, ...]:
    """Per-layer dimension names: xarray needs them, and layers differ in size along them."""
    names = DIMENSIONS.get(layout or "", ())
    if len(names) != ndim:
        names = {3: DIMENSIONS["NCHW"], 2: DIMENSIONS["NLC"], 1: ("feature",)}.get(
            ndim, tuple(f"dim{i}" for i in range(ndim))
        )
    return ("sample", *(f"{layer}.{n}" for n in names))


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
    """
    if path.is_file():
        raise ExtractError(f"--out {path} is a regular file, not a store; choose another --out")
    if path.is_dir():
        attrs = _store_attrs(path)
        if attrs is None and any(path.iterdir()):
            raise ExtractError(
                f"--out {path} is a directory that is not an extract store; choose a new path (it is never overwritten)"
            )
        if attrs is not None:
            check_unlocked(path)
        _check_writable(path, f"--out {path} is not writable")
        return attrs
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExtractError(f"--out {path}: {parent} is a file, not a directory; choose another --out")
    _check_writable(parent, f"--out {path}: cannot create it under {parent} (not writable)")
    return None


def _check_writable(directory: Path, problem: str) -> None:
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
    ) -> FeatureStore:
        if overwrite and _store_attrs(path) is not None:
            shutil.rmtree(path)
        group = zarr.open_group(
            path, mode="w", attributes={"format": FORMAT, "format_version": FORMAT_VERSION, **attrs}
        )
        features = group.create_group("features")
        for layer, shape in shapes.items():
            features.create_array(
                layer,
                shape=(num_samples, *shape),
                chunks=(chunk_size, *shape),
                dtype=dtype,
                fill_value=np.nan,
                compressors=codecs(compressor),
                dimension_names=dimension_names(layer, len(shape), (layouts or {}).get(layer)),
            )
        group.create_array(
            "labels", shape=(num_samples,), chunks=(chunk_size,), dtype="int64", fill_value=-1,
            dimension_names=("sample",),
        )  # fmt: skip
        group.create_array(
            "valid", shape=(num_samples,), chunks=(chunk_size,), dtype="bool", fill_value=False,
            dimension_names=("sample",),
        )  # fmt: skip
        if keys is not None:  # where each row came from; written once, whole, by the creating rank
            group.create_array(
                "keys", shape=(num_samples,), chunks=(min(num_samples, KEYS_CHUNK),), dtype=str,
                dimension_names=("sample",),
            )[:] = np.asarray(keys, dtype=STRINGS)  # fmt: skip
        num_chunks = -(-num_samples // chunk_size)
        group.create_array(
            "done", shape=(num_chunks,), chunks=(1,), dtype="bool", fill_value=False, dimension_names=("chunk",)
        )
        return cls(group, path)

    @classmethod
    def open(cls, path: Path, mode: str = "r+") -> FeatureStore:
        if _store_attrs(path) is None:
            raise ExtractError(f"{path} is not an extract store")
        return cls(zarr.open_group(path, mode=mode), path)

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

    def pending_chunks(self) -> list[int]:
        return np.flatnonzero(~self.array("done")[:]).tolist()

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
