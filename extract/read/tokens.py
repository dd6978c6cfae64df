"""A torch ``IterableDataset`` that streams a token store's rows in shuffled batches for training on
activations (an SAE, a probe): whole chunks read in windows by background threads, rows shuffled
across each window, every kept token exactly once per epoch over all ranks and DataLoader workers."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import ExcludeRuleError, ExtractError
from ..names import Kind
from ..store import dtypes as storage
from ..store.chunks import Plan
from ..store.location import check_not_forked, locate
from .dataset import _rank_and_world_size
from .features import Features, _read, open_features

Batch = torch.Tensor | dict[str, torch.Tensor]

# high_norm's median is taken over the rows of every chunk of a store of at most this many chunks, else of
# this many chunks drawn with np.random.default_rng(0) (the same on every rank, worker and epoch)
NORM_SAMPLE_CHUNKS = 32

RULE_FORMS = "'special', 'first:K' (K a positive int) or 'high_norm:M' (M a positive number)"


@dataclass(frozen=True)
class _Rules:
    special: bool = False
    first: int = 0  # drop positions < first of each document (context)
    high_norm: float | None = None  # drop rows whose norm exceeds high_norm x the median norm


def _parse_rules(exclude: str | Sequence[str]) -> _Rules:
    rules = [exclude] if isinstance(exclude, str) else list(exclude)
    special, first, high_norm = False, 0, None
    for rule in rules:
        name, _, value = rule.partition(":") if isinstance(rule, str) else ("", "", "")
        try:
            if name == "special" and not value:
                special = True
                continue
            if name == "first" and int(value) > 0:
                first = max(first, int(value))
                continue
            if name == "high_norm" and float(value) > 0 and np.isfinite(float(value)):
                high_norm = float(value) if high_norm is None else min(high_norm, float(value))
                continue
        except ValueError:
            pass
        raise ExcludeRuleError(f"exclude rule {rule!r} is not one of {RULE_FORMS}")
    return _Rules(special, first, high_norm)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ExtractError(f"dtype {dtype!r} is not a torch floating dtype (use float32, float16, bfloat16, float64)")
    return value


@dataclass
class _Buffers:
    """What a pass reads into, kept for the next epoch's: two windows of ``dtype`` rows per layer, and
    one stored-dtype chunk per reading thread for the chunks that are converted (taken from ``scratch``
    by a task, put back when it is done)."""

    windows: list[dict[str, torch.Tensor]]
    scratch: queue.SimpleQueue

    @classmethod
    def make(cls, shapes: dict[str, tuple[int, int]], dtype: torch.dtype, threads: int) -> _Buffers:
        scratch: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, threads)):
            scratch.put({})  # layer -> its chunk, made at first use
        return cls([{layer: _alloc(shape, dtype) for layer, shape in shapes.items()} for _ in range(2)], scratch)


@dataclass
class _Window:
    """A window read: the rows kept (window-local) and every row's global index."""

    keep: np.ndarray  # (kept,) int64, positions in the window's buffers
    rows: np.ndarray  # (window rows,) int64, global token rows


class TokenStream(IterableDataset):
    """Shuffled batches of a token store's rows: ``(batch, D)`` tensors of ``dtype`` for one layer
    (``layers`` a str), a ``{layer: tensor}`` dict for several (a list); with ``return_index=True``
    ``(values, rows)``, ``rows`` the (batch,) int64 global token rows (``Features.documents_of`` and
    ``token_positions`` say where they come from). Use it as ``DataLoader(stream, batch_size=None,
    num_workers=k)``: it batches itself.

    An epoch yields every token that ``exclude`` keeps exactly once, over all ranks and workers. The
    epoch's chunk order is a permutation seeded by ``(seed, epoch)``, the same on every rank; rank r
    takes every ``world_size``-th chunk of it (as ``ChunkShuffleSampler`` does; ``rank`` and
    ``world_size`` default to those of an initialized process group), and DataLoader worker w of W
    every W-th of the rank's chunks. Each worker reads its chunks ``window`` at a time, permutes the
    window's kept rows and emits full batches, carrying the rest into the next window; its last
    partial batch is emitted unless ``drop_last``, so with W workers a rank may end with up to W short
    batches. Ranks may get a chunk more or less than others: stop all at the shortest or use DDP's
    ``join()``. ``set_epoch(e)`` reshuffles deterministically; call it before iterating (a DataLoader
    with ``persistent_workers=True`` would keep the workers' old epoch).

    ``threads`` background threads read and decode the next window (whole chunks, through zarr, which
    checks each object's checksum) while the consumer takes batches from this one, and convert it to
    ``dtype``; ``threads=0`` reads in the consumer. Memory per worker is two windows of ``dtype`` rows
    (``2 x window x chunk_size x D`` per layer) plus a stored chunk per thread. zarr's decode and the
    conversion release the GIL, so ``num_workers=0`` already uses several cores; DataLoader workers add a
    copy of every batch through shared memory, which on a small machine costs more than the decode
    (``benchmarks/token_stream.py``).

    ``exclude`` rules (a str or a sequence of them) drop rows:

    - ``"special"``: the tokenizer's special tokens (``Features.special``: BOS, EOS, CLS, SEP, and the
      BOS and separators packing inserted);
    - ``"first:K"``: positions 0..K-1 of every document (every context of a packed store), the
      attention sinks;
    - ``"high_norm:M"``: rows whose L2 norm (computed in float32 from the stored values) exceeds M x
      the layer's median norm; with several layers a row is dropped if it does so in any of them.
      The median (``median_norms``, per layer) is of the rows the other rules keep, over every chunk
      of a store of at most ``NORM_SAMPLE_CHUNKS`` (32) chunks, else over 32 chunks drawn with
      ``np.random.default_rng(0)``: computed once, when the stream is made, the same for every
      rank, worker and epoch.

    The store is opened once per process that iterates: only the path is pickled to DataLoader
    workers, never an open zarr handle. It must be a complete token store (``kind`` tokens).
    """

    def __init__(
        self,
        store: str | Path,
        layers: str | Sequence[str],
        batch_size: int,
        *,
        window: int = 8,
        exclude: str | Sequence[str] = (),
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        dtype: str | torch.dtype = "float32",
        drop_last: bool = False,
        threads: int = 2,
        return_index: bool = False,
    ) -> None:
        if batch_size < 1 or window < 1 or threads < 0:
            raise ValueError(
                f"batch_size and window must be positive, threads 0 or more; got {batch_size}, {window}, {threads}"
            )
        self.path = store
        self.single = isinstance(layers, str)
        self.layers = [layers] if isinstance(layers, str) else list(layers)
        if not self.layers:
            raise ValueError("layers: name at least one layer")
        self.batch_size, self.window, self.threads = batch_size, window, threads
        self.seed, self.epoch, self.drop_last, self.return_index = seed, 0, drop_last, return_index
        self.dtype = _torch_dtype(dtype)
        self.rules = _parse_rules(exclude)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        self.location = locate(store)  # parsed once: every process that iterates opens it
        features = open_features(self.location)
        if features.kind is not Kind.TOKENS:
            raise ExtractError(
                f"{features.path} is not a token store (kind '{features.kind}'); TokenStream reads token "
                "stores' rows: read this one with FeatureDataset"
            )
        for layer in self.layers:
            if len(features.array(layer).shape) != 2:  # an unknown layer fails here, with the valid names
                raise ExtractError(f"{features.path}: layer '{layer}' is not stored as (tokens, D) rows")
        self.num_tokens, self.chunk_size = features.num_samples, features.chunk_size
        self.num_chunks = features.num_chunks
        self.median_norms: dict[str, float] | None = None
        self._features: Features | None = features
        self._spare: list[_Buffers] = []  # the last pass's buffers, for the next one in this process
        if self.rules.high_norm is not None:
            self.median_norms = self._median_norms(features)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_features=None, _spare=[])
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _open(self) -> Features:
        check_not_forked(self.location)
        if self._features is None:
            self._features = open_features(self.location)
        return self._features

    def _bounds(self, chunk: int) -> tuple[int, int]:
        return Plan(self.num_tokens, self.chunk_size).bounds(int(chunk))

    def chunks(self, worker: int = 0, num_workers: int = 1) -> np.ndarray:
        """The chunks this rank's worker ``worker`` of ``num_workers`` reads this epoch, in reading order."""
        order = np.random.default_rng((self.seed, self.epoch)).permutation(self.num_chunks)
        return order[self.rank :: self.world_size][worker::num_workers]

    def _kept_by_position(self, features: Features, chunk: int) -> np.ndarray:
        """The rows of chunk ``chunk`` that ``special`` and ``first:K`` keep."""
        start, stop = self._bounds(chunk)
        keep = np.ones(stop - start, dtype=bool)
        if self.rules.special:
            special = features.store.array("special")
            flags = features._reads.checked("special", "special tokens", [chunk], lambda: special[start:stop])
            keep &= ~np.asarray(flags, dtype=bool)
        if self.rules.first:
            offsets = features.offsets
            rows = np.arange(start, stop)
            keep &= rows - offsets[np.searchsorted(offsets, rows, side="right") - 1] >= self.rules.first
        return keep

    def _read_stored(self, features: Features, layer: str, chunk: int, into: np.ndarray) -> np.ndarray:
        """Chunk ``chunk`` of ``layer`` as stored, into the first rows of ``into``; a missing or damaged
        object is an error naming it (``Features``' own check)."""
        start, stop = self._bounds(chunk)
        array = features.array(layer)
        return features._reads.checked(
            f"features/{layer}", f"layer '{layer}'", [chunk], lambda: _read(array, slice(start, stop), into)
        )

    def _median_norms(self, features: Features) -> dict[str, float]:
        if self.num_chunks <= NORM_SAMPLE_CHUNKS:
            sample = np.arange(self.num_chunks)
        else:
            sample = np.sort(np.random.default_rng(0).choice(self.num_chunks, NORM_SAMPLE_CHUNKS, replace=False))
        norms: dict[str, list[np.ndarray]] = {layer: [] for layer in self.layers}
        for chunk in sample:
            start, stop = self._bounds(chunk)
            keep = self._kept_by_position(features, chunk)
            for layer in self.layers:
                array = features.array(layer)
                values = self._read_stored(
                    features, layer, chunk, np.empty((stop - start, array.shape[1]), array.dtype)
                )
                norms[layer].append(_norms(storage.as_tensor(values, storage.is_bfloat16(array)))[keep])
        medians = {layer: float(np.median(np.concatenate(found))) for layer, found in norms.items()}
        if any(not np.isfinite(m) for m in medians.values()):
            raise ExtractError(
                f"{features.path}: no rows to take the median norm of for high_norm (every row is excluded)"
            )
        return medians

    def __iter__(self) -> Iterator[Batch | tuple[Batch, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        chunks = self.chunks(worker, num_workers)
        windows = [chunks[i : i + self.window] for i in range(0, len(chunks), self.window)]
        if not windows:
            return
        features = self._open()
        # what the threads share, made here once rather than raced for: the listing of missing objects,
        # the arrays, the offsets
        features._reads.lost  # noqa: B018
        if self.rules.special:
            features.store.array("special")
        if self.rules.first:
            features.offsets  # noqa: B018
        rng = np.random.default_rng((self.seed, self.epoch, 1, self.rank, worker))
        shapes = {layer: (self.window * self.chunk_size, features.array(layer).shape[1]) for layer in self.layers}
        spare = self._spare.pop() if self._spare else None  # another pass in this process takes none
        same = spare is not None and {k: tuple(v.shape) for k, v in spare.windows[0].items()} == shapes
        reuse = same and spare.windows[0][self.layers[0]].dtype == self.dtype
        allocated = spare if reuse else _Buffers.make(shapes, self.dtype, self.threads)
        buffers, scratch = allocated.windows, allocated.scratch
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="extract-stream") if self.threads else None
        carry: tuple[dict[str, torch.Tensor], np.ndarray] | None = None
        try:
            pending = self._submit(pool, features, windows[0], buffers[0], scratch)
            for k in range(len(windows)):
                window = _gather(pending)
                if k + 1 < len(windows):
                    pending = self._submit(pool, features, windows[k + 1], buffers[(k + 1) % 2], scratch)
                values = buffers[k % 2]
                order = rng.permutation(window.keep)
                at = 0
                if carry is not None:
                    take = order[: self.batch_size - len(carry[1])]
                    at = len(take)
                    merged = (
                        {layer: _take(values[layer], take, head=carry[0][layer]) for layer in self.layers},
                        np.concatenate([carry[1], window.rows[take]]),
                    )
                    if len(merged[1]) < self.batch_size:
                        carry = merged
                        continue
                    carry = None
                    yield self._item(*merged)
                while at + self.batch_size <= len(order):
                    take = order[at : at + self.batch_size]
                    at += self.batch_size
                    yield self._item({layer: _take(values[layer], take) for layer in self.layers}, window.rows[take])
                if at < len(order):
                    take = order[at:]
                    carry = ({layer: _take(values[layer], take) for layer in self.layers}, window.rows[take])
            if carry is not None and not self.drop_last:
                yield self._item(*carry)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self._spare = [allocated]

    def _under_norm(self, layer: str, values: torch.Tensor) -> np.ndarray | bool:
        """The rows of ``values`` that ``high_norm`` keeps (True without the rule)."""
        if self.rules.high_norm is None:
            return True
        return _norms(values) <= self.rules.high_norm * self.median_norms[layer]

    def _item(self, values: dict[str, torch.Tensor], rows: np.ndarray) -> Batch | tuple[Batch, torch.Tensor]:
        batch: Batch = values[self.layers[0]] if self.single else values
        return (batch, torch.from_numpy(rows)) if self.return_index else batch

    def _submit(
        self,
        pool: ThreadPoolExecutor | None,
        features: Features,
        chunks: np.ndarray,
        buffers: dict[str, torch.Tensor],
        scratch: queue.SimpleQueue,
    ) -> list[tuple[Future | np.ndarray, int, int]]:
        """Start reading ``chunks`` into ``buffers`` (one task a chunk); (keep mask or its future, start, stop)."""
        tasks = []
        at = 0
        for chunk in chunks:
            start, stop = self._bounds(chunk)
            args = (features, int(chunk), buffers, at, scratch)
            tasks.append((pool.submit(self._fill, *args) if pool is not None else self._fill(*args), start, stop))
            at += stop - start
        return tasks

    def _fill(
        self, features: Features, chunk: int, buffers: dict[str, torch.Tensor], at: int, scratch: queue.SimpleQueue
    ) -> np.ndarray:
        """Read chunk ``chunk`` of every layer into rows ``at:`` of ``buffers``, converted to ``dtype``, and
        return the mask of its rows the rules keep."""
        start, stop = self._bounds(chunk)
        keep = self._kept_by_position(features, chunk)
        for layer in self.layers:
            array = features.array(layer)
            target = buffers[layer][at : at + stop - start]
            direct = storage.numpy_view(target, array)
            if direct is not None:  # zarr decodes straight into the window (bfloat16 too: its bits)
                self._read_stored(features, layer, chunk, direct)
                keep &= self._under_norm(layer, target)
                continue
            mine = scratch.get()  # a thread's chunk: a fresh one each time would page-fault on every chunk
            try:
                stored = mine.get(layer)
                if stored is None:
                    stored = mine[layer] = np.empty((self.chunk_size, array.shape[1]), dtype=array.dtype)
                values = storage.as_tensor(
                    self._read_stored(features, layer, chunk, stored), storage.is_bfloat16(array)
                )
                target.copy_(values)
                keep &= self._under_norm(layer, values)
            finally:
                scratch.put(mine)
        return keep


def _alloc(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in numpy's memory, which asks for transparent huge pages for large arrays:
    filling it page-faults far less than filling a ``torch.empty`` (a batch 2x, a window 5x faster here).
    Any dtype, bfloat16 too: the bytes are numpy's, the view torch's."""
    nbytes = shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _take(values: torch.Tensor, rows: np.ndarray, head: torch.Tensor | None = None) -> torch.Tensor:
    """``values[rows]`` after the rows of ``head`` (if any), a fresh tensor (a batch outlives the window it
    came from). numpy gathers the rows' bytes (any dtype, bfloat16 too), not torch: a torch op starts
    torch's intra-op threads, and with the reading threads busy on a small machine each op waited for
    them (7.6 ms of CPU for a 4096-row ``index_select`` with 2 torch threads on 2 busy cores, 0.5 ms here;
    ``benchmarks/codecs.py``)."""
    skip = 0 if head is None else len(head)
    out = _alloc((skip + len(rows), values.shape[1]), values.dtype)
    into = _row_bytes(out)
    if head is not None:
        into[:skip] = _row_bytes(head)
    np.take(_row_bytes(values), rows, axis=0, out=into[skip:], mode="clip")  # rows are in range: no "raise" copy
    return out


def _row_bytes(values: torch.Tensor) -> np.ndarray:
    """A (rows, D) tensor's rows as (rows, D x itemsize) bytes, the same memory."""
    return values.view(torch.uint8).numpy()


def _norms(values: torch.Tensor) -> np.ndarray:
    """(n,) float32 L2 norms of the rows, computed in float32."""
    return torch.linalg.vector_norm(values, dim=1, dtype=torch.float32).numpy()


def _gather(tasks: list[tuple[Future | np.ndarray, int, int]]) -> _Window:
    """Wait for a window's chunks: its kept rows (window-local) and global rows."""
    masks = [task.result() if isinstance(task, Future) else task for task, _, _ in tasks]
    rows = np.concatenate([np.arange(start, stop) for _, start, stop in tasks])
    return _Window(np.flatnonzero(np.concatenate(masks)), rows)
