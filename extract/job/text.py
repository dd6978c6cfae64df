"""Text jobs' batches: documents sorted by length within a window of chunks and packed to a token
budget, each batch with the rows this rank stores.

Rows are tokens in a token store and documents in a document store (pooled). A rank owns whole
chunks of rows; a document that straddles two ranks' chunks runs on both, and each keeps only the
rows of its own chunks (``TextBatch.flat`` picks them, in the store's order).

The batches are a pure function of the job. Windows are fixed by global chunk index (window w is
chunks ``w*W .. w*W + W - 1``), a document belongs to the window of its first row, and a window's
documents are sorted and grouped from their lengths alone. A rank runs every batch of a window that
holds a row of its chunks, whole: so a document's neighbours and padded length, which decide the
rounding of every matmul, never depend on the process count or on which chunks are pending.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..data.tokenize import ArrayRows, RowSlice, TokenRows
from ..store.chunks import Plan

WINDOW_CHUNKS = 4  # the fewest chunks whose documents are sorted by length together
WINDOW_BATCHES = 16  # a window holds this many batches' tokens where its memory allows: padding waste
# measured on real docstrings (benchmarks/RESULTS.md): 1.25 tokens computed per token stored with a
# window of 4 chunks of 4096, 1.08 with 16, 1.04 with the whole job
MAX_PADDING: float | None = 1.1  # tokens computed per real token a batch may reach (None: the budget alone)
WINDOW_BYTES = 256 * 2**20  # the most chunk buffers a window keeps open (all its chunks fill together)


def sort_window(chunk_size: int, row_bytes: int, tokens_per_batch: int) -> int:
    """Chunks per sort window: ``WINDOW_BATCHES`` batches' worth of tokens, at least ``WINDOW_CHUNKS``,
    and no more chunks than ``WINDOW_BYTES`` of open chunk buffers. A function of the job alone."""
    wanted = -(-WINDOW_BATCHES * tokens_per_batch // chunk_size)
    fits = max(1, WINDOW_BYTES // max(1, chunk_size * row_bytes))
    return max(WINDOW_CHUNKS, min(wanted, fits))


@dataclass
class TextBatch:
    """One forward: ``input_ids`` and ``attention_mask`` (B, T), right-padded; ``rows`` the store rows
    it fills, ascending; ``flat`` (per token) the positions ``b * T + t`` of those rows in the batch, or
    ``order`` (per document) the batch's documents in store order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: np.ndarray
    flat: torch.Tensor | None = None
    order: torch.Tensor | None = None

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


@dataclass
class _Window:
    """One window's work for a rank: its documents without tokens (document stores), the owned token
    chunks whose token rows it writes, its batches (each a group of documents), and the token rows
    they all need."""

    empty: np.ndarray
    columns: list[int]
    groups: list[np.ndarray]
    tokens: tuple[int, int] | None


@dataclass
class ChunkColumns:
    """A token chunk's ``token_ids`` and ``special`` (packed: ``doc`` and ``doc_position``), written by
    the chunk's owner with its features."""

    chunk: int
    columns: dict[str, np.ndarray]


class TextBatches:
    """What one rank runs for its ``chunks``, window by window (see the module's docstring).

    ``per_token``: rows are tokens and ``offsets`` their documents (packed: contexts); otherwise rows
    are documents, whose tokens ``offsets`` gives. Within a window documents are sorted by length
    (longest first) and packed while B x T stays within ``tokens_per_batch`` (see ``_pack`` for the
    padding limit); a longer document runs alone. The token ids come from ``rows`` (the source,
    tokenized window by window). Yields, per window: each owned chunk's ``ChunkColumns`` (token
    stores), the window's documents without tokens as an array (document stores: their rows are
    NaN), and its batches."""

    def __init__(
        self,
        offsets: np.ndarray,
        rows: TokenRows | ArrayRows,
        plan: Plan,
        chunks: Sequence[int],
        *,
        per_token: bool,
        tokens_per_batch: int,
        pad_id: int,
        window: int = WINDOW_CHUNKS,
    ) -> None:
        self.offsets, self.rows, self.plan = offsets, rows, plan
        self.chunks, self.per_token = sorted(chunks), per_token
        self.tokens_per_batch, self.pad_id = tokens_per_batch, pad_id
        self.window = window
        self._owned = np.zeros(plan.num_chunks + 1, dtype=bool)
        self._owned[self.chunks] = True
        self._owned_before = np.concatenate([[0], np.cumsum(self._owned)])  # owned chunks below k

    @classmethod
    def for_job(
        cls,
        offsets: np.ndarray,
        rows: TokenRows | ArrayRows,
        plan: Plan,
        chunks: Sequence[int],
        *,
        per_token: bool,
        tokens_per_batch: int,
        pad_id: int,
        row_bytes: int,
    ) -> TextBatches:
        """The batches a job runs, sorted within ``sort_window`` chunks (``row_bytes``: a row's stored size).
        Only the token budget bounds a batch: short documents fill it with many sequences (a cap on their
        number made forwards of a few hundred tokens, slower per token on a CPU)."""
        window = sort_window(plan.chunk_size, row_bytes, tokens_per_batch)
        return cls(
            offsets, rows, plan, chunks, per_token=per_token, tokens_per_batch=tokens_per_batch, pad_id=pad_id,
            window=window,
        )  # fmt: skip

    def __iter__(self) -> Iterator[TextBatch | ChunkColumns | np.ndarray]:
        """Window by window; the next window's documents are tokenized on a thread while this one's
        batches run (the batch encoder releases the GIL), so the forward never waits for the tokenizer."""
        plans = (plan for plan in map(self._plan_window, self._windows()) if plan is not None)
        with ThreadPoolExecutor(1, thread_name_prefix="extract-tokenize") as tokenizer:
            ready: tuple[_Window, Future[RowSlice] | None] | None = None
            for plan in plans:
                tokens = None if plan.tokens is None else tokenizer.submit(self.rows.rows, *plan.tokens)
                if ready is not None:
                    yield from self._window(*ready)
                ready = (plan, tokens)
            if ready is not None:
                yield from self._window(*ready)

    def _windows(self) -> list[int]:
        """The windows this rank works in: those of its chunks, and in a token store those where a
        document holding one of its rows begins."""
        size, chunk_size = self.window, self.plan.chunk_size
        windows: set[int] = set()
        for chunk in self.chunks:
            windows.add(chunk // size)
            if self.per_token:
                start = self.plan.bounds(chunk)[0]
                holder = int(np.searchsorted(self.offsets, start, side="right")) - 1
                windows.update(range(int(self.offsets[holder]) // chunk_size // size, chunk // size))
        return sorted(windows)

    def _plan_window(self, window: int) -> _Window | None:
        """What this rank does in ``window``, from the lengths alone: None when nothing."""
        plan, offsets = self.plan, self.offsets
        first_chunk = window * self.window
        last_chunk = min(first_chunk + self.window, plan.num_chunks) - 1
        start, stop = plan.bounds(first_chunk)[0], plan.bounds(last_chunk)[1]
        owned = [k for k in range(first_chunk, last_chunk + 1) if self._owned[k]]
        if self.per_token:  # the documents whose first row is here (an empty one holds no row)
            documents = np.arange(*np.searchsorted(offsets, [start, stop], side="left"))
        else:
            documents = np.arange(start, stop)
        lengths = offsets[documents + 1] - offsets[documents]
        empty = np.zeros(0, np.int64)
        if not self.per_token:
            empty = documents[(lengths == 0) & self._owned[documents // plan.chunk_size]]
        documents, lengths = documents[lengths > 0], lengths[lengths > 0]
        order = np.argsort(-lengths, kind="stable")
        needed = self._needed(documents)[order]
        groups = [documents[order[group]] for group in self._pack(lengths[order]) if needed[group].any()]
        columns = owned if self.per_token else []
        if not groups and not columns:
            return _Window(empty, [], [], None) if len(empty) else None
        ran = np.concatenate(groups) if groups else np.zeros(0, np.int64)
        if self.per_token:  # the owned chunks' rows (a document may begin before them) and the batches'
            token_start = start if columns else int(offsets[ran.min()])
            token_stop = max(stop if columns else 0, int(offsets[ran + 1].max()) if len(ran) else 0)
        else:
            token_start, token_stop = int(offsets[ran.min()]), int(offsets[ran.max() + 1])
        return _Window(empty, columns, groups, (token_start, token_stop))

    def _window(
        self, window: _Window, tokens: Future[RowSlice] | None
    ) -> Iterator[TextBatch | ChunkColumns | np.ndarray]:
        if len(window.empty):
            yield window.empty
        if tokens is None:
            return
        rows = tokens.result()
        for chunk in window.columns:
            yield ChunkColumns(chunk, rows.columns(*self.plan.bounds(chunk)))
        for group in window.groups:
            yield self._batch(group, rows)

    def _needed(self, documents: np.ndarray) -> np.ndarray:
        """Which ``documents`` hold a row of this rank's chunks."""
        if not self.per_token:
            return self._owned[documents // self.plan.chunk_size]
        first = self.offsets[documents] // self.plan.chunk_size
        last = (self.offsets[documents + 1] - 1) // self.plan.chunk_size
        return self._owned_before[last + 1] > self._owned_before[first]

    def _pack(self, lengths: np.ndarray) -> Iterator[slice]:
        """Consecutive groups of the (longest first) lengths within the budget, each closed early where
        the next document would make its padded tokens exceed ``MAX_PADDING`` times its real ones (the
        short documents' tail would otherwise run at the width of its longest)."""
        start = 0
        real = np.concatenate([[0], np.cumsum(lengths)])
        while start < len(lengths):
            longest = int(lengths[start])
            size = max(1, min(self.tokens_per_batch // max(1, longest), len(lengths) - start))
            if MAX_PADDING is not None and size > 1:
                counts = np.arange(1, size + 1)
                padded = counts * longest
                fits = padded <= MAX_PADDING * (real[start + counts] - real[start])
                size = int(np.flatnonzero(fits)[-1]) + 1  # the first group always fits (ratio 1)
            yield slice(start, start + size)
            start += size

    def _batch(self, documents: np.ndarray, tokens: RowSlice) -> TextBatch:
        starts = self.offsets[documents]
        lengths = self.offsets[documents + 1] - starts
        width = int(lengths.max())
        input_ids = np.full((len(documents), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(documents), width), dtype=np.int64)
        for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            input_ids[b, :length] = tokens.token_ids[start - tokens.start : start - tokens.start + length]
            mask[b, :length] = 1
        batch = TextBatch(torch.from_numpy(input_ids), torch.from_numpy(mask), rows=np.zeros(0, np.int64))
        if not self.per_token:
            kept = self._owned[documents // self.plan.chunk_size]
            order = np.argsort(documents, kind="stable")
            order = order[kept[order]]
            batch.rows, batch.order = documents[order].astype(np.int64), torch.from_numpy(order)
            return batch
        rows, flat = [], []
        for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            positions = np.arange(length)
            kept = self._owned[(start + positions) // self.plan.chunk_size]
            rows.append(start + positions[kept])
            flat.append(b * width + positions[kept])
        rows_all, flat_all = np.concatenate(rows), np.concatenate(flat)
        order = np.argsort(rows_all, kind="stable")
        batch.rows, batch.flat = rows_all[order], torch.from_numpy(flat_all[order])
        return batch
