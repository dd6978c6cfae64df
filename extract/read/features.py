"""Read a store back: its layers as lazy zarr arrays or as numpy / torch, labels, job metadata, and
which samples an unfinished job has written."""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import zarr
from zarr.buffer.cpu import NDBuffer

from ..errors import (
    InvalidRequestError,
    LayerNotFoundError,
    PoolMismatchError,
    PoolShapeError,
    SampleIndexError,
    StoreBusyError,
    StoreDamagedError,
)
from ..names import Kind
from ..names.layers import closest
from ..store import dtypes as storage
from ..store.chunks import Plan
from ..store.location import Location, locate
from ..store.opening import live_job
from ..store.stats import STATS
from ..store.stats import merge as merge_stats
from ..store.store import FeatureStore
from . import latents as sae_codes
from .checked import CheckedReads
from .text_view import TextView

if TYPE_CHECKING:  # torch is imported by the reads that make or pool tensors only: a numpy reader needs none
    import torch

Index = slice | Sequence[int] | np.ndarray | None
T = TypeVar("T")

# Rows are decoded this many bytes at a time: zarr decodes the chunks of one read concurrently, and
# a bounded block keeps pooling and dtype conversion from ever holding a whole unpooled layer.
READ_BLOCK_BYTES = 64 * 2**20


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


def _empty(shape: tuple[int, ...], dtype: str | np.dtype) -> np.ndarray | torch.Tensor:
    """An uninitialized array in numpy's memory: numpy asks for transparent huge pages for large
    arrays, so filling it page-faults far less than filling a ``torch.empty`` (2x faster here). bfloat16,
    which numpy has not (and only a torch read asks for), is numpy's bytes in a torch view."""
    if dtype == storage.BFLOAT16:
        import torch

        return torch.from_numpy(np.empty((*shape, 2), dtype=np.uint8)).view(torch.bfloat16).view(shape)
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        numpy_dtype = None
    # the dtypes ``torch.from_numpy`` takes, so that numpy and torch reads refuse the same ones
    if numpy_dtype is None or numpy_dtype.kind not in "biufc":
        raise InvalidRequestError(
            f"dtype '{dtype}' is not a numpy dtype torch can hold (use float32, float16, float64, or bfloat16 "
            "with as_torch=True)"
        )
    return np.empty(shape, dtype=numpy_dtype)


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


def _touched(rows: _Rows, chunk_size: int) -> Iterable[int]:
    """The chunks that hold the rows ``rows`` picks."""
    if rows.sorted_rows is None:
        return range(rows.start // chunk_size, -(-rows.stop // chunk_size))
    return np.unique(rows.sorted_rows // chunk_size).tolist()


def _blocks(rows: _Rows, array: zarr.Array, chunk: int) -> Iterator[tuple[slice | np.ndarray, int]]:
    """(selection, output position) per block of a few whole chunks of ``chunk`` rows: one zarr call
    each, whose chunks zarr fetches and decodes concurrently; never element by element."""
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


def _stored_view(out: np.ndarray | torch.Tensor, array: zarr.Array) -> np.ndarray | None:
    """``out``'s memory as the numpy dtype ``array`` stores, when its values are the stored values
    unconverted (zarr then decodes straight into it); None when they need a conversion."""
    if isinstance(out, np.ndarray):
        return out if out.dtype == array.dtype and not storage.is_bfloat16(array) else None
    return storage.numpy_view(out, array)


def _torch_imported() -> bool:
    """Whether this process has imported torch: then a conversion (float16 to float32, say) is torch's, the
    same values for ~1/8 of the CPU (0.11 against 0.9 CPU-s a GB of float16 here: torch's cast is
    vectorized, numpy's float16 cast is not); a process without torch saves its import (~2 CPU-s), which
    a read of less than ~2.5 GB of float16 would not win back (benchmarks/RESULTS.md)."""
    return "torch" in sys.modules


def _load_into(
    array: zarr.Array, rows: _Rows, reduce: Any, out: np.ndarray | torch.Tensor, blocks: list
) -> np.ndarray | torch.Tensor:
    """``blocks`` of ``array`` into ``out``, each reduced by ``reduce`` (None: as stored), in the caller's
    order. Torch is imported only where it computes: to pool, or to fill a bfloat16 tensor (and converts
    where a process has imported it already: ``_torch_imported``)."""
    target = _stored_view(out, array)  # None when the stored values need a conversion
    selections = [selection for selection, _ in blocks]
    if reduce is None and target is not None:
        # zarr decodes each chunk and copies it into ``out``: no second copy of the layer
        for selection, at in blocks:
            _read(array, selection, target[at:])
    elif reduce is None and isinstance(out, np.ndarray) and not _torch_imported():
        # numpy's casts give torch's values (round to nearest even; beyond float16: inf, silently, as
        # torch's did); bfloat16 bits widen to float32 exactly
        bfloat16 = storage.is_bfloat16(array)
        with np.errstate(over="ignore", invalid="ignore"):
            for (_, at), block in zip(blocks, _prefetched(array, selections), strict=True):
                out[at : at + len(block)] = storage.to_float32(block) if bfloat16 else block
    else:
        import torch

        tensor = torch.from_numpy(out) if isinstance(out, np.ndarray) else out  # the same memory
        compute_dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        for (_, at), block in zip(blocks, _prefetched(array, selections), strict=True):
            values = storage.as_tensor(block, storage.is_bfloat16(array))
            if reduce is not None:
                values = reduce(values.to(compute_dtype))
            tensor[at : at + len(values)] = values
    if rows.inverse is None:
        return out
    if isinstance(out, np.ndarray):
        return out[rows.inverse]
    import torch

    return out[torch.from_numpy(rows.inverse)]


def _reduced_shape(
    layer: str, shape: tuple[int, ...], reduce: Any, pool: str | None, pooled: str | None, call: str | None = None
) -> tuple[int, ...]:
    """One sample of ``layer`` (stored as ``shape``, pooled with ``pooled`` at extraction) as ``reduce``
    (``pool``'s) leaves it; a ``PoolMismatchError`` naming ``call`` where it does not fit."""
    if reduce is None:
        return shape
    import torch  # ``reduce`` is a pool, which computes in torch

    try:
        return tuple(reduce(torch.zeros((1, *shape)))[0].shape)
    except PoolShapeError as e:
        raise _pool_mismatch(layer, pool, shape, e, pooled, call) from None


def _pool(pool: str | None, layout: str | None) -> Any:
    """``pool``'s reduction of a sample in ``layout`` (None: no pool). The pools compute in torch, so
    their module, which imports it, is imported only by a read that pools."""
    if pool in (None, "none"):
        return None
    from ..names.pooling import make_pool

    return make_pool(pool, layout)


class _TextAlias(Generic[T]):
    """A text accessor's old name on ``Features``: the accessor of the same name of ``features.text``
    (``TextView``), so that both spellings are one implementation, with its documentation. Reading it
    warns (``DeprecationWarning``): the text accessors have one spelling, ``features.text.<name>``, and
    the old one keeps working for the readers written before the view."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = (
            f"Deprecated: ``features.text.{name}`` (``TextView.{name}``), which says: {getattr(TextView, name).__doc__}"
        )

    def __get__(self, features: Features | None, owner: type | None = None) -> T:
        if features is None:
            return self  # type: ignore[return-value] - the class's attribute: the alias itself
        warnings.warn(
            f"Features.{self.name} is deprecated: use features.text.{self.name}",
            DeprecationWarning,
            stacklevel=2,  # the reader's line, not this one
        )
        return getattr(features.text, self.name)


@dataclass
class Features:
    """An extract store opened for reading (see ``open_features``).

    ``layers``, ``shapes`` (per-sample feature shape) and ``dtypes`` describe the stored layers;
    ``labels`` is (N,) int64 with -1 where the dataset had none; ``attrs`` is the job's metadata;
    ``present`` marks the samples written so far (all of them when ``complete``), ``valid`` those of
    them whose image could be read. ``kind`` is ``images``, ``documents`` (text, one pooled row per
    document) or ``tokens`` (one row per token); ``num_samples`` rows in ``num_chunks`` chunks of
    ``chunk_size``. A text store's token-level accessors (offsets, token ids, documents, packing) are
    ``text``, a ``TextView``; their old names here (``features.offsets``...) still read the view's but
    warn (``DeprecationWarning``).
    """

    path: Path | str  # a URL for a store on object storage
    store: FeatureStore = field(repr=False)
    # the store's geometry and status, read once when it is opened (opening checked them)
    num_samples: int = field(init=False, repr=False, compare=False)
    chunk_size: int = field(init=False, repr=False, compare=False)
    num_chunks: int = field(init=False, repr=False, compare=False)
    complete: bool = field(init=False, repr=False, compare=False)
    kind: Kind = field(init=False, repr=False, compare=False)
    _reads: CheckedReads = field(init=False, repr=False, compare=False)
    _codes: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        attrs = self.attrs
        self.num_samples, self.chunk_size = int(attrs["num_samples"]), int(attrs["chunk_size"])
        self.num_chunks = Plan(self.num_samples, self.chunk_size).num_chunks
        self.complete = attrs.get("status") == "complete"
        self.kind = Kind.of(attrs)
        self._reads = CheckedReads(self.store, self.path, self.complete)

    @property
    def attrs(self) -> dict[str, Any]:
        return self.store.attrs

    @cached_property
    def layers(self) -> list[str]:
        return list(self.attrs["layers"])

    @cached_property
    def resolved_layers(self) -> dict[str, str]:
        """Each layer's name -> the tensor it is in the model: a module's output (``transformer.h.3``,
        ``transformer.h.3.attn:0``) or input (``transformer.h.3@input``), whatever alias the job asked
        for it by (``hidden_states.3``, ``blocks.3.hook_resid_pre``); empty for stores written before
        the store recorded it."""
        return dict(self.attrs.get("resolved_layers") or {})

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {layer: tuple(self.array(layer).shape[1:]) for layer in self.layers}

    @cached_property
    def dtypes(self) -> dict[str, np.dtype]:
        """Each layer's numpy dtype as ``load(dtype=None)`` returns it: float32 for a bfloat16 layer (numpy
        has no bfloat16; ``storage_dtypes`` names what is stored)."""
        return {layer: np.dtype(storage.read_dtype(self.array(layer), as_torch=False)) for layer in self.layers}

    @cached_property
    def storage_dtypes(self) -> dict[str, str]:
        """Each layer's storage dtype (``--dtype``): ``float16``, ``bfloat16`` or ``float32``."""
        return {layer: storage.stored_name(self.array(layer)) for layer in self.layers}

    @cached_property
    def labels(self) -> np.ndarray:
        """(N,) int64, -1 where the data had none; in a token store (N_docs,): labels are per document."""
        if self.kind is Kind.TOKENS:
            return self._reads.whole("labels")
        every = range(self.num_chunks)
        return self._reads.checked("labels", "labels", every, lambda: self._placed("labels")[:])

    @cached_property
    def keys(self) -> np.ndarray:
        """(N,) str: where each row came from (path relative to the root, ``shard/key``, ``file/row``); in a
        token store (N_docs,), the documents' (``file.jsonl/LINE``, ``file.parquet/ROW``, ``split/ROW``); in a
        packed one, the source documents' (``num_source_documents``; its rows' are ``doc``)."""
        if not self.store.has("keys"):
            raise InvalidRequestError(f"{self.path} records no sample keys (written before stores had them)")
        if self.kind is Kind.TOKENS:
            return self._reads.whole("keys")
        return self._reads.checked("keys", "keys", range(self.num_chunks), lambda: self._placed("keys")[:])

    @cached_property
    def text(self) -> TextView:
        """A text store's token-level accessors (offsets, token ids, documents, packing): ``TextView``."""
        if self.kind is Kind.IMAGES:
            raise InvalidRequestError(
                f"{self.path} is an image store; offsets, token ids and documents belong to text stores "
                "(kind tokens or documents): open one of those for features.text"
            )
        return TextView(self, self._reads)

    @property
    def pack(self) -> dict[str, Any] | None:
        """``features.text.pack``; None for an image store (never packed)."""
        return None if self.kind is Kind.IMAGES else self.text.pack

    # The text accessors' old names, kept working and warning: each is the view's (see TextView).
    offsets = _TextAlias[np.ndarray]()
    token_ids = _TextAlias[np.ndarray]()
    load_token_ids = _TextAlias[Callable[[slice], np.ndarray]]()
    special = _TextAlias[np.ndarray]()
    doc = _TextAlias[np.ndarray]()
    doc_position = _TextAlias[np.ndarray]()
    num_documents = _TextAlias[int]()  # offsets' segments: a packed store's contexts (TextView.num_documents)
    num_contexts = _TextAlias[int]()
    num_source_documents = _TextAlias[int]()
    token_documents = _TextAlias[np.ndarray]()
    documents_of = _TextAlias[Callable[[slice | np.ndarray], np.ndarray]]()
    token_positions = _TextAlias[np.ndarray]()
    document = _TextAlias["Callable[..., np.ndarray | torch.Tensor]"]()

    @property
    def classes(self) -> list[str] | None:
        """The data set's class names (ImageFolder folders, ``ClassLabel`` names), indexed by label."""
        classes = self.attrs.get("classes")
        return list(classes) if classes is not None else None

    @cached_property
    def present(self) -> np.ndarray:
        """(N,) bool: the samples whose chunk is marked done; use it as an ``index`` to read only those."""
        return np.repeat(self._reads.done, self.chunk_size)[: self.num_samples]

    @cached_property
    def valid(self) -> np.ndarray:
        """(N,) bool: present samples that have features; an image that could not be decoded under
        ``--skip-bad-images`` is stored as NaN with valid False. In a token store (N_docs,): the documents
        that could be read (one that could not has no tokens)."""
        if self.kind is Kind.TOKENS:
            return self._reads.whole("valid")
        every = range(self.num_chunks)
        return self._reads.checked("valid", "valid", every, lambda: self._placed("valid")[:]) & self.present

    def __len__(self) -> int:
        return self.num_samples

    def array(self, layer: str) -> zarr.Array:
        """The layer's lazy zarr array, (N, *shape); unwritten samples read as NaN."""
        if layer not in self.layers:  # read once: ``attrs`` copies the store's attributes at every call
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
        the whole full-size layer. ``dtype=None`` keeps the stored dtype; a bfloat16 layer reads as
        ``torch.bfloat16`` with ``as_torch=True`` (the stored bits, no conversion) and as float32 in numpy,
        which has no bfloat16. Returns numpy, or torch with ``as_torch=True``.
        """
        array = self.array(layer)
        rows = _normalize(index, self.num_samples)
        reduce = _pool(pool, self.layout(layer))
        if dtype == storage.BFLOAT16 and not as_torch:
            raise InvalidRequestError(f"load({layer!r}, dtype='bfloat16'): numpy has no bfloat16; pass as_torch=True")
        pooled = (self.attrs.get("pools") or {}).get(layer) if reduce is not None else None
        shape = _reduced_shape(layer, self.shapes[layer], reduce, pool, pooled)
        out = _empty((rows.count, *shape), dtype or storage.read_dtype(array, as_torch))
        blocks = list(_blocks(rows, array, self.chunk_size))
        name = f"features/{layer}"
        values = self._reads.checked(
            name,
            f"layer '{layer}'",
            _touched(rows, self.chunk_size),
            lambda: _load_into(self._reads.placed(name, array), rows, reduce, out, blocks),
        )
        if as_torch and isinstance(values, np.ndarray):
            import torch

            return torch.from_numpy(values)
        return values

    def _placed(self, name: str) -> zarr.Array:
        """Array ``name`` of the store, each of its chunk objects checked for its place (``placed.py``)."""
        return self._reads.placed(name, self.store.array(name))

    def follow(self, poll: float = 1.0) -> Iterator[tuple[int, int, int]]:
        """(chunk, start, stop) of each chunk of a store that a job is still writing (opened with
        ``allow_partial=True``), as the job marks it done, each once, until the store says complete: rows
        ``start:stop`` of every array then read as any read does, checked (a killed job leaves it waiting;
        its resume is followed through). ``present`` is of the open, not updated."""
        for new, _ in follow_done([self], range(self.num_chunks), poll):
            for chunk in new:
                yield (chunk, *self._reads.plan.bounds(chunk))

    def latents(self, layer: str, rows: slice = slice(None), *, as_torch: bool = False, dtype: str = "float32") -> Any:
        """Layer ``layer``'s SAE codes of the rows ``rows`` picks (consecutive) as a (rows, d_sae) CSR matrix:
        scipy's ``csr_array``, or ``torch.sparse_csr_tensor`` with ``as_torch=True``, values in ``dtype``
        (every stored float16 exactly in float32). ``features.latent(layer, i)`` reads one latent dense;
        ``features.stats("latents/" + layer)`` each latent's statistics (``extract.read.latents``)."""
        return sae_codes.codes_of(self, layer).matrix(rows, as_torch, dtype)

    def codes(self, layer: str, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s codes of the consecutive rows ``rows``, as stored: (indices (n, k) int32, -1
        past a row's codes; values (n, k)). For ``BLOCK@router``, each token's experts and their weights."""
        start, stop, _ = rows.indices(self.num_samples)
        return sae_codes.codes_of(self, layer).read(start, stop)

    def latent(self, layer: str, index: int) -> np.ndarray:
        """(N,) float32: latent ``index`` of layer ``layer``'s SAE codes on every row, 0 where it is not
        active; read chunk by chunk, never the whole code matrix."""
        return sae_codes.codes_of(self, layer).latent(index)

    def stats(self, layer: str) -> dict[str, Any]:
        """Statistics of ``layer`` (``latents/<layer>``: of its SAE codes, ``LatentCodes.stats``) over the valid rows of every done chunk, merged from the rows the writer
        recorded with each chunk (no data read): ``count`` (rows counted; NaN rows of invalid samples and
        empty documents are not), ``mean`` and ``std`` (population) of each value, (F,) float64,
        ``mean_norm`` (mean L2 norm of a row), ``max_abs`` and ``scaling_factor`` = sqrt(F) / mean_norm,
        SAELens's activation normalization factor. Layers stored as 1-D rows (text layers, pooled image
        layers) have statistics of their rows; layers kept whole in a known layout (a ViT block or a conv
        map under ``--pool none``), of their positions' channel vectors (F = C, every (image, patch) a
        row, as ``TokenStream`` streams them)."""
        if layer.startswith(f"{sae_codes.LATENTS}/") and layer not in self.attrs["layers"]:
            return sae_codes.codes_of(self, layer.partition("/")[2]).stats()
        array = self.array(layer)
        known = self.store.stats_layers()
        if known is None:
            raise InvalidRequestError(
                f"{self.path} was written before stores kept statistics; compute them from load({layer!r}), "
                "or extract into a new --out to have them"
            )
        if layer not in known:
            shape = ", ".join(map(str, array.shape[1:]))
            raise InvalidRequestError(
                f"{self.path}: layer '{layer}' is stored as ({shape}) per row and statistics are kept for 1-D rows "
                "and for layers with a known layout only (or the store predates per-position statistics); "
                "extract it with --pool or --layout to have them, or compute them from load()"
            )
        _, recorded = self._reads.chunk_rows(f"{STATS}/{layer}", f"statistics of layer '{layer}'")
        rows = self.store.array(f"{STATS}/{layer}")
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
        reduce = _pool(pool, self.layout(layer))
        pooled = (self.attrs.get("pools") or {}).get(layer) if reduce is not None else None
        return _reduced_shape(layer, self.shapes[layer], reduce, pool, pooled, call)

    def load_labels(self, index: Index = None) -> np.ndarray:
        """(n,) int64 labels of the samples ``index`` picks, read now (``labels`` is read once and kept:
        a store still being written gains labels as its chunks are written). In a token store ``index``
        picks documents."""
        if self.kind is Kind.TOKENS:
            picked = _normalize(index, self.text.num_documents)
            labels = self.labels
            if picked.sorted_rows is None:
                return labels[picked.start : picked.stop]
            chosen = labels[picked.sorted_rows]
            return chosen[picked.inverse] if picked.inverse is not None else chosen
        rows = _normalize(index, self.num_samples)
        selection = slice(rows.start, rows.stop) if rows.sorted_rows is None else rows.sorted_rows
        touched = _touched(rows, self.chunk_size)
        labels = self._reads.checked("labels", "labels", touched, lambda: self._placed("labels")[selection])
        return labels[rows.inverse] if rows.inverse is not None else labels

    def __repr__(self) -> str:
        layers = ", ".join(f"{layer} {list(self.shapes[layer])} {self.storage_dtypes[layer]}" for layer in self.layers)
        state = "complete" if self.complete else f"{int(self.present.sum())}/{self.num_samples} present"
        if self.kind is Kind.TOKENS:
            pack = self.pack
            if pack is not None:  # its samples are contexts of T tokens; the documents are those packed into them
                rows = (
                    f"{self.num_samples} tokens in {self.text.num_contexts} contexts of {pack['context_length']}, "
                    f"from {self.text.num_source_documents} documents"
                )
            else:
                rows = f"{self.num_samples} tokens of {self.text.num_documents} documents"
            return f"Features({str(self.path)!r}, {rows}, {state}; {layers})"
        rows = f"N={self.num_samples}" if self.kind is Kind.IMAGES else f"{self.num_samples} documents"
        return f"Features({str(self.path)!r}, {rows}, {state}; {layers})"


def follow_done(opened: Sequence[Features], chunks: Iterable[int], poll: float) -> Iterator[tuple[list[int], bool]]:
    """``chunks`` of the stores ``opened`` (one job's, or stores of the same tokens) as their jobs mark them
    done in every store: (the chunks newly done, whether they are the last), each chunk once, until every
    store says complete; looks every ``poll`` seconds (a listing of ``done`` and a read of the status, the
    status first: a store says complete only once every chunk is done, so the listing after it has them all).
    Each store's checked reads take the new chunks as done (their lost objects, their digests)."""
    waiting = set(chunks)
    while waiting:
        complete = all(f.store.attrs.get("status") == "complete" for f in opened)
        done = set.intersection(*(f.store.integrity.stored_chunks("done", waiting) for f in opened))
        if done:
            new = sorted(done)
            for features in opened:
                features._reads.follow(new)
            waiting -= done
            yield new, not waiting
        elif complete:
            raise StoreDamagedError(
                f"{opened[0].path} says complete, but chunks {sorted(waiting)[:5]} are not done: run "
                f"`python -m extract.verify {opened[0].path} --repair`, then the job's command again"
            )
        else:
            time.sleep(poll)


def open_features(path: str | os.PathLike[str] | Location, *, allow_partial: bool = False) -> Features:
    """Open the store at ``path`` (a path, a URL on object storage such as ``s3://...``, or a
    ``Location``) for reading.

    A store whose job has not finished (status "running": still running, or interrupted) is refused
    unless ``allow_partial=True``; then ``features.present`` tells which samples were written, and
    the others read as NaN (labels -1).
    """
    location = locate(path)
    store = FeatureStore.open(location, mode="r")
    features = Features(location.place, store)
    if not features.complete and not allow_partial:
        done = int(store.done_flags().sum())
        job = live_job(location)
        if job is not None:  # rerunning would be refused as busy: the job is still writing (or finishing)
            raise StoreBusyError(
                f"{location} is being written by a job ({job}; {done} of {features.num_chunks} chunks written): "
                "wait for the job to finish, or open it now with allow_partial=True and read features.present"
            )
        raise StoreDamagedError(
            f"{location} is not complete (status '{features.attrs.get('status')}', {done} of {features.num_chunks} "
            "chunks written): rerun the same extract command to finish it, or open it with "
            "allow_partial=True and read features.present"
        )
    return features
