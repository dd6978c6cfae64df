"""The zarr v3 store a job writes (layout in DESIGN.md): created by rank 0, written chunk-wise by all.

Every object carries a crc32c checksum (zarr's ``Crc32cCodec`` after compression), so a torn, truncated
or garbage object fails to decode instead of being read as data. The store is built beside its target
and renamed into place, so a crash during creation never leaves half a store at ``--out``. Once open,
done flags, deletion, sizes and listings go through zarr's store API, never through paths on disk.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.codecs import Crc32cCodec

from ..errors import ExtractError, StoreBeingCreatedError, StoreDamagedError, StoreNotFoundError
from ..names import Kind
from ..names.layout import Layout
from . import objects, remote, stats
from .chunks import Plan
from .fence import ROOT_METADATA, FencedStore, lost_lock, writer_of
from .location import from_object_storage, is_url, open_store, storage_error
from .schema import FORMAT, FORMAT_VERSION, KNOWN_FORMAT_VERSIONS, STRINGS, checked, codecs, identity_digests
from .stats import STATS

SCRATCH = (".creating-", ".trash-", ".debris-")  # sibling directories of a store being built or deleted
INDEXES = "index"  # the group of saved listings (``index/<name>``, uint8): not per-sample arrays
INDEX_CHUNK_BYTES = 16 * 2**20
# (K, A) uint32: row k holds the crc32c of chunk k's object in each per-sample array (format 3). The
# checksum codec goes last, so an object's last 4 bytes are its own crc32c: the digest costs a 4-byte
# read of what was just written, not a second hash of the data.
DIGESTS = "digests"
DIGEST_BYTES = 4
# {array: [crc32c of each object]} of the arrays written whole at creation (``document_arrays``)
DOCUMENT_DIGESTS = "document_digests"
METADATA = "zarr.json"
DAMAGED = "extract.damaged_root"  # check_out_path's key for a store whose root metadata do not decode


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


TEXT_ARRAYS = ("offsets",)
TOKEN_ARRAYS = ("token_ids", "special")
PACKED_ARRAYS = ("doc", "doc_position")
TEXT_CHUNK = 2**16  # rows per chunk of the per-document and token-id arrays where they are not row arrays


def row_arrays(kind: Kind, layers: Iterable[str], keys: bool = True, packed: bool = False) -> list[str]:
    """The arrays with one row per stored row (chunked like the features, written per chunk), in the
    order of the ``digests`` columns: a token store's rows are tokens, its labels are per document
    (``packed``: per context, and each token has its source document and position)."""
    features = [f"features/{layer}" for layer in layers]
    if kind is Kind.TOKENS:
        return [*features, *TOKEN_ARRAYS, *(PACKED_ARRAYS if packed else ())]
    return [*features, "labels", "valid", *(["keys"] if keys else [])]


def decodes(array: zarr.Array, start: int, stop: int) -> bool:
    """Whether rows ``start:stop`` of ``array`` read back: a damaged object fails its codec's check."""
    try:
        array[start:stop]
    except Exception:  # noqa: BLE001 - any codec error means the object is damaged
        return False
    return True


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


def _object_keys(array: zarr.Array) -> list[str]:
    """The keys of every object of a 1-D ``array``, in order."""
    count = -(-array.shape[0] // array.chunks[0]) if array.shape[0] else 0
    return [f"{array.path}/{array.metadata.encode_chunk_key((i,))}" for i in range(count)]


def _digests_of(group: zarr.Group, names: Sequence[str]) -> dict[str, list[int | None]]:
    """Each array's objects' crc32c (the 4-byte suffix the checksum codec appends), None where absent."""
    found = {}
    for name in names:
        keys = _object_keys(group[name])  # type: ignore[arg-type]
        tails = objects.suffixes(group.store, keys, DIGEST_BYTES)
        found[name] = [None if t is None else int.from_bytes(t, "little") for t in tails]
    return found


def _store_attrs(path: Path, damaged: bool = False) -> dict[str, Any] | None:
    """The attributes of the extract store at ``path``, or None; root metadata that do not decode are
    None too, or, with ``damaged``, a ``StoreDamagedError`` naming them."""
    meta = path / METADATA
    if not meta.is_file():
        return None
    try:
        data = meta.read_bytes()
    except OSError:
        data = b""  # unreadable: as damaged as undecodable
    return _decoded_attrs(data, str(meta), damaged)


def _decoded_attrs(data: bytes, where: str, damaged: bool) -> dict[str, Any] | None:
    """The attributes in root metadata ``data`` if they are an extract store's (see ``_store_attrs``)."""
    try:
        attrs = json.loads(data).get("attributes", {})
        if not isinstance(attrs, dict):
            raise ValueError("attributes are not a mapping")
    except (ValueError, AttributeError):
        if damaged:
            raise StoreDamagedError(
                f"{where} does not decode as zarr metadata; rerun the job with --overwrite"
            ) from None
        return None
    return attrs if attrs.get("format") == FORMAT else None


def _check_version(path: Path | str, attrs: dict[str, Any]) -> None:
    version = attrs.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS:
        raise StoreDamagedError(
            f"{path} has format_version {version!r}; this extract knows {', '.join(map(str, KNOWN_FORMAT_VERSIONS))} "
            "(a newer extract wrote it, or its zarr.json was edited)"
        )


def damaged_root(path: Path) -> str | None:
    """How the root ``zarr.json`` of what is recognisably an extract store at ``path`` is damaged (torn,
    garbage), or None: it decodes, or the directory is not recognisably a store, and then it is never
    replaced. Recognisable by its ``done`` and ``features`` metadata; not by a lock named for it alone,
    which the refused run itself would remove, so that the ``--overwrite`` it advises would be refused."""
    try:
        if isinstance(json.loads((path / "zarr.json").read_bytes()), dict):
            return None
        why = "it is not a JSON object"
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        why = f"it does not decode: {getattr(e, 'strerror', None) or type(e).__name__}"
    return why if all((path / name / "zarr.json").is_file() for name in ("done", "features")) else None


def real_path(path: Path) -> Path:
    """``path`` with its symbolic links resolved: a store reached through a link and by its own path is
    one store, with one lock. Where no link is involved, ``path`` as given, so messages keep its words."""
    real = path.resolve()
    return path if real == Path(os.path.abspath(path)) else real


def check_out_path(path: Path) -> dict[str, Any] | None:
    """Refuse an ``--out`` that cannot become a store, before any compute.

    Returns the attributes of an existing extract store there, or ``None`` when there is none yet.
    Whether an existing store can be written is decided later (a complete one on a read-only mount
    is fine: there is nothing to write).
    """
    if path.is_file():
        raise ExtractError(f"--out {path} is a regular file, not a store; choose another --out")
    for above in Path(os.path.abspath(path)).parents:  # a store inside a store would become its member
        if _store_attrs(above) is not None:
            raise ExtractError(f"--out {path} is inside the extract store {above}; choose a path outside it")
    if path.is_dir():
        attrs = _store_attrs(path)
        if attrs is None and (damage := damaged_root(path)) is not None:
            return {DAMAGED: damage}  # replaced with --overwrite, refused without: decided with the job
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


def _move_into_place(scratch: Path, path: Path) -> None:
    """Rename ``scratch`` to ``path``, an absent path or an empty directory. A holder that lost its lock
    can still land the writes it checked a moment before the old store went aside (zarr has several in
    flight at once), and each makes the directories of its chunk again: debris without root metadata,
    which goes aside too, as often as such a write lands."""
    for attempt in itertools.count():
        try:
            os.rename(scratch, path)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or (path / ROOT_METADATA).exists() or attempt >= 100:
                raise
        debris = path.with_name(f".{path.name}.debris-{os.getpid()}-{attempt}")
        os.rename(path, debris)
        shutil.rmtree(debris, ignore_errors=True)


def check_out_url(url: str) -> dict[str, Any] | None:
    """``check_out_path`` for a store on object storage: the attributes of the store there, ``None`` when
    there is none yet (an empty prefix, or a store's debris: a creation or deletion that did not finish,
    which its lock's next holder deletes), or ``{DAMAGED: why}``. A prefix of other objects is refused."""
    found = remote.survey(open_store(url))
    attrs = None if found.root is None else _decoded_attrs(found.root, f"{url}/{METADATA}", damaged=False)
    if attrs is not None:
        return attrs
    if found.root is not None and found.ours:
        return {DAMAGED: "it does not decode as an extract store's metadata"}
    if found.occupied and not found.ours:
        raise ExtractError(
            f"--out {url} is a prefix of objects that are not an extract store; choose a new prefix "
            "(it is never overwritten)"
        )
    return None


def sweep_scratch(path: Path) -> None:
    """Delete what a killed creation or overwrite left beside ``path``. Only the lock's holder calls this:
    nobody else can be building or deleting there."""
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        if any(entry.name.startswith(f".{path.name}{kind}") for kind in SCRATCH):
            shutil.rmtree(entry, ignore_errors=True)


def _check_not_being_created(path: Path | str) -> None:
    """Raise ``StoreBeingCreatedError`` when a live job holds the lock of ``path``, where there is no
    store yet: the reader came while the job is creating it (or preparing to), not to a wrong path. The
    lock modules are loaded here only, for a path without a store."""
    if is_url(path):
        from .object_lock import live_holder, lock_url

        holder, lock = live_holder(str(path)), lock_url(str(path))
    else:
        from .lock import live_holder as live_file_holder
        from .lock import lock_path

        holder, lock = live_file_holder(Path(path)), str(lock_path(Path(path)))
    if holder is None:
        return
    job = "one that is starting"  # its claimer has not written its record yet
    if "pid" in holder:
        job = f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')}"
    raise StoreBeingCreatedError(
        f"{path} is being created by a job ({job}; its lock is {lock}); wait for the job, and read the store "
        "when it is done"
    )


def check_writable(directory: Path, problem: str) -> None:
    # os.access says yes to root even on a read-only filesystem; creating a file tells the truth.
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ExtractError(f"{problem} ({e.strerror}); choose another --out") from None


@dataclass(frozen=True)
class _Skeleton:
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
        columns = row_arrays(self.kind, self.shapes, keys=self.keys is not None, packed=packed)
        columns += self._stats(group, num_chunks)
        group.create_array(
            DIGESTS, shape=(num_chunks, len(columns)), chunks=(1, len(columns)), dtype="uint32", fill_value=0,
            compressors=[Crc32cCodec()], dimension_names=("chunk", "array"), attributes={"arrays": columns},
        )  # fmt: skip
        if self.indexes:
            self._indexes(group.create_group(INDEXES))
        arrays = [name for name, member in group.members(max_depth=None) if isinstance(member, zarr.Array)]
        group.attrs.update({"identity_sha256": identity_digests(dict(group.attrs), arrays)})

    def _features(self, features: zarr.Group) -> None:
        for layer, shape in self.shapes.items():
            features.create_array(
                layer,
                shape=(self.num_samples, *shape),
                chunks=(self.chunk_size, *shape),
                dtype=self.dtype,
                fill_value=np.nan,
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
        group.attrs.update({DOCUMENT_DIGESTS: _digests_of(group, names)})

    def _indexes(self, group: zarr.Group) -> None:
        """Each saved index as a uint8 array: a member of the hierarchy, so zarr (and object storage)
        sees nothing it does not know, with a checksum like every other object."""
        for name, blob in self.indexes.items():
            group.create_array(
                name, shape=(len(blob),), chunks=(max(1, min(len(blob), INDEX_CHUNK_BYTES)),), dtype="uint8",
                compressors=checked(codecs("zstd")),
            )[:] = np.frombuffer(blob, dtype=np.uint8)  # fmt: skip


class FeatureStore:
    """``features/<layer>``, ``labels`` and ``done`` in one zarr group, plus the job's attributes."""

    def __init__(self, group: zarr.Group, path: Path | str, writer: str | None = None) -> None:
        self.group = group
        self.path = path
        self.writer = writer  # the job's token: every write is refused once the store's ``writer`` is not it
        self._arrays: dict[str, zarr.Array] = {}
        self._chunk_of_key: dict[str, dict[str, int]] = {}
        self._has_digests: bool | None = None
        self._stats_layers: list[str] | None = None
        self._stats_looked = False

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
        indexes: Mapping[str, bytes] | None = None,
        kind: Kind = Kind.IMAGES,
        text: TextArrays | None = None,
    ) -> FeatureStore:
        """Build the store beside ``path`` and rename it into place: a kill or a full disk at any instant
        leaves either no store or the whole skeleton. ``overwrite`` first moves the old store aside
        (one rename), then deletes it: an interrupted overwrite leaves the old store or nothing.
        ``indexes`` are saved listings (name -> bytes) kept in the skeleton for a resume (the shard index)."""
        skeleton = _Skeleton(
            dict(shapes), num_samples, chunk_size, dtype, compressor, dict(layouts or {}), keys, dict(indexes or {}),
            Kind(kind), text,
        )  # fmt: skip
        if is_url(path):
            return cls._create_remote(str(path), skeleton, attrs, overwrite)
        scratch = path.with_name(f".{path.name}.creating-{os.getpid()}")
        trash = path.with_name(f".{path.name}.trash-{os.getpid()}")
        try:
            skeleton.build(scratch, attrs)
            if overwrite and (_store_attrs(path) is not None or damaged_root(path) is not None):
                os.rename(path, trash)
            _move_into_place(scratch, path)
        except OSError as e:
            objects.settle()  # zarr's other writes of the skeleton, still queued: none may land after the removal
            shutil.rmtree(scratch, ignore_errors=True)
            raise ExtractError(
                f"--out {path}: cannot create the store ({e.strerror or e}); free space or choose another --out"
            ) from None
        shutil.rmtree(trash, ignore_errors=True)
        return cls.open(path)

    @classmethod
    def _create_remote(cls, url: str, skeleton: _Skeleton, attrs: dict[str, Any], overwrite: bool) -> FeatureStore:
        """``create`` on object storage, where there is no rename: the old store or a creation's debris is
        deleted (root metadata first), then the skeleton is written with its root metadata last."""
        store = open_store(url)
        found = remote.survey(store)
        if found.occupied and not found.ours:
            raise ExtractError(f"--out {url} is a prefix of objects that are not an extract store; choose a new prefix")
        if found.root is not None and not overwrite:
            raise ExtractError(f"--out {url} already holds a store; pass --overwrite to replace it")
        if found.occupied:
            remote.delete_store(store)
        building = remote.RootLast(store)
        skeleton.build(building, attrs)
        building.commit()
        return cls.open(url)

    @classmethod
    def open(cls, path: Path | str, mode: str = "r+", writer: str | None = None) -> FeatureStore:
        """Open and validate: a known format version, every array there, shapes that agree with
        ``num_samples`` and the chunk size. Metadata that disagree are an error, never believed.
        ``writer``: the job's lock token, which the store's ``writer`` must be for any write to happen
        (``fence.py``); set it with ``claim`` first. ``path`` may be a URL on object storage
        (``s3://...``)."""
        if is_url(path):
            return cls._open_remote(str(path), mode, writer)
        path = Path(path)
        attrs = _store_attrs(path, damaged=True)
        if attrs is None:
            if not (path / ROOT_METADATA).exists():  # built beside the path, renamed into place when whole
                _check_not_being_created(path)
            raise (ExtractError if path.exists() else StoreNotFoundError)(f"{path} is not an extract store")
        _check_version(path, attrs)
        location: Any = path
        if writer is not None:
            location = FencedStore(zarr.storage.LocalStore(path, read_only=mode == "r"), token=writer, path=path)
        return cls._opened(zarr.open_group(location, mode=mode), path, writer, attrs)

    @classmethod
    def _open_remote(cls, url: str, mode: str, writer: str | None) -> FeatureStore:
        """A store on object storage, opened through zarr's ``ObjectStore`` (``location.py``); an outage
        past the retries is an ``ObjectStorageError`` naming the request."""
        try:
            return cls._open_remote_store(url, mode, writer)
        except Exception as e:
            if not from_object_storage(e):
                raise
            raise storage_error(url, e) from None

    @classmethod
    def _open_remote_store(cls, url: str, mode: str, writer: str | None) -> FeatureStore:
        location: Any = open_store(url, read_only=mode == "r")
        data = objects.read(location, METADATA)
        attrs = None if data is None else _decoded_attrs(data, f"{url}/{METADATA}", damaged=True)
        if attrs is None:
            if data is None:  # the root metadata are written last: a prefix without them may be a creation
                _check_not_being_created(url)
            there = data is not None or bool(objects.children(location, ""))
            raise (ExtractError if there else StoreNotFoundError)(f"{url} is not an extract store")
        _check_version(url, attrs)
        if writer is not None:
            location = FencedStore(location, token=writer, path=url)
        return cls._opened(zarr.open_group(location, mode=mode), url, writer, attrs)

    @classmethod
    def _opened(cls, group: zarr.Group, path: Path | str, writer: str | None, attrs: dict[str, Any]) -> FeatureStore:
        store = cls(group, path, writer)
        store._validate(attrs)
        return store

    def claim(self, token: str) -> None:
        """Make ``token`` (a lock's) the store's ``writer``: the previous writer's writes are refused from
        now on. Only the lock's holder calls this, before any chunk is written."""
        self.update_attrs(writer=token)

    def check_writer(self, token: str | None = None) -> None:
        """Raise ``LockLostError`` unless the store's ``writer``, read afresh, is ``token`` (default: ours)."""
        if writer_of(objects.read(self.group.store, ROOT_METADATA)) != (token or self.writer):
            raise lost_lock(self.path)

    def _validate(self, attrs: dict[str, Any]) -> None:
        n, c = attrs.get("num_samples"), attrs.get("chunk_size")
        if not (type(n) is int and type(c) is int and n >= 1 and c >= 1):
            raise StoreDamagedError(f"{self.path}: num_samples {n!r} and chunk_size {c!r} must be positive integers")
        try:
            kind = Kind.of(attrs)
        except ValueError:
            known = ", ".join(Kind)
            raise StoreDamagedError(f"{self.path}: kind {attrs.get('kind')!r} is not one of {known}") from None
        expected = {f"features/{layer}": None for layer in attrs.get("layers", [])}
        expected.update(labels=None, valid=None)
        if kind.text:
            expected.update(dict.fromkeys(TEXT_ARRAYS))
        if kind is Kind.TOKENS:
            expected.update(dict.fromkeys(TOKEN_ARRAYS))
        packed = attrs.get("pack") is not None
        if packed:
            expected.update(dict.fromkeys(PACKED_ARRAYS))
        optional = [name for name in ("keys", DIGESTS) if self.has(name)]  # read back, so checked too
        rows_of = set(row_arrays(kind, attrs.get("layers", []), packed=packed))
        per_chunk = {"done", DIGESTS}
        for name in [*expected, "done", *optional]:
            self._check_rows(name, per_chunk, rows_of, n, c)
        for name in [name for name, _ in self.chunk_arrays()]:  # after the layers: their shapes decide these
            self._check_rows(name, {name}, rows_of, n, c)

    def _check_rows(self, name: str, per_chunk: set[str], rows_of: set[str], n: int, c: int) -> None:
        """Array ``name`` exists and has N rows in chunks of C (K rows in chunks of 1 if in ``per_chunk``)."""
        try:
            array = self.array(name)
        except KeyError:
            raise StoreDamagedError(
                f"{self.path} has no array '{name}': it is damaged or not finished being created; "
                "rerun the job with --overwrite"
            ) from None
        if name not in rows_of and name not in per_chunk:
            return  # a text store's per-document or token-id arrays: their length is the corpus's
        rows, chunk = (-(-n // c), 1) if name in per_chunk else (n, c)
        if array.shape[:1] != (rows,) or array.chunks[:1] != (chunk,):
            raise StoreDamagedError(
                f"{self.path}: array '{name}' has shape {list(array.shape)} in chunks of {list(array.chunks)}, "
                f"but the metadata say num_samples {n} and chunk_size {c}; the store was edited or damaged"
            )

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

    def chunk_arrays(self) -> list[tuple[str, zarr.Array]]:
        """The arrays written per chunk with one row per chunk (``stats/<layer>``), by path."""
        return [(f"{STATS}/{layer}", self.array(f"{STATS}/{layer}")) for layer in self.stats_layers() or []]

    @property
    def kind(self) -> Kind:
        """``images``, ``documents`` (text pooled per document) or ``tokens`` (one row per token)."""
        return Kind.of(self.attrs)

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    def update_attrs(self, **values: Any) -> None:
        self.group.attrs.update(values)

    def array(self, name: str) -> zarr.Array:
        """Array ``name``; ``KeyError`` when there is none, ``StoreDamagedError`` when its metadata are garbage."""
        if name not in self._arrays:
            try:
                array = self.group[name]
            except Exception as e:  # noqa: BLE001 - absent, or metadata that zarr cannot decode
                if not self.has(name):
                    raise KeyError(name) from None
                raise self._undecodable(name, e) from None
            if not isinstance(array, zarr.Array):
                raise KeyError(name)
            # Every chunk written here is real data: skip zarr's scan of each chunk for "all fill value"
            # (write_empty_chunks=False), which costs as much CPU as zstd-1 encoding it (benchmarks/RESULTS.md).
            self._arrays[name] = array.with_config({"write_empty_chunks": True})
        return self._arrays[name]

    def has(self, name: str) -> bool:
        """Whether node ``name`` has metadata (decodable or not): one existence check, no decoding."""
        return objects.read(self.group.store, f"{name}/{METADATA}") is not None

    def _undecodable(self, name: str, error: Exception) -> StoreDamagedError:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        return StoreDamagedError(
            f"{self.path}/{name}/{METADATA} does not decode as zarr metadata ({type(error).__name__}: {first}); "
            "rerun the job with --overwrite"
        )

    def _members(self) -> list[tuple[str, zarr.Array]]:
        """Every array of the store, by path; metadata that do not decode are named, not a JSON trace."""
        try:
            return [(name, m) for name, m in self.group.members(max_depth=None) if isinstance(m, zarr.Array)]
        except Exception as e:  # noqa: BLE001 - find the node whose metadata zarr choked on
            for key in sorted(objects.listed(self.group.store, "")):
                node = key.removesuffix(f"/{METADATA}")
                if key.endswith(f"/{METADATA}"):
                    try:
                        self.group[node]
                    except Exception as node_error:  # noqa: BLE001
                        raise self._undecodable(node, node_error) from None
            raise self._undecodable("", e) from None

    def array_names(self) -> list[str]:
        return [name for name, _ in self._members()]

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

    @property
    def plan(self) -> Plan:
        return Plan(self.attrs["num_samples"], self.attrs["chunk_size"])

    def sample_arrays(self) -> Iterator[tuple[str, zarr.Array]]:
        """Every per-sample array (features, labels, valid and any other with N rows), by path."""
        attrs = self.attrs
        n, kind = attrs["num_samples"], Kind.of(attrs)
        rows = set(row_arrays(kind, attrs.get("layers", []), packed=attrs.get("pack") is not None))
        for name, member in self._members():
            if kind.text:
                if name in rows:
                    yield name, self.array(name)
            elif name not in ("done", DIGESTS) and member.shape[:1] == (n,):
                # a saved index of N bytes is no sample array, nor statistics of N chunks of one sample
                if not name.startswith((f"{INDEXES}/", f"{STATS}/")):
                    yield name, self.array(name)

    def chunk_key(self, array: zarr.Array, chunk: int) -> str:
        """The store key of ``array``'s object for data chunk ``chunk`` (its whole row range)."""
        return f"{array.path}/{array.metadata.encode_chunk_key((chunk, *[0] * (array.ndim - 1)))}"

    def stored_chunks(self, name: str, chunks: Iterable[int]) -> set[int]:
        """Which of ``chunks`` have an object in array ``name``: one listing of the array's keys. A 1-D
        array's objects share one parent (``done/c/<k>``), listed as one directory: ten times cheaper than
        a recursive listing on disk, which the progress bar pays every half second."""
        array, wanted = self.array(name), set(chunks)
        if name not in self._chunk_of_key:  # encoding every key costs more than the listing: once per array
            every = range(self.plan.num_chunks)
            self._chunk_of_key[name] = {self.chunk_key(array, k): k for k in every}
        chunk_of_key = self._chunk_of_key[name]
        if array.ndim == 1:
            parent = self.chunk_key(array, 0).rpartition("/")[0]
            listed = {f"{parent}/{child}" for child in objects.children(self.group.store, parent)}
        else:
            listed = objects.listed(self.group.store, f"{array.path}/")
        return {chunk_of_key[key] for key in listed if key in chunk_of_key} & wanted

    def missing_objects(self, chunks: list[int] | None = None) -> dict[int, list[str]]:
        """The cheap check: for each done chunk (or each of ``chunks``), the arrays whose object is absent.
        Every chunk written is stored (write_empty_chunks), so an absent one was lost."""
        chunks = np.flatnonzero(self.done_flags()).tolist() if chunks is None else chunks
        missing: dict[int, list[str]] = {}
        for name, _ in [*self.sample_arrays(), *self.chunk_arrays()]:
            stored = self.stored_chunks(name, chunks)
            for k in chunks:
                if k not in stored:
                    missing.setdefault(k, []).append(name)
        return missing

    def write_keys(self, chunks: list[int], keys: Sequence[str]) -> None:
        """Rewrite the keys of ``chunks`` (about to be recomputed): ``verify --repair`` clears the chunks
        whose keys object was lost or damaged, and the keys are otherwise only written at creation."""
        if not self.has("keys"):
            return
        array, size = self.array("keys"), self.attrs["chunk_size"]
        for k in chunks:
            start, stop = k * size, min((k + 1) * size, array.shape[0])
            array[start:stop] = np.asarray(keys[start:stop], dtype=STRINGS)

    def clear_done(self, chunks: list[int]) -> None:
        """Mark ``chunks`` not done (their objects were lost or damaged): a rerun recomputes exactly those.
        The flags' objects are deleted: an absent ``done`` object reads as False, and the progress bar
        and ``verify`` count the objects present."""
        done, rows = self.array("done"), self.digests_array()
        digest_rows = [self.chunk_key(rows, k) for k in chunks] if rows is not None else []
        objects.delete(self.group.store, [self.chunk_key(done, k) for k in chunks] + digest_rows)
        if chunks and self.attrs.get("status") == "complete":
            self.update_attrs(status="running")

    def document_damage(self) -> list[str]:
        """The arrays written whole at creation (``document_arrays``) whose objects are not the ones
        written then: edited (even through zarr, with a valid checksum), swapped, torn or lost: each
        object's checksum against the digest recorded at creation, and against its contents (these
        arrays hold a few bytes per document)."""
        recorded = self.attrs.get(DOCUMENT_DIGESTS)
        if not isinstance(recorded, dict):
            return []  # a store from before the digests: nothing to check against
        damaged = []
        for name, digests in recorded.items():
            try:
                now = _digests_of(self.group, [name])[name]
            except Exception:  # noqa: BLE001 - its metadata are gone or garbage
                damaged.append(name)
                continue
            if now != digests or not decodes(self.array(name), 0, self.array(name).shape[0]):
                damaged.append(name)  # swapped or edited (another digest), or torn (fails its own checksum)
        return damaged

    def text_arrays(self) -> TextArrays:
        """The per-document arrays as written at creation (check ``document_damage`` first)."""
        source = self.array("source_lengths")[:] if self.has("source_lengths") else None
        return TextArrays(self.array("offsets")[:], self.array("labels")[:], self.array("valid")[:], source)

    def rewrite_documents(self, text: TextArrays, keys: Sequence[str] | None, names: Sequence[str]) -> None:
        """Write the arrays ``names`` (of ``document_arrays``) again, whole, from ``text`` and ``keys``
        (the same values and codecs give the same objects as at creation)."""
        values = {
            "offsets": text.offsets,
            "labels": text.labels,
            "valid": text.valid,
            "source_lengths": text.source_lengths,
        }
        for name in names:
            array = self.array(name)
            if name == "keys":
                assert keys is not None
                write_keys_in_blocks(array, keys)
            else:
                array[:] = np.asarray(values[name]).astype(array.dtype)
        recorded = dict(self.attrs.get(DOCUMENT_DIGESTS) or {})
        recorded.update(_digests_of(self.group, list(names)))
        self.update_attrs(**{DOCUMENT_DIGESTS: recorded})

    def write_chunk(
        self,
        chunk: int,
        start: int,
        stop: int,
        features: Mapping[str, np.ndarray],
        labels: np.ndarray | None,
        valid: np.ndarray | None,
        columns: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Write one whole chunk of every array and its layers' statistics (``stats.py``), record its
        objects' digests, then mark it done: a crash before the mark redoes it. Text stores pass no
        labels or valid: theirs were written at creation; a token store passes its token rows'
        ``columns`` (``token_ids``, ``special``...)."""
        for name, values in (columns or {}).items():
            self.array(name)[start:stop] = values
        for layer, values in features.items():
            array = self.array(f"features/{layer}")
            array[start:stop] = values
            if layer in (self.stats_layers() or ()):  # of the values as stored: after the cast to its dtype
                rows = self.array(f"{STATS}/{layer}")
                as_stored = np.asarray(values, dtype=array.dtype)
                rows[chunk] = stats.chunk_row(as_stored, rows.attrs.get("channel_axis"))
        if labels is not None:
            self.array("labels")[start:stop] = labels
        if valid is not None:
            self.array("valid")[start:stop] = valid
        if (rows := self.digests_array()) is not None:
            digests = self.object_digests([chunk], rows.attrs["arrays"])[chunk]
            rows[chunk] = np.array([0 if d is None else d for d in digests], dtype=np.uint32)
        self.array("done")[chunk] = True

    def digests_array(self) -> zarr.Array | None:
        """``digests`` (format 3), or None for a store written before it (format 2 and older)."""
        if self._has_digests is None:  # asked once per chunk written: look once
            self._has_digests = self.has(DIGESTS)
        return self.array(DIGESTS) if self._has_digests else None

    def object_digests(self, chunks: Sequence[int], names: Sequence[str]) -> dict[int, list[int | None]]:
        """Per chunk, the digest (the crc32c suffix) of its object in each array ``names``, read now; None
        for an object absent or too short to hold one. One concurrent batch of 4-byte reads."""
        keys = [self.chunk_key(self.array(name), k) for k in chunks for name in names]
        tails = iter(objects.suffixes(self.group.store, keys, DIGEST_BYTES))
        return {k: [None if (t := next(tails)) is None else int.from_bytes(t, "little") for _ in names] for k in chunks}

    def restore_checksum(self, name: str) -> None:
        """Put the checksum back last in array ``name``'s codec chain, as ``schema.checked`` builds it (its
        objects were written with it; the metadata lost it). Written through zarr's own metadata model."""
        array = self.array(name)
        meta = array.metadata.to_dict()
        meta["codecs"] = [*(c for c in meta["codecs"] if c.get("name") != "crc32c"), Crc32cCodec().to_dict()]
        document = type(array.metadata).from_dict(meta).to_buffer_dict(default_buffer_prototype())[METADATA]
        objects.write(self.group.store, f"{array.path}/{METADATA}", document.to_bytes())
        self._arrays.pop(name, None)

    def stored_bytes(self) -> int:
        """The bytes under ``features/``: every layer's objects and metadata, and the group's own. (zarr's
        ``Array.nbytes_stored`` summed over the layers would leave out the group's metadata.)"""
        return objects.size(self.group.store, "features/")


def saved_index(path: Path | str, name: str, legacy: str | None = None) -> bytes | None:
    """The index ``name`` saved in the store at ``path``, or None. ``legacy``: the key that stores from
    before ``index/<name>`` kept it under (an object inside the hierarchy that zarr warns about). The
    index only saves a rescan, so one that cannot be read is None, and the data is listed again."""
    try:
        group = zarr.open_group(open_store(path, read_only=True), mode="r")
        if f"{INDEXES}/{name}" in group:
            return group[f"{INDEXES}/{name}"][:].tobytes()  # type: ignore[union-attr]
        return objects.read(group.store, legacy) if legacy is not None else None
    except Exception:  # noqa: BLE001 - absent, unreadable or failing its checksum: list the data again
        return None
