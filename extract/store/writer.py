"""The background writer: staged batches in, whole chunks out, ``done`` marked after each write."""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import CastOverflowError, LockLostError, WriterError
from ..names import Kind
from . import dtypes, latents, stats
from .chunks import Plan, chunk_segments
from .location import described, from_object_storage
from .store import FeatureStore


class Slot(Protocol):
    """One staged batch: a host buffer per layer (``extract.capture.staging.Slot`` is one) and, with
    ``--sae``, the statistics of its rows of each chunk per layer (objects with a ``numpy()``:
    ``LatentStats``), and the statistics of whole blocks of each chunk's rows computed on the device
    (``block_stats``: per layer, per chunk, objects with a ``numpy()``: ``BlockStats``). The writer names
    only what it reads, so that the store imports nothing of capture."""

    buffers: dict[str, torch.Tensor]
    latent_stats: dict[str, dict[int, Any]]
    block_stats: dict[str, dict[int, Any]]


class Staging(Protocol):
    """The pool the staged batches come from (``extract.capture.staging.HostStaging``): its dtype, its
    number of slots, and a slot's ``ready`` (a wait for its copies, raising ``CastOverflowError`` where
    the cast to the storage dtype made an inf) and ``release`` (back to the pool)."""

    dtype: torch.dtype
    num_slots: int

    def ready(self, slot: Any) -> None: ...

    def release(self, slot: Any) -> None: ...


def _one_thread() -> None:
    """Keep torch's work on this thread to itself (the statistics' conversions): its intra-op threads
    would split a block between cores that the other writer threads and the forward already use, and
    spin at every barrier (the writer's CPU per GB drops by a third). Per thread under OpenMP: the
    forward's thread keeps its own setting."""
    torch.set_num_threads(1)


def _described(error: BaseException) -> str:
    """One line: obstore's errors carry a many-line dump of the request after their first line."""
    return described(error) if from_object_storage(error) else repr(error)


class _OpenChunk:
    def __init__(
        self,
        plan: Plan,
        chunk: int,
        shapes: Mapping[str, tuple[int, ...]],
        dtype: np.dtype,
        codes: Mapping[str, tuple[int, int, str]],
        spare: dict[str, list[np.ndarray]],
    ) -> None:
        self.chunk = chunk
        self.start, self.stop = plan.bounds(chunk)
        rows = self.stop - self.start
        self.features = {}
        for name, shape in shapes.items():
            kept = spare.get(name)
            if kept and len(kept[-1]) == rows:  # every chunk but the store's last has the plan's rows
                self.features[name] = kept.pop()
            else:
                self.features[name] = np.empty((rows, *shape), dtype=dtype)
        self.codes = {
            layer: latents.ChunkCodes(
                np.full((rows, k), -1, np.int32), np.zeros((rows, k), values_dtype), latents.empty_stats(d_sae)
            )
            for layer, (k, d_sae, values_dtype) in codes.items()
        }
        self.labels = np.full(rows, -1, dtype=np.int64)
        self.valid = np.zeros(rows, dtype=bool)
        self.filled = 0
        self.columns: dict[str, np.ndarray] | None = None  # a token chunk's token rows (``submit_columns``)
        self.partials: dict[str, stats.Partial] = {}  # statistics of blocks computed on the device

    @property
    def full(self) -> bool:
        return self.filled == self.stop - self.start


# a staged batch (slot, rows, labels, valid), or a token chunk's columns (chunk, {name: rows})
_Item = tuple[Slot | None, np.ndarray, np.ndarray, np.ndarray] | tuple[int, dict[str, np.ndarray]]


class ChunkWriter:
    """Consumes ``(slot, indices, labels, valid)`` on a thread, fills whole chunks and writes each one.

    Writes (encode + store) run on ``threads`` worker threads with at most ``threads`` chunks in
    flight, so host memory is bounded by the slot pool plus a few chunks. Any error is kept and
    re-raised in the caller's thread by ``check()``, ``submit()`` and ``close()``. Rows of invalid
    samples (undecodable images) are stored as NaN; stored infinities are counted per layer in
    ``infinite`` (the model's own: a cast that would make one stops the job in ``staging.ready``,
    ``CastOverflowError``). ``write_chunk`` also records each chunk's statistics row of every 1-D layer
    and every layer kept whole in a known layout (per position, ``stats.py``), on the same threads.

    ``codes`` (layer -> (k, d_sae, values dtype)) are the ``--sae`` (and ``@router``) layers: a slot also holds their codes (buffers
    ``latents/<layer>/indices`` and ``values``) and, in ``latent_stats[layer][chunk]``, the statistics of
    the batch's rows of each chunk, which are merged into the chunk's (``latents.py``).
    """

    def __init__(
        self,
        store: FeatureStore,
        staging: Staging,
        plan: Plan,
        shapes: Mapping[str, tuple[int, ...]],
        threads: int = 1,
        codes: Mapping[str, tuple[int, int, str]] | None = None,
    ) -> None:
        self.store, self.staging, self.plan = store, staging, plan
        self.codes = dict(codes or {})
        self.rows_only = store.kind.text  # text stores: labels and valid were written at creation
        self.needs_columns = store.kind is Kind.TOKENS  # a token chunk is written with its token rows
        self.shapes = dict(shapes)
        self.dtype = dtypes.host_dtype(staging.dtype)  # bfloat16: its bits, uint16
        self.threads = threads
        self.chunks_written = 0
        self.infinite: dict[str, int] = dict.fromkeys(self.shapes, 0)
        self._queue: queue.Queue[_Item | None] = queue.Queue(staging.num_slots)
        self._open: dict[int, _OpenChunk] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="extract-write", initializer=_one_thread)
        self._inflight: deque[tuple[Future[dict[str, int]], _OpenChunk]] = deque()
        # the feature buffers of written chunks, filled again by the next ones: a fresh 16 MiB array per
        # chunk and layer is faulted in page by page (kernel time, as much as writing it to the page cache)
        self._spare: dict[str, list[np.ndarray]] = {name: [] for name in self.shapes}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="extract-writer", daemon=True)
        self._thread.start()

    def check(self) -> None:
        # not failures of the writer: said as they are (a lost lock, exit 1; a cast to inf, exit 2)
        if isinstance(self._error, (LockLostError, CastOverflowError)):
            raise self._error
        if self._error is not None:
            raise WriterError(f"writing the store failed: {_described(self._error)}") from self._error

    def submit(self, slot: Slot, indices: torch.Tensor, labels: torch.Tensor, valid: np.ndarray) -> None:
        self._put((slot, indices.numpy().astype(np.int64), labels.numpy().astype(np.int64), valid))

    def submit_rows(self, slot: Slot | None, rows: np.ndarray) -> None:
        """Rows ``rows`` (ascending, not necessarily contiguous) of the staged batch in ``slot``; no slot:
        rows without features (empty documents), stored as NaN."""
        rows = np.asarray(rows, dtype=np.int64)
        self._put((slot, rows, np.full(len(rows), -1, np.int64), np.ones(len(rows), bool)))

    def submit_columns(self, chunk: int, columns: dict[str, np.ndarray]) -> None:
        """A token chunk's token rows (``token_ids``, ``special``...), written with its features."""
        self._put((chunk, columns))

    def _put(self, item: _Item) -> None:
        while True:
            self.check()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self, complete: bool = True) -> None:
        """Wait for every submitted batch to be written; raise the writer's error if any.

        ``complete=False`` (an interrupted run) drops chunks that never filled up instead of
        failing: they stay not-done and a rerun computes them.
        """
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._pool.shutdown(wait=True)
        self.check()
        if self._open and complete:
            raise WriterError(f"chunks {sorted(self._open)} were never completed")
        self._open.clear()

    def abort(self) -> None:
        """Stop without writing partial chunks (used when the forward loop fails)."""
        self._error = self._error or RuntimeError("aborted")
        self._drain()
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        _one_thread()
        try:
            while (item := self._queue.get()) is not None:
                if self._error is not None:
                    if len(item) == 4 and item[0] is not None:
                        self.staging.release(item[0])
                    continue
                if len(item) == 2:
                    self._columns(*item)
                else:
                    self._consume(*item)
            while self._inflight:
                self._finish(self._inflight.popleft())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by check()
            self._error = e
            self._drain()

    def _drain(self) -> None:
        """Hand the slots of queued batches back to the pool (their chunks will not be written)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                return
            if len(item) == 4 and item[0] is not None:
                self.staging.release(item[0])

    def _consume(self, slot: Slot | None, indices: np.ndarray, labels: np.ndarray, valid: np.ndarray) -> None:
        nan = dtypes.nan(self.dtype)
        try:
            if slot is not None:
                self.staging.ready(slot)  # raises CastOverflowError for a batch the cast turned into inf
            for chunk, first, end in chunk_segments(indices, self.plan.chunk_size):
                open_chunk = self._opened(chunk)
                rows, at_first = end - first, int(indices[first]) - open_chunk.start
                at: slice | np.ndarray = slice(at_first, at_first + rows)  # contiguous: a slice copies faster
                if int(indices[end - 1]) - int(indices[first]) != rows - 1:  # a text batch keeps this rank's tokens
                    at = indices[first:end] - open_chunk.start
                for name, values in open_chunk.features.items():
                    values[at] = dtypes.host_values(slot.buffers[name][first:end]) if slot is not None else nan
                if slot is not None:
                    self._codes(open_chunk, slot, at, first, end)
                    self._block_stats(open_chunk, slot)
                open_chunk.labels[at] = labels[first:end]
                open_chunk.valid[at] = valid[first:end]
                open_chunk.filled += rows
                self._write_if_whole(open_chunk)
        finally:
            if slot is not None:
                self.staging.release(slot)

    def _codes(self, open_chunk: _OpenChunk, slot: Slot, at: slice | np.ndarray, first: int, end: int) -> None:
        """The batch's rows first:end of every ``--sae`` layer's codes (rows without features keep the
        padding: no latent), and the statistics of those rows, into the chunk."""
        for layer, part in open_chunk.codes.items():
            part.indices[at] = slot.buffers[latents.indices_path(layer)][first:end].numpy()
            part.values[at] = slot.buffers[latents.values_path(layer)][first:end].numpy()
            part.stats = latents.merge(part.stats, slot.latent_stats[layer][open_chunk.chunk].numpy())

    def _block_stats(self, open_chunk: _OpenChunk, slot: Slot) -> None:
        """The blocks of this chunk whose statistics the device computed from the batch (``stats.Partial``)."""
        for layer, parts in getattr(slot, "block_stats", {}).items():
            part = parts.get(open_chunk.chunk)
            if part is None:
                continue
            part = part.numpy()
            features = part["sums"].shape[1]
            positions = int(np.prod(self.shapes[layer])) // features
            rows = (open_chunk.stop - open_chunk.start) * positions
            partial = open_chunk.partials.get(layer)
            if partial is None:
                blocks = -(-rows // stats.BLOCK_ROWS)
                partial = open_chunk.partials[layer] = stats.Partial(blocks, features)
            partial.add(part)

    def _opened(self, chunk: int) -> _OpenChunk:
        if chunk not in self._open:
            self._open[chunk] = _OpenChunk(self.plan, chunk, self.shapes, self.dtype, self.codes, self._spare)
        return self._open[chunk]

    def _columns(self, chunk: int, columns: dict[str, np.ndarray]) -> None:
        open_chunk = self._opened(chunk)
        open_chunk.columns = columns
        self._write_if_whole(open_chunk)

    def _write_if_whole(self, chunk: _OpenChunk) -> None:
        if chunk.full and (chunk.columns is not None or not self.needs_columns):
            self._write(self._open.pop(chunk.chunk))

    def _write(self, chunk: _OpenChunk) -> None:
        invalid = ~chunk.valid
        if invalid.any():  # their rows become NaN below, after the device saw them: the host recomputes all
            chunk.partials.clear()
        counted = set(self.store.stats_layers() or ())  # their statistics count the infinities
        for name, values in chunk.features.items():
            if invalid.any():  # rows of text stores are all valid here (empty documents come as NaN)
                values[invalid] = dtypes.nan(values.dtype)
            if name not in counted:
                self.infinite[name] += dtypes.count_infinite(values)
        while len(self._inflight) >= self.threads:
            self._finish(self._inflight.popleft())
        self._inflight.append((
            self._pool.submit(
                self.store.write_chunk,
                chunk.chunk,
                chunk.start,
                chunk.stop,
                chunk.features,
                None if self.rows_only else chunk.labels,
                None if self.rows_only else chunk.valid,
                chunk.columns,
                chunk.codes,
                chunk.partials,
            ),
            chunk,
        ))  # fmt: skip

    def _finish(self, written: tuple[Future[dict[str, int]], _OpenChunk]) -> None:
        write, chunk = written
        for name, infinite in write.result().items():
            self.infinite[name] += infinite
        self.chunks_written += 1
        for name, values in chunk.features.items():
            self._spare[name].append(values)
