"""Text jobs: the corpus tokenized once (split across ranks, gathered before the store exists), and the
batches that run it: documents sorted by length within a window of chunks and packed to a token
budget, each batch with the rows this rank stores.

Rows are tokens in a token store and documents in a document store (pooled). A rank owns whole
chunks of rows; a document that straddles two ranks' chunks runs on both, and each keeps only the
rows of its own chunks (``TextBatch.flat`` picks them, in the store's order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from accelerate.utils import gather_object

from ..errors import ExtractError
from ..store.chunks import Plan
from ..store.store import TextArrays, decodes
from .plan import share

WINDOW_CHUNKS = 4  # the fewest chunks whose documents are sorted by length together
WINDOW_BATCHES = 16  # a window holds this many batches' tokens where its memory allows: padding waste
# measured on real docstrings (benchmarks/RESULTS.md): 1.25 tokens computed per token stored with a
# window of 4 chunks of 4096, 1.08 with 16, 1.04 with the whole job
MAX_PADDING: float | None = 1.1  # tokens computed per real token a batch may reach (None: the budget alone)
WINDOW_BYTES = 256 * 2**20  # the most chunk buffers a window keeps open (all its chunks fill together)


def sort_window(chunk_size: int, row_bytes: int, tokens_per_batch: int) -> int:
    """Chunks per sort window: ``WINDOW_BATCHES`` batches' worth of tokens, at least ``WINDOW_CHUNKS``,
    and no more chunks than ``WINDOW_BYTES`` of open chunk buffers."""
    wanted = -(-WINDOW_BATCHES * tokens_per_batch // chunk_size)
    fits = max(1, WINDOW_BYTES // max(1, chunk_size * row_bytes))
    return max(WINDOW_CHUNKS, min(wanted, fits))


class Encoder(Protocol):
    """What tokenizing needs of a text model (``extract.models.hf_text.TextModel`` is one)."""

    def encode(self, text: str | None, input_ids: Sequence[int] | None, context_length: int) -> Any: ...

    def encode_content(self, text: str | None, input_ids: Sequence[int] | None) -> np.ndarray: ...

    def special_ids(self) -> np.ndarray: ...


@dataclass(frozen=True)
class Packing:
    """``--pack T``: the documents' content tokens concatenated, ``separator`` between two documents,
    cut into contexts of exactly T tokens that each start with ``bos`` (where the model has one); the
    tail too short for a context is dropped. Deterministic: the order of the documents decides it."""

    context_length: int
    bos: int | None
    separator: int | None

    @property
    def content(self) -> int:
        """Stream tokens per context."""
        return self.context_length - (self.bos is not None)

    def stream_length(self, lengths: np.ndarray) -> int:
        """Tokens in the stream: every document's, and a separator between two non-empty ones."""
        filled = int((lengths > 0).sum())
        return int(lengths.sum()) + (self.separator is not None) * max(0, filled - 1)

    def num_contexts(self, lengths: np.ndarray) -> int:
        return self.stream_length(lengths) // self.content

    def record(self) -> dict[str, Any]:
        return {"context_length": self.context_length, "bos": self.bos, "separator": self.separator}

    def pack(self, ids: np.ndarray, lengths: np.ndarray, special_ids: np.ndarray) -> PackedTokens:
        """The contexts of documents whose content tokens are ``ids`` (concatenated, ``lengths`` each)."""
        filled = np.flatnonzero(lengths > 0)
        sizes = lengths[filled]
        gap = int(self.separator is not None)
        total = self.stream_length(lengths)
        stream_ids = np.full(total, self.separator if gap else 0, dtype=np.int32)
        stream_doc = np.full(total, -1, dtype=np.int32)
        stream_position = np.full(total, -1, dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(sizes + gap)[:-1]]).astype(np.int64)  # each document's first
        firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        within = np.arange(int(sizes.sum())) - np.repeat(firsts, sizes)
        at = np.repeat(starts, sizes) + within
        stream_ids[at], stream_doc[at], stream_position[at] = ids, np.repeat(filled, sizes), within
        inserted = np.ones(total, dtype=bool)
        inserted[at] = False
        contexts = total // self.content
        kept = contexts * self.content

        def shaped(values: np.ndarray, start: int) -> np.ndarray:
            body = values[:kept].reshape(contexts, self.content)
            if self.bos is None:
                return body.reshape(-1)
            return np.concatenate([np.full((contexts, 1), start, dtype=values.dtype), body], axis=1).reshape(-1)

        token_ids = shaped(stream_ids, self.bos or 0)
        special = shaped(inserted, True) | np.isin(token_ids, special_ids)
        return PackedTokens(
            token_ids=token_ids,
            special=special,
            doc=shaped(stream_doc, -1),
            doc_position=shaped(stream_position, -1),
            dropped=int((~inserted[kept:]).sum()),
        )


@dataclass
class PackedTokens:
    """Packed contexts, flat: per token its id, whether it is special (the inserted BOS and separators
    too), its source document and its position there (-1 for inserted tokens)."""

    token_ids: np.ndarray
    special: np.ndarray
    doc: np.ndarray
    doc_position: np.ndarray
    dropped: int  # content tokens of the last short context


@dataclass
class Tokenized:
    """The corpus as the store keeps it, and what truncation and bad documents cost."""

    arrays: TextArrays
    truncated: int = 0  # documents cut to the context length
    dropped: int = 0  # tokens those cuts removed
    empty: int = 0  # documents of zero tokens (stored empty)
    invalid: int = 0  # documents that could not be read (--skip-bad-images), stored empty and invalid
    packing: Packing | None = None
    source_documents: int = 0  # packed: the documents the contexts were cut from
    tail_tokens: int = 0  # packed: the stream's last tokens, too few for a context, dropped

    def pack_record(self) -> dict[str, Any] | None:
        """What a packed store records of its packing (``Features.pack``); None when not packed."""
        if self.packing is None:
            return None
        return {
            **self.packing.record(),
            "contexts": self.arrays.num_documents,
            "dropped_tokens": self.tail_tokens,
            "source_documents": self.source_documents,
        }

    def notes(self, context_length: int) -> list[str]:
        """What the user should know about the tokenization, one line each."""
        notes = []
        if self.packing is not None:
            notes.append(
                f"extract: packed {self.source_documents} documents into {self.arrays.num_documents} contexts of "
                f"{context_length} tokens; the last {self.tail_tokens} tokens, too few for a context, were dropped"
            )
        if self.truncated:
            notes.append(
                f"extract: {self.truncated} documents longer than --context-length {context_length} were truncated "
                f"({self.dropped} tokens dropped)"
            )
        if self.empty:
            stored = "none are in the contexts" if self.packing else "they are stored empty"
            notes.append(f"extract: {self.empty} documents have no tokens; {stored}")
        if self.invalid:
            stored = "left out of the contexts" if self.packing else "stored empty with valid=False"
            notes.append(f"extract: {self.invalid} documents could not be read; they are {stored}")
        return notes


def documents_holding(offsets: np.ndarray, start: int, stop: int) -> tuple[int, int]:
    """The documents (first, last + 1) whose tokens include tokens ``start..stop-1`` (stop > start)."""
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    return first, int(np.searchsorted(offsets, stop - 1, side="right"))


def tokenize(source: Any, model: Encoder, context_length: int, state: Any, packing: Packing | None = None) -> Tokenized:
    """Every document tokenized once: rank r takes a contiguous share; the lengths, labels and validity
    are gathered on every rank (the plan needs every length before the store exists), the token ids on
    rank 0 only, which creates the store with them (``arrays.token_ids`` is empty elsewhere). A document the source could not
    read (``Document.error``, with --skip-bad-images) is stored with no tokens and valid=False. With
    ``packing`` the documents' content tokens are packed into contexts (rank 0 packs; every rank
    computes the contexts' offsets from the lengths)."""
    start, stop = share(len(source), state.process_index, state.num_processes)
    ids, special, lengths, labels, valid = [], [], [], [], []
    truncated = dropped = 0
    for index, document in zip(range(start, stop), source.documents(start, stop), strict=True):
        encoded_ids, encoded_special, cut = np.zeros(0, np.int32), np.zeros(0, bool), 0
        if not document.error:
            try:
                if packing is None:
                    encoded = model.encode(document.text, document.input_ids, context_length)
                    encoded_ids, encoded_special, cut = encoded.ids, encoded.special, encoded.dropped
                else:
                    encoded_ids = model.encode_content(document.text, document.input_ids)
            except ValueError as e:
                raise ExtractError(f"document {source.describe(index)}: {e}") from None
        ids.append(np.asarray(encoded_ids, dtype=np.int32))
        special.append(np.asarray(encoded_special, dtype=bool))
        lengths.append(len(encoded_ids))
        labels.append(document.label)
        valid.append(not document.error)
        truncated += cut > 0
        dropped += cut
    meta = {
        "lengths": np.asarray(lengths, dtype=np.int64),
        "labels": np.asarray(labels, dtype=np.int64),
        "valid": np.asarray(valid, dtype=bool),
        "truncated": truncated,
        "dropped": dropped,
    }
    tokens = (
        np.concatenate(ids) if ids else np.zeros(0, np.int32),
        np.concatenate(special) if special else np.zeros(0, bool),
    )
    parts = gather_object([meta]) if state.num_processes > 1 else [meta]
    token_parts = _gather_on_main(tokens, state)  # only the store's creator needs every token id
    lengths_all = np.concatenate([p["lengths"] for p in parts])
    valid_all = np.concatenate([p["valid"] for p in parts])
    token_ids = np.concatenate([p[0] for p in token_parts]) if token_parts else np.zeros(0, np.int32)
    counts = {
        "empty": int(((lengths_all == 0) & valid_all).sum()),
        "invalid": int((~valid_all).sum()),
    }
    if packing is not None:
        return _packed(packing, model, lengths_all, token_ids if token_parts else None, **counts)
    offsets = np.zeros(len(lengths_all) + 1, dtype=np.int64)
    np.cumsum(lengths_all, out=offsets[1:])
    arrays = TextArrays(
        offsets=offsets,
        token_ids=token_ids,
        special=np.concatenate([p[1] for p in token_parts]) if token_parts else np.zeros(0, bool),
        labels=np.concatenate([p["labels"] for p in parts]),
        valid=valid_all,
    )
    return Tokenized(
        arrays,
        truncated=sum(p["truncated"] for p in parts),
        dropped=sum(p["dropped"] for p in parts),
        **counts,
    )


def _packed(
    packing: Packing, model: Encoder, lengths: np.ndarray, token_ids: np.ndarray | None, *, empty: int, invalid: int
) -> Tokenized:
    """The packed corpus: ``token_ids`` (every document's content, on the store's creator only; None
    elsewhere, which needs the offsets alone)."""
    contexts = packing.num_contexts(lengths)
    offsets = np.arange(contexts + 1, dtype=np.int64) * packing.context_length
    empty_tokens = np.zeros(0, np.int32)
    packed = PackedTokens(empty_tokens, np.zeros(0, bool), empty_tokens, empty_tokens, dropped=0)
    if token_ids is not None:
        packed = packing.pack(token_ids, lengths, model.special_ids())
    # the tail a context would need is known from the lengths alone, so every rank says the same
    tail = packing.stream_length(lengths) - contexts * packing.content
    arrays = TextArrays(
        offsets=offsets,
        token_ids=packed.token_ids,
        special=packed.special,
        labels=np.full(contexts, -1, dtype=np.int64),  # a context has no label; its documents' keys say where
        valid=np.ones(contexts, dtype=bool),
        doc=packed.doc,
        doc_position=packed.doc_position,
    )
    return Tokenized(
        arrays, empty=empty, invalid=invalid, packing=packing, source_documents=len(lengths), tail_tokens=tail
    )


def _gather_on_main(value: Any, state: Any) -> list[Any]:
    """Every rank's ``value`` on rank 0 (in rank order), nothing elsewhere: the token ids are the corpus's
    bulk, and the other ranks read theirs from the store once it exists."""
    if state.num_processes == 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] | None = [None] * state.num_processes if state.is_main_process else None
    dist.gather_object(value, gathered, dst=0)
    return gathered or []


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


class TextBatches:
    """The batches of one rank's ``chunks`` (ascending), window by window.

    ``per_token``: rows are tokens and ``plan`` chunks them; a document runs in the window of its first
    row in ``chunks`` and keeps its rows that are in ``chunks``. Otherwise rows are documents. Within a
    window documents are sorted by length (longest first) and packed while B x T stays within
    ``tokens_per_batch`` (however many documents that takes; see ``_pack`` for the padding limit); a
    longer document runs alone. Token ids are read from the store (``token_ids``), window by window: a
    resume never tokenizes again. In a document store each window also yields, as an array, its
    documents with no tokens (they still have a row, NaN)."""

    def __init__(
        self,
        offsets: np.ndarray,
        token_ids: Any,
        plan: Plan,
        chunks: Sequence[int],
        *,
        per_token: bool,
        tokens_per_batch: int,
        pad_id: int,
        window: int = WINDOW_CHUNKS,
    ) -> None:
        self.offsets, self.token_ids, self.plan = offsets, token_ids, plan
        self.chunks, self.per_token = list(chunks), per_token
        self.tokens_per_batch, self.pad_id = tokens_per_batch, pad_id
        self.window = window
        self._owned = set(self.chunks)

    @classmethod
    def for_job(
        cls,
        offsets: np.ndarray,
        token_ids: Any,
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
            offsets, token_ids, plan, chunks, per_token=per_token, tokens_per_batch=tokens_per_batch, pad_id=pad_id,
            window=window,
        )  # fmt: skip

    def __iter__(self) -> Iterator[TextBatch | np.ndarray]:
        seen = -1  # the last document run: each runs once per rank
        for at in range(0, len(self.chunks), self.window):
            window = self.chunks[at : at + self.window]
            documents = self._documents(window, seen)
            if not len(documents):
                continue
            seen = int(documents[-1])
            lengths = self.offsets[documents + 1] - self.offsets[documents]
            if not self.per_token and (lengths == 0).any():
                yield documents[lengths == 0]
            documents, lengths = documents[lengths > 0], lengths[lengths > 0]
            if not len(documents):
                continue
            ids = self._read_ids(documents)
            by_length = np.argsort(-lengths, kind="stable")
            for group in self._pack(lengths[by_length]):
                yield self._batch(documents[by_length[group]], ids)

    def _read_ids(self, documents: np.ndarray) -> dict[int, np.ndarray]:
        """Each document's token ids, read run by run of consecutive documents (one read each): a
        resume's pending chunks may be far apart, and nothing between them is read."""
        ids: dict[int, np.ndarray] = {}
        breaks = np.flatnonzero(np.diff(documents) != 1) + 1
        for run in np.split(documents, breaks):
            first, last = int(self.offsets[run[0]]), int(self.offsets[run[-1] + 1])
            values = np.asarray(self.token_ids[first:last])
            for document in run.tolist():
                ids[document] = values[self.offsets[document] - first : self.offsets[document + 1] - first]
        return ids

    def _documents(self, window: Sequence[int], seen: int) -> np.ndarray:
        """The documents with rows in ``window`` not run before (ascending)."""
        spans = []
        for chunk in window:
            start, stop = self.plan.bounds(chunk)
            if self.per_token:
                spans.append(np.arange(*documents_holding(self.offsets, start, stop)))
            else:
                spans.append(np.arange(start, stop))
        documents = np.unique(np.concatenate(spans))
        if self.per_token:  # empty documents share their offset with the next: they hold no row
            documents = documents[self.offsets[documents + 1] > self.offsets[documents]]
        return documents[documents > seen]

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

    def _batch(self, documents: np.ndarray, ids: dict[int, np.ndarray]) -> TextBatch:
        starts = self.offsets[documents]
        lengths = self.offsets[documents + 1] - starts
        width = int(lengths.max())
        input_ids = np.full((len(documents), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(documents), width), dtype=np.int64)
        for b, (document, length) in enumerate(zip(documents.tolist(), lengths.tolist(), strict=True)):
            input_ids[b, :length] = ids[document]
            mask[b, :length] = 1
        batch = TextBatch(torch.from_numpy(input_ids), torch.from_numpy(mask), rows=np.zeros(0, np.int64))
        if not self.per_token:
            order = np.argsort(documents, kind="stable")
            batch.rows, batch.order = documents[order].astype(np.int64), torch.from_numpy(order)
            return batch
        rows, flat = [], []
        for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            positions = np.arange(length)
            kept = self._owned_rows(start, length)
            rows.append(start + positions[kept])
            flat.append(b * width + positions[kept])
        rows_all, flat_all = np.concatenate(rows), np.concatenate(flat)
        order = np.argsort(rows_all, kind="stable")
        batch.rows, batch.flat = rows_all[order], torch.from_numpy(flat_all[order])
        return batch

    def _owned_rows(self, start: int, length: int) -> np.ndarray:
        """Which of a document's tokens fall in this rank's chunks."""
        chunk_of = (start + np.arange(length)) // self.plan.chunk_size
        first = int(chunk_of[0])
        owned = np.array([chunk in self._owned for chunk in range(first, int(chunk_of[-1]) + 1)])
        return owned[chunk_of - first]  # a document spans a few chunks: ask the set about those only


def restore_token_chunks(
    store: Any,
    source: Any,
    model: Encoder,
    context_length: int,
    plan: Plan,
    offsets: np.ndarray,
    chunks: Sequence[int],
    packing: Packing | None = None,
) -> list[int]:
    """Rewrite the token ids and special flags (packed: and sources) of those ``chunks`` (about to be
    recomputed) whose objects are lost or fail their checksum (``verify --repair`` cleared them), from
    the documents that hold those tokens, tokenized again: the features are computed from the stored
    ids, so the ids must be whole first. The job's identity guarantees the same tokenizer and data.
    A packed store's contexts depend on every document before them, so the corpus is packed again
    whole (a repair is rare; a fresh job would tokenize as much). Returns the chunks restored."""
    names = ("token_ids", "special", *(("doc", "doc_position") if packing is not None else ()))
    arrays = {name: store.array(name) for name in names}
    present = {name: store.stored_chunks(name, chunks) for name in arrays}
    damaged = [
        chunk
        for chunk in chunks
        if not all(chunk in present[name] and decodes(array, *plan.bounds(chunk)) for name, array in arrays.items())
    ]
    if not damaged:
        return []
    if packing is not None:
        lengths, ids = [], []
        for document in source.documents(0, len(source)):
            content = (
                np.zeros(0, np.int32) if document.error else model.encode_content(document.text, document.input_ids)
            )
            lengths.append(len(content))
            ids.append(np.asarray(content, dtype=np.int32))
        packed = packing.pack(np.concatenate(ids), np.asarray(lengths, dtype=np.int64), model.special_ids())
        for chunk in damaged:
            start, stop = plan.bounds(chunk)
            for name, array in arrays.items():
                array[start:stop] = getattr(packed, name)[start:stop]
        return damaged
    for chunk in damaged:
        start, stop = plan.bounds(chunk)
        first, last = documents_holding(offsets, start, stop)
        ids, special = [], []
        for document in source.documents(first, last):
            if document.error:
                continue
            encoded = model.encode(document.text, document.input_ids, context_length)
            ids.append(np.asarray(encoded.ids, dtype=np.int32))
            special.append(np.asarray(encoded.special, dtype=bool))
        at = slice(start - int(offsets[first]), stop - int(offsets[first]))
        arrays["token_ids"][start:stop] = np.concatenate(ids)[at]
        arrays["special"][start:stop] = np.concatenate(special)[at]
    return damaged
