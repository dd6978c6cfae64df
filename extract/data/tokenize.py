"""A text corpus as token rows, without ever holding the corpus's token ids.

Two passes over the documents, both in batches through the tokenizer's own batch encoder:

- ``survey``: each rank tokenizes a contiguous share of the documents and keeps only what the plan
  needs of each (its length, label and validity: a few bytes per document); every rank gets those
  for the whole corpus. Offsets, chunk bounds and, with ``--pack``, each context's place in the
  stream of documents follow from the lengths alone.
- ``TokenRows.rows(start, stop)``: the token rows ``start:stop`` of the store (ids, special flags,
  and for packed contexts each token's source document and position), from the documents that hold
  them, tokenized again. A rank asks for the rows of its own chunks only, window by window.

Tokenizing twice, instead of keeping or sending the first pass's ids, keeps every rank's memory flat
(no rank receives another's tokens), makes a resume or a repair read the same ids from the one
source of truth (the data, whose listing is in the job's identity), and costs little beside the
forward: the batch encoder runs on the tokenizer's threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ExtractError
from ..names import PackInfo
from ..store.chunks import share
from .source import Document, TextSource

if TYPE_CHECKING:
    from ..processes import Processes

BATCH_DOCUMENTS = 256  # documents per call of the batch encoder


class Encoded(Protocol):
    ids: np.ndarray
    special: np.ndarray
    dropped: int


class Encoder(Protocol):
    """What tokenizing needs of a text model (``extract.models.hf_text.TextModel`` is one)."""

    def encode_many(
        self, documents: Sequence[tuple[str | None, Sequence[int] | None]], context_length: int | None
    ) -> Sequence[Encoded]: ...

    def special_ids(self) -> np.ndarray: ...


@dataclass
class Corpus:
    """What the plan needs of a corpus, per document: (N_docs,) each. ``lengths`` are the tokens each
    document has as stored (with its special tokens, truncated), or with ``--pack`` its content tokens."""

    # the narrowest types, no Python object per document: 9 bytes a document (a billion tokens of
    # 60-token documents is 17M documents, 150 MB on every rank, with the offsets' 8 bytes)
    lengths: np.ndarray  # int32
    labels: np.ndarray  # int32
    valid: np.ndarray  # bool
    truncated: int = 0  # documents cut to the context length
    dropped: int = 0  # tokens those cuts removed
    packing: PackInfo | None = None

    @property
    def num_source_documents(self) -> int:
        return len(self.lengths)

    @property
    def empty(self) -> int:
        """Documents of zero tokens that could be read (stored empty)."""
        return int(((self.lengths == 0) & self.valid).sum())

    @property
    def invalid(self) -> int:
        return int((~self.valid).sum())

    @cached_property
    def offsets(self) -> np.ndarray:
        """(rows' documents + 1,) int64: document i is rows ``offsets[i]:offsets[i+1]``; packed, the
        documents are the contexts, T rows each."""
        if self.packing is not None:
            return np.arange(self.packing.num_contexts(self.lengths) + 1, dtype=np.int64) * self.packing.context_length
        offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=offsets[1:])
        return offsets

    @cached_property
    def pack(self) -> PackInfo | None:
        """The packing with what it made of this corpus (contexts, dropped tail); None when not packed."""
        return None if self.packing is None else self.packing.cut(self.lengths)

    def notes(self, context_length: int) -> list[str]:
        """What the user should know about the tokenization, one line each."""
        notes = []
        if self.pack is not None:
            notes.append(
                f"extract: packed {self.num_source_documents} documents into {len(self.offsets) - 1} contexts of "
                f"{context_length} tokens; the last {self.pack.dropped_tokens} tokens, too few for a context, "
                "were dropped"
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


def encoded_documents(
    source: TextSource, model: Encoder, context_length: int | None, start: int, stop: int
) -> Iterator[tuple[Document, Encoded | None]]:
    """Documents ``start:stop`` with their encoding (None for one the source could not read), in
    batches of ``BATCH_DOCUMENTS`` through the batch encoder. ``context_length`` None: content tokens
    (``--pack``). A document the tokenizer refuses stops the job naming it."""
    documents = iter(source.documents(start, stop))
    at = start
    while batch := [d for _, d in zip(range(BATCH_DOCUMENTS), documents, strict=False)]:
        readable = [d for d in batch if not d.error]
        try:
            encoded = iter(model.encode_many([(d.text, d.input_ids) for d in readable], context_length))
        except ValueError:
            for offset, document in enumerate(batch):  # find the culprit to name it
                if not document.error:
                    try:
                        model.encode_many([(document.text, document.input_ids)], context_length)
                    except ValueError as e:
                        raise ExtractError(f"document {source.describe(at + offset)}: {e}") from None
            raise
        for document in batch:
            yield document, (None if document.error else next(encoded))
        at += len(batch)


def survey(
    source: TextSource, model: Encoder, context_length: int, processes: Processes, packing: PackInfo | None
) -> Corpus:
    """Every document's length, label and validity: rank r tokenizes its contiguous share, and only
    those few bytes per document are gathered, on every rank (each plans from them alone)."""
    start, stop = share(len(source), processes.process_index, processes.num_processes)
    count = stop - start
    lengths = np.zeros(count, dtype=np.int32)
    labels = np.full(count, -1, dtype=np.int32)
    valid = np.zeros(count, dtype=bool)
    truncated = dropped = 0
    limit = None if packing is not None else context_length
    for i, (document, encoded) in enumerate(encoded_documents(source, model, limit, start, stop)):
        labels[i], valid[i] = document.label, encoded is not None
        if encoded is not None:
            lengths[i] = len(encoded.ids)
            truncated += encoded.dropped > 0
            dropped += encoded.dropped
    part = {"lengths": lengths, "labels": labels, "valid": valid, "truncated": truncated, "dropped": dropped}
    parts = processes.gather(part) if processes.num_processes > 1 else [part]
    return Corpus(
        lengths=np.concatenate([p["lengths"] for p in parts]),
        labels=np.concatenate([p["labels"] for p in parts]),
        valid=np.concatenate([p["valid"] for p in parts]),
        truncated=sum(p["truncated"] for p in parts),
        dropped=sum(p["dropped"] for p in parts),
        packing=packing,
    )


@dataclass
class RowSlice:
    """Token rows ``start:start + len(token_ids)`` of a store: per row its id and whether it is special;
    packed, also its source document and position there (-1 for an inserted BOS or separator)."""

    start: int
    token_ids: np.ndarray  # int32
    special: np.ndarray  # bool
    doc: np.ndarray | None = None  # int32
    doc_position: np.ndarray | None = None  # int32

    def columns(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` (within this slice) of every array, by the store's names."""
        at = slice(start - self.start, stop - self.start)
        columns = {"token_ids": self.token_ids[at], "special": self.special[at]}
        if self.doc is not None and self.doc_position is not None:
            columns.update(doc=self.doc[at], doc_position=self.doc_position[at])
        return columns


@dataclass
class ArrayRows:
    """Token rows read from an array of ids (a finished store's ``token_ids``, or ids in memory), for tools
    that rebuild a job's batches without its source."""

    token_ids: Any

    def rows(self, start: int, stop: int) -> RowSlice:
        ids = np.asarray(self.token_ids[start:stop], dtype=np.int32)
        return RowSlice(start, ids, np.zeros(len(ids), bool))


@dataclass
class TokenRows:
    """The store's token rows, made from the source on demand (see the module's docstring): each call
    tokenizes only the documents that hold the rows asked for."""

    source: TextSource
    model: Encoder
    context_length: int
    corpus: Corpus
    _filled: np.ndarray = field(init=False, repr=False)  # packed: the documents with content
    _stream_starts: np.ndarray = field(init=False, repr=False)  # packed: their first stream position
    _special_ids: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lengths, packing = self.corpus.lengths, self.corpus.packing
        if packing is None:
            return
        # int32 document indices, int64 stream positions: 12 bytes a document, however many
        self._filled = np.flatnonzero(lengths > 0).astype(np.int32)
        self._stream_starts = np.zeros(len(self._filled), dtype=np.int64)
        if len(self._filled) > 1:
            np.cumsum(lengths[self._filled[:-1]] + np.int32(packing.gap), out=self._stream_starts[1:])
        self._special_ids = np.asarray(self.model.special_ids())

    def rows(self, start: int, stop: int) -> RowSlice:
        """Rows ``start:stop`` (stop > start)."""
        if self.corpus.packing is None:
            return self._ragged(start, stop)
        return self._packed(start, stop)

    def _encoded(self, first: int, last: int, limit: int | None) -> list[np.ndarray | Encoded]:
        """Documents ``first:last`` encoded, checked against the lengths the plan was made from."""
        out: list[Any] = []
        for at, (_, encoded) in enumerate(encoded_documents(self.source, self.model, limit, first, last), first):
            length = 0 if encoded is None else len(encoded.ids)
            if length != self.corpus.lengths[at]:
                raise ExtractError(
                    f"document {self.source.describe(at)} has {length} tokens now, {self.corpus.lengths[at]} when "
                    "the job was planned; the data or the tokenizer changed: rerun with --overwrite"
                )
            out.append(encoded)
        return out

    def _ragged(self, start: int, stop: int) -> RowSlice:
        offsets = self.corpus.offsets
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop - 1, side="right"))
        encoded = [e for e in self._encoded(first, last, self.context_length) if e is not None]
        base = int(offsets[first])
        ids = np.concatenate([e.ids for e in encoded]) if encoded else np.zeros(0, np.int32)
        special = np.concatenate([e.special for e in encoded]) if encoded else np.zeros(0, bool)
        at = slice(start - base, stop - base)
        return RowSlice(start, ids[at].astype(np.int32, copy=False), special[at].astype(bool, copy=False))

    def _packed(self, start: int, stop: int) -> RowSlice:
        packing = self.corpus.packing
        assert packing is not None
        rows = np.arange(start, stop, dtype=np.int64)
        context, column = np.divmod(rows, packing.context_length)
        has_bos = int(packing.bos is not None)
        inserted_bos = column < has_bos
        stream = context * packing.content + column - has_bos  # each row's place in the stream
        ids = np.full(len(rows), packing.bos if has_bos else 0, dtype=np.int32)
        doc = np.full(len(rows), -1, dtype=np.int32)
        position = np.full(len(rows), -1, dtype=np.int32)
        from_stream = np.flatnonzero(~inserted_bos)
        if len(from_stream):
            places = stream[from_stream]
            holder = np.searchsorted(self._stream_starts, places, side="right") - 1  # among the filled documents
            within = places - self._stream_starts[holder]
            first, last = int(holder.min()), int(holder.max()) + 1
            sources = self._filled[first:last]
            encoded = self._encoded(int(sources[0]), int(sources[-1]) + 1, None)
            contents = [encoded[s - int(sources[0])].ids for s in sources.tolist()]
            sizes = np.array([len(c) for c in contents], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            flat = np.concatenate(contents).astype(np.int32, copy=False)
            local = holder - first
            content = within < sizes[local]  # else: the separator after the document
            taken = from_stream[content]
            ids[taken] = flat[starts[local[content]] + within[content]]
            doc[taken] = sources[local[content]]
            position[taken] = within[content]
            ids[from_stream[~content]] = packing.separator if packing.separator is not None else 0
        special = (doc < 0) | np.isin(ids, self._special_ids)
        return RowSlice(start, ids, special, doc, position)
