"""Read a store back: its layers as lazy zarr arrays or as numpy / torch, labels, job metadata, and
which samples an unfinished job has written."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import zarr
from zarr.buffer.cpu import NDBuffer

from ..errors import (
    ExtractError,
    LayerNotFoundError,
    PoolMismatchError,
    PoolShapeError,
    SampleIndexError,
    StoreDamagedError,
)
from ..names import Kind
from ..names.layers import closest
from ..names.pooling import make_pool
from ..store import objects
from ..store.chunks import Plan
from ..store.location import from_object_storage, is_url, storage_error
from ..store.stats import STATS
from ..store.stats import merge as merge_stats
from ..store.store import FeatureStore, decodes
from .text_view import TextView

Index = slice | Sequence[int] | np.ndarray | None
T = TypeVar("T")

# Rows are decoded this many bytes at a time: zarr decodes the chunks of one read concurrently, and
# a bounded block keeps pooling and dtype conversion from ever holding a whole unpooled layer.
READ_BLOCK_BYTES = 64 * 2**20

# A chunk of a complete store whose done flag is False: every chunk was marked done before the status said
# complete, so the flag's object was lost or torn since (``verify`` says the same, and --repair clears it).
NOT_DONE = "is not marked done in a complete store (its done flag was lost or fails its check)"


@dataclass(frozen=True)
class _Rows:
    """A normalized ``index``: the sorted unique rows to read, and how to put them in the caller's order."""

    start: int  # rows[start:stop] when ``sorted_rows`` is None (a contiguous range)
    stop: int
    sorted_rows: np.ndarray | None = None
    inverse: np.ndarray | None = None  # output = read[inverse] when the caller's order differs

    @property
    def count(self) -> int:
        return self.stop - self.start if self.sorted_rows is None else len(self.sorted_rows)


def _normalize(index: Index, num_samples: int) -> _Rows:
    if index is None:
        return _Rows(0, num_samples)
    if isinstance(index, slice):
        start, stop, step = index.indices(num_samples)
        if step == 1:
            return _Rows(start, max(start, stop))
        index = np.arange(start, stop, step)
    rows = np.asarray(index)
    if rows.dtype == bool:
        if rows.shape != (num_samples,):
            raise SampleIndexError(f"a boolean index needs shape ({num_samples},), got {rows.shape}")
        rows = np.flatnonzero(rows)
    if rows.ndim != 1 or (rows.size and not np.issubdtype(rows.dtype, np.integer)):
        raise SampleIndexError(
            f"index must be None, a slice, or a 1-D list/array of ints or bools; got {rows.dtype}{list(rows.shape)}"
        )
    rows = rows.astype(np.int64)
    if rows.size and (rows.min() < -num_samples or rows.max() >= num_samples):
        raise SampleIndexError(f"index out of range for {num_samples} samples: min {rows.min()}, max {rows.max()}")
    rows = np.where(rows < 0, rows + num_samples, rows)
    if rows.size == 0 or np.all(np.diff(rows) > 0):
        return _Rows(0, 0, rows)
    unique, inverse = np.unique(rows, return_inverse=True)
    return _Rows(0, 0, unique, inverse)


def _count(selection: slice | np.ndarray) -> int:
    return selection.stop - selection.start if isinstance(selection, slice) else len(selection)


def _read(array: zarr.Array, selection: slice | np.ndarray, into: np.ndarray) -> np.ndarray:
    """Read ``selection`` into the first rows of ``into`` (zarr copies each decoded chunk there) and
    return those rows."""
    target = into[: _count(selection)]
    out = NDBuffer.from_numpy_array(target)
    if isinstance(selection, slice):
        array.get_basic_selection(selection, out=out)
    else:
        array.get_orthogonal_selection((selection,), out=out)
    return target


def _prefetched(array: zarr.Array, selections: list[slice | np.ndarray]) -> Iterator[np.ndarray]:
    """The blocks in order, each in one of two reused buffers (fresh ones would page-fault on every
    block), the next decoded by zarr's threads while the caller converts and pools this one. A
    yielded block is valid until the caller asks for the one after next."""
    rows = max(map(_count, selections), default=0)
    buffers = [np.empty((rows, *array.shape[1:]), dtype=array.dtype) for _ in range(min(2, len(selections)))]
    if len(selections) <= 1:
        yield from (_read(array, selection, buffers[0]) for selection in selections)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="extract-read") as background:
        upcoming = background.submit(_read, array, selections[0], buffers[0])
        for k in range(len(selections)):
            block = upcoming.result()
            if k + 1 < len(selections):
                upcoming = background.submit(_read, array, selections[k + 1], buffers[(k + 1) % 2])
            yield block


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _object_rows(array: zarr.Array, chunk: int) -> tuple[int, int]:
    """The rows [start, stop) of a 1-D ``array``'s object ``chunk``."""
    start = chunk * array.chunks[0]
    return start, min(start + array.chunks[0], array.shape[0])


def _empty(shape: tuple[int, ...], dtype: str | np.dtype) -> torch.Tensor:
    """An uninitialized tensor in numpy's memory: numpy asks for transparent huge pages for large
    arrays, so filling it page-faults far less than filling a ``torch.empty`` (2x faster here)."""
    try:
        return torch.from_numpy(np.empty(shape, dtype=np.dtype(dtype)))
    except TypeError:
        raise ExtractError(
            f"dtype '{dtype}' is not a numpy dtype torch can hold (use float32, float16, float64)"
        ) from None


# dimension names (after the sample axis, without the layer's prefix) -> the layout they spell
DIMENSION_LAYOUTS = {
    ("channel", "height", "width"): "NCHW",
    ("height", "width", "channel"): "NHWC",
    ("token", "dim"): "NLC",
    ("dim", "token"): "NCL",
}


def _pool_mismatch(
    layer: str, pool: str | None, shape: tuple[int, ...], error: PoolShapeError, pooled: str | None, call: str | None
) -> PoolMismatchError:
    """The reader's error in the reader's terms (``pool=``, in the ``call`` that passed it), not the
    command line's (``--pool``)."""
    call = call or f"load({layer!r}, pool={pool!r})"
    stored = f"({', '.join(map(str, shape))}) per sample"
    if pooled not in (None, "none"):
        stored += f" (pooled with {pooled} at extraction)"
    if error.wanted == "known layout":
        return PoolMismatchError(
            f"{call}: the store does not say which axes of {layer}, {stored}, are "
            "spatial; read it with pool=None and reduce the axes you mean"
        )
    instead = " or ".join(f"pool={choice!r}" for choice in error.instead.split(" or ")).replace(
        "pool='none'", "pool=None"
    )
    return PoolMismatchError(f"{call} needs {error.wanted} outputs, but {layer} is stored as {stored}; use {instead}")


@dataclass
class Features:
    """An extract store opened for reading (see ``open_features``).

    ``layers``, ``shapes`` (per-sample feature shape) and ``dtypes`` describe the stored layers;
    ``labels`` is (N,) int64 with -1 where the dataset had none; ``attrs`` is the job's metadata;
    ``present`` marks the samples written so far (all of them when ``complete``), ``valid`` those of
    them whose image could be read. A text store's token-level accessors (offsets, token ids, documents,
    packing) are ``text``, a ``TextView``; their old names here are the view's.
    """

    path: Path | str  # a URL for a store on object storage
    store: FeatureStore = field(repr=False)
    # per array written whole at creation: whether all its objects are stored (one listing, at its first read)
    _whole_objects: dict[str, bool] = field(default_factory=dict, init=False, repr=False)

    @property
    def attrs(self) -> dict[str, Any]:
        return self.store.attrs

    @cached_property
    def layers(self) -> list[str]:
        return list(self.attrs["layers"])

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {layer: tuple(self.array(layer).shape[1:]) for layer in self.layers}

    @cached_property
    def dtypes(self) -> dict[str, np.dtype]:
        return {layer: np.dtype(self.array(layer).dtype) for layer in self.layers}

    @property
    def num_samples(self) -> int:
        return int(self.attrs["num_samples"])

    @property
    def chunk_size(self) -> int:
        return int(self.attrs["chunk_size"])

    @property
    def num_chunks(self) -> int:
        return Plan(self.num_samples, self.chunk_size).num_chunks

    @property
    def complete(self) -> bool:
        return self.attrs.get("status") == "complete"

    @property
    def kind(self) -> Kind:
        """``images``, ``documents`` (text, one pooled row per document) or ``tokens`` (one row per token)."""
        return self.store.kind

    @cached_property
    def labels(self) -> np.ndarray:
        """(N,) int64, -1 where the data had none; in a token store (N_docs,): labels are per document."""
        if self.kind is Kind.TOKENS:
            return self._whole("labels")
        every = range(self.num_chunks)
        return self._checked("labels", "labels", every, lambda: self.store.array("labels")[:])

    @cached_property
    def keys(self) -> np.ndarray:
        """(N,) str: where each row came from (path relative to the root, ``shard/key``, ``file/row``); in a
        token store (N_docs,), the documents' (``file.jsonl/LINE``, ``file.parquet/ROW``, ``split/ROW``); in a
        packed one, the source documents' (``num_source_documents``; its rows' are ``doc``)."""
        if not self.store.has("keys"):
            raise ExtractError(f"{self.path} records no sample keys (written before stores had them)")
        if self.kind is Kind.TOKENS:
            return self._whole("keys")
        return self._checked("keys", "keys", range(self.num_chunks), lambda: self.store.array("keys")[:])

    @cached_property
    def text(self) -> TextView:
        """A text store's token-level accessors (offsets, token ids, documents, packing): ``TextView``."""
        if self.kind is Kind.IMAGES:
            raise ExtractError(
                f"{self.path} is an image store; offsets, token ids and documents belong to text stores "
                "(kind tokens or documents): open one of those for features.text"
            )
        return TextView(self)

    # The text accessors' old names, kept: each is the view's (see TextView for what it returns).
    @property
    def pack(self) -> dict[str, Any] | None:
        return None if self.kind is Kind.IMAGES else self.text.pack  # an image store was never packed

    @property
    def offsets(self) -> np.ndarray:
        return self.text.offsets

    @property
    def token_ids(self) -> np.ndarray:
        return self.text.token_ids

    def load_token_ids(self, tokens: slice) -> np.ndarray:
        return self.text.load_token_ids(tokens)

    @property
    def special(self) -> np.ndarray:
        return self.text.special

    @property
    def doc(self) -> np.ndarray:
        return self.text.doc

    @property
    def doc_position(self) -> np.ndarray:
        return self.text.doc_position

    @property
    def num_documents(self) -> int:
        """``offsets``' segments: documents, but a packed store's contexts (``TextView.num_documents``)."""
        return self.text.num_documents

    @property
    def num_contexts(self) -> int:
        return self.text.num_contexts

    @property
    def num_source_documents(self) -> int:
        return self.text.num_source_documents

    @property
    def token_documents(self) -> np.ndarray:
        return self.text.token_documents

    def documents_of(self, tokens: slice | np.ndarray) -> np.ndarray:
        return self.text.documents_of(tokens)

    @property
    def token_positions(self) -> np.ndarray:
        return self.text.token_positions

    def document(self, index: int, layer: str | None = None, **load: Any) -> np.ndarray | torch.Tensor:
        return self.text.document(index, layer, **load)

    @property
    def classes(self) -> list[str] | None:
        """The data set's class names (ImageFolder folders, ``ClassLabel`` names), indexed by label."""
        classes = self.attrs.get("classes")
        return list(classes) if classes is not None else None

    @cached_property
    def present(self) -> np.ndarray:
        """(N,) bool: the samples whose chunk is marked done; use it as an ``index`` to read only those."""
        return np.repeat(self._done, self.chunk_size)[: self.num_samples]

    @cached_property
    def valid(self) -> np.ndarray:
        """(N,) bool: present samples that have features; an image that could not be decoded under
        ``--skip-bad-images`` is stored as NaN with valid False. In a token store (N_docs,): the documents
        that could be read (one that could not has no tokens)."""
        if self.kind is Kind.TOKENS:
            return self._whole("valid")
        every = range(self.num_chunks)
        return self._checked("valid", "valid", every, lambda: self.store.array("valid")[:]) & self.present

    @cached_property
    def _done(self) -> np.ndarray:
        return self.store.done_flags()

    @cached_property
    def _lost(self) -> dict[int, list[str]]:
        """Done chunks whose object is absent, per array: found once, at the first read."""
        return self.store.missing_objects(np.flatnonzero(self._done).tolist())

    def _checked(self, name: str, what: str, chunks: Iterable[int], read: Callable[[], T]) -> T:
        """``read()``, unless one of ``chunks`` of array ``name`` is damaged: a done chunk whose object is
        missing or fails its checksum, or, in a complete store, a chunk not marked done (every chunk was,
        so its flag was lost or torn since, and its objects may have gone with it: they would read as
        NaN). Then an error naming ``what`` and the chunk, instead of NaN rows or a codec trace."""
        chunks = list(chunks)
        complete = self.complete
        try:
            for k in chunks:
                if not self._done[k]:
                    if complete:
                        raise self._damaged(what, k, NOT_DONE)
                elif name in self._lost.get(k, ()):
                    raise self._damaged(what, k, "is missing")
            return read()
        except ExtractError:
            raise
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the chunk
            if from_object_storage(e):  # an outage past the retries: not damage
                raise storage_error(str(self.path), e) from None
            array = self.store.array(name)
            bad = next(
                (k for k in chunks if not decodes(array, *Plan(self.num_samples, self.chunk_size).bounds(k))), None
            )
            if bad is None:
                raise
            raise self._damaged(what, bad, f"fails its check ({_first_line(e)})") from None

    def _whole(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """Rows ``rows`` of ``name``, an array written whole when the store was created (a text store's
        ``offsets``; a token store's ``labels``, ``valid`` and ``keys``), unless one of its objects fails its checksum or is missing: every object is
        stored (write_empty_chunks), so an absent one was lost and would read as the fill value."""
        array = self.store.array(name)
        try:
            values = np.asarray(array[rows])
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the object
            if from_object_storage(e):  # an outage past the retries: not damage
                raise storage_error(str(self.path), e) from None
            bad = next((k for k in range(array.nchunks) if not decodes(array, *_object_rows(array, k))), None)
            if bad is None:
                raise
            raise self._unrepairable(array, bad, f"fails its check ({_first_line(e)})") from None
        if name not in self._whole_objects:  # zarr counts the stored objects: one listing per array
            self._whole_objects[name] = array.nchunks_initialized == array.nchunks
        if not self._whole_objects[name]:
            raise self._unrepairable(array, self._absent_object(array), "is missing")
        return values

    def _absent_object(self, array: zarr.Array) -> int:
        """The first of ``array``'s objects that is not stored (one listing; only once one is known lost)."""
        if array.nchunks == 1:
            return 0
        stored = objects.listed(self.store.group.store, f"{array.path}/")
        return next(k for k in range(array.nchunks) if self.store.chunk_key(array, k) not in stored)

    def _unrepairable(self, array: zarr.Array, chunk: int, problem: str) -> StoreDamagedError:
        # written once, at the store's creation: verify names it (by the digests recorded then), and the
        # job's command writes it again from the data
        start, stop = _object_rows(array, chunk)
        return StoreDamagedError(
            f"{self.path}: '{array.path}', object {self.store.chunk_key(array, chunk)} (rows {start}-{stop - 1}) "
            f"{problem}; run `python -m extract.verify {self.path} --repair`, then the job's command again to "
            "write it again from the data"
        )

    def _damaged(self, what: str, chunk: int, problem: str) -> StoreDamagedError:
        start, stop = Plan(self.num_samples, self.chunk_size).bounds(chunk)
        return StoreDamagedError(
            f"{self.path}: {what}, chunk {chunk} (samples {start}-{stop - 1}) {problem}; run "
            f"`python -m extract.verify {self.path} --repair`, then the job's command again to recompute it"
        )

    def __len__(self) -> int:
        return self.num_samples

    def array(self, layer: str) -> zarr.Array:
        """The layer's lazy zarr array, (N, *shape); unwritten samples read as NaN."""
        if layer not in self.attrs["layers"]:
            raise LayerNotFoundError(
                f"{self.path} has no layer '{layer}'; it has {', '.join(self.attrs['layers'])} "
                f"(closest: {closest(layer, list(self.attrs['layers']))})"
            )
        return self.store.array(f"features/{layer}")

    def load(
        self,
        layer: str,
        index: Index = None,
        *,
        pool: str | None = None,
        dtype: str | None = "float32",
        as_torch: bool = False,
    ) -> np.ndarray | torch.Tensor:
        """Read ``layer`` for the samples ``index`` picks (None: all; a slice; ints in any order, with
        repeats; or an (N,) bool mask such as ``present``) into memory.

        ``pool`` reduces each sample like ``--pool`` does at extraction: ``avg`` / ``max`` (also
        ``avg:K``) over H, W of a (C, H, W) map (or an (H, W, C) one, as the store's ``layouts`` say),
        ``cls`` / ``mean`` over the tokens of a (T, D) output.
        Pooling is computed in float32 (float64 if asked) block by block, so a pooled read never holds
        the whole full-size layer. ``dtype=None`` keeps the stored dtype. Returns numpy, or torch
        with ``as_torch=True``.
        """
        array = self.array(layer)
        rows = _normalize(index, self.num_samples)
        reduce = make_pool(pool, self.layout(layer)) if pool not in (None, "none") else None
        out = _empty((rows.count, *self._pooled_shape(layer, reduce, pool)), dtype or array.dtype)
        blocks = list(self._blocks(rows, array))
        if rows.sorted_rows is None:
            touched: Iterable[int] = range(rows.start // self.chunk_size, -(-rows.stop // self.chunk_size))
        else:
            touched = np.unique(rows.sorted_rows // self.chunk_size).tolist()
        return self._checked(
            f"features/{layer}",
            f"layer '{layer}'",
            touched,
            lambda: self._load(array, rows, reduce, out, blocks, as_torch),
        )

    def _load(
        self, array: zarr.Array, rows: _Rows, reduce: Any, out: torch.Tensor, blocks: list, as_torch: bool
    ) -> np.ndarray | torch.Tensor:
        if reduce is None and out.numpy().dtype == array.dtype:
            # zarr decodes each chunk and copies it into ``out``: no second copy of the layer
            target = out.numpy()
            for selection, at in blocks:
                _read(array, selection, target[at:])
        else:
            compute_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
            for (_, at), block in zip(blocks, _prefetched(array, [selection for selection, _ in blocks]), strict=True):
                values = torch.from_numpy(block)
                if reduce is not None:
                    values = reduce(values.to(compute_dtype))
                out[at : at + len(values)] = values
        if rows.inverse is not None:
            out = out[torch.from_numpy(rows.inverse)]
        return out if as_torch else out.numpy()

    def stats(self, layer: str) -> dict[str, Any]:
        """Statistics of ``layer`` over the valid rows of every done chunk, merged from the rows the writer
        recorded with each chunk (no data read): ``count`` (rows counted; NaN rows of invalid samples and
        empty documents are not), ``mean`` and ``std`` (population) of each value, (F,) float64,
        ``mean_norm`` (mean L2 norm of a row), ``max_abs`` and ``scaling_factor`` = sqrt(F) / mean_norm,
        SAELens's activation normalization factor. Layers stored as 1-D rows (text layers, pooled image
        layers) have statistics of their rows; layers kept whole in a known layout (a ViT block or a conv
        map under ``--pool none``), of their positions' channel vectors (F = C, every (image, patch) a
        row, as ``TokenStream`` streams them)."""
        array = self.array(layer)
        known = self.store.stats_layers()
        if known is None:
            raise ExtractError(
                f"{self.path} was written before stores kept statistics; compute them from load({layer!r}), "
                "or extract into a new --out to have them"
            )
        if layer not in known:
            shape = ", ".join(map(str, array.shape[1:]))
            raise ExtractError(
                f"{self.path}: layer '{layer}' is stored as ({shape}) per row and statistics are kept for 1-D rows "
                "and for layers with a known layout only (or the store predates per-position statistics); "
                "extract it with --pool or --layout to have them, or compute them from load()"
            )
        name = f"{STATS}/{layer}"
        if self.complete and not self._done.all():  # statistics merged over fewer chunks would look whole
            raise self._damaged(f"statistics of layer '{layer}'", int(np.argmin(self._done)), NOT_DONE)
        done = np.flatnonzero(self._done).tolist()
        if lost := sorted(set(done) - self.store.stored_chunks(name, done)):  # one listing of this array
            raise self._damaged(f"statistics of layer '{layer}'", lost[0], "are missing")
        rows = self.store.array(name)
        try:
            recorded = rows.get_orthogonal_selection((np.asarray(done, dtype=np.int64), slice(None)))
        except Exception as e:  # noqa: BLE001 - a codec's error on a damaged object: name the chunk
            bad = next((k for k in done if not decodes(rows, k, k + 1)), None)
            if bad is None:
                raise
            raise self._damaged(f"statistics of layer '{layer}'", bad, f"fail their check ({_first_line(e)})") from None
        return merge_stats(recorded, rows.attrs["columns"], tuple(rows.attrs.get("shape") or self.shapes[layer]))

    def layout(self, layer: str) -> str | None:
        """The stored array's layout (``NCHW``, ``NHWC``, ``NLC``, ``NCL``), as the store records it or,
        where it does not (stores written before pooled arrays recorded theirs), as its dimension names
        say; ``None`` for a flat (D,) layer."""
        recorded = (self.attrs.get("layouts") or {}).get(layer)
        if recorded is not None:
            return recorded
        names = tuple(name.rpartition(".")[2] for name in (self.array(layer).metadata.dimension_names or ())[1:])
        return DIMENSION_LAYOUTS.get(names)

    def pooled_shape(self, layer: str, pool: str | None = None, *, call: str | None = None) -> tuple[int, ...]:
        """The shape of one sample of ``layer`` as ``load(layer, pool=pool)`` returns it, found without
        reading any data; a ``pool`` that does not fit the stored layer (one pooled at extraction, say)
        is a ``PoolMismatchError`` now, naming ``call`` (default: that ``load``)."""
        self.array(layer)  # an unknown layer: LayerNotFoundError with the valid names
        reduce = make_pool(pool, self.layout(layer)) if pool not in (None, "none") else None
        return self._pooled_shape(layer, reduce, pool, call)

    def _pooled_shape(self, layer: str, reduce: Any, pool: str | None, call: str | None = None) -> tuple[int, ...]:
        shape = self.shapes[layer]
        if reduce is None:
            return shape
        try:
            return tuple(reduce(torch.zeros((1, *shape)))[0].shape)
        except PoolShapeError as e:
            pooled = (self.attrs.get("pools") or {}).get(layer)
            raise _pool_mismatch(layer, pool, shape, e, pooled, call) from None

    def load_labels(self, index: Index = None) -> np.ndarray:
        """(n,) int64 labels of the samples ``index`` picks, read now (``labels`` is read once and kept:
        a store still being written gains labels as its chunks are written). In a token store ``index``
        picks documents."""
        if self.kind is Kind.TOKENS:
            picked = _normalize(index, self.num_documents)
            labels = self.labels
            if picked.sorted_rows is None:
                return labels[picked.start : picked.stop]
            chosen = labels[picked.sorted_rows]
            return chosen[picked.inverse] if picked.inverse is not None else chosen
        rows = _normalize(index, self.num_samples)
        if rows.sorted_rows is None:
            selection: slice | np.ndarray = slice(rows.start, rows.stop)
            touched: Iterable[int] = range(rows.start // self.chunk_size, -(-rows.stop // self.chunk_size))
        else:
            selection, touched = rows.sorted_rows, np.unique(rows.sorted_rows // self.chunk_size).tolist()
        labels = self._checked("labels", "labels", touched, lambda: self.store.array("labels")[selection])
        return labels[rows.inverse] if rows.inverse is not None else labels

    def _blocks(self, rows: _Rows, array: zarr.Array) -> Iterator[tuple[slice | np.ndarray, int]]:
        """(selection, output position) per block of a few whole chunks: one zarr call each, whose
        chunks zarr fetches and decodes concurrently; never element by element."""
        chunk = self.chunk_size
        row_bytes = math.prod(array.shape[1:]) * array.dtype.itemsize
        span = chunk * max(1, READ_BLOCK_BYTES // max(1, row_bytes * chunk))  # rows per block, chunk-aligned
        if rows.sorted_rows is None:
            if rows.stop <= rows.start:
                return
            for block_start in range(rows.start - rows.start % span, rows.stop, span):
                first = max(block_start, rows.start)
                yield slice(first, min(block_start + span, rows.stop)), first - rows.start
            return
        wanted = rows.sorted_rows
        if wanted.size == 0:
            return
        edges = np.arange(wanted[0] - wanted[0] % span, wanted[-1] + 1 + span, span)  # an edge past the last row
        bounds = np.searchsorted(wanted, edges)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo == hi:
                continue
            picked = wanted[lo:hi]
            contiguous = picked[-1] - picked[0] + 1 == len(picked)
            yield (slice(int(picked[0]), int(picked[-1]) + 1) if contiguous else picked), int(lo)

    def __repr__(self) -> str:
        layers = ", ".join(f"{layer} {list(self.shapes[layer])} {self.dtypes[layer]}" for layer in self.layers)
        state = "complete" if self.complete else f"{int(self.present.sum())}/{self.num_samples} present"
        if self.kind is Kind.TOKENS:
            pack = self.pack
            if pack is not None:  # its samples are contexts of T tokens; the documents are those packed into them
                rows = (
                    f"{self.num_samples} tokens in {self.num_contexts} contexts of {pack['context_length']}, "
                    f"from {self.num_source_documents} documents"
                )
            else:
                rows = f"{self.num_samples} tokens of {self.num_documents} documents"
            return f"Features({str(self.path)!r}, {rows}, {state}; {layers})"
        rows = f"N={self.num_samples}" if self.kind is Kind.IMAGES else f"{self.num_samples} documents"
        return f"Features({str(self.path)!r}, {rows}, {state}; {layers})"


def open_features(path: str | Path, *, allow_partial: bool = False) -> Features:
    """Open the store at ``path`` for reading.

    A store whose job has not finished (status "running": still running, or interrupted) is refused
    unless ``allow_partial=True``; then ``features.present`` tells which samples were written, and
    the others read as NaN (labels -1).
    """
    path = path if is_url(path) else Path(path)  # a URL on object storage stays one (s3://...)
    store = FeatureStore.open(path, mode="r")
    features = Features(path, store)
    if not features.complete and not allow_partial:
        done = int(store.done_flags().sum())
        raise ExtractError(
            f"{path} is not complete (status '{features.attrs.get('status')}', {done} of {features.num_chunks} "
            "chunks written): rerun the same extract command to finish it, or open it with "
            "allow_partial=True and read features.present"
        )
    return features
