"""The text stages of a job: the corpus planned from its lengths (``prepare_text``), and the loop that
runs a rank's chunks (``text_loop``). No rank ever holds the corpus's token ids: ranks gather a few
bytes per document, and each tokenizes the documents of its own chunks window by window
(``extract.data.tokenize``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..capture.hooks import Capture, Edit
from ..capture.setup import TextLayerSetup
from ..capture.staging import HostStaging
from ..data.source import TextSource
from ..data.tokenize import Corpus, TokenRows, survey
from ..errors import ExtractError
from ..models.hf_text import TextModel, input_device
from ..names import Kind, PackInfo
from ..names.layers import LayerRef
from ..processes import Processes
from ..store.chunks import Plan, chunk_segments
from ..store.store import FeatureStore
from ..store.text_arrays import TextArrays
from ..store.writer import ChunkWriter
from .interrupt import Interrupted, StopRequests
from .resources import default_writer_threads, warn_infinite
from .saes import JobSaes
from .spec import JobSpec, batching
from .text import ChunkColumns, TextBatch, TextBatches

MAX_DEFAULT_CONTEXT = 2048  # --context-length's default where the model sets none: its positions, at most this


@dataclass
class TextJob:
    """A text job's corpus as planned: its per-document facts (surveyed now, or read back from the store
    being resumed) and how its batches are made."""

    corpus: Corpus
    context_length: int
    per_token: bool
    tokens_per_batch: int
    record: dict[str, Any]  # what decides the token ids: part of the job's identity
    surveyed: bool  # tokenized now (the truncation counts are known), not read back
    rewrite: list[str] = field(default_factory=list)  # per-document arrays of the store to write again

    @property
    def offsets(self) -> np.ndarray:
        return self.corpus.offsets

    @property
    def kind(self) -> Kind:
        """The store's kind: one row per token, or one pooled row per document."""
        return Kind.TOKENS if self.per_token else Kind.DOCUMENTS

    @property
    def packing(self) -> PackInfo | None:
        return self.corpus.packing

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def rows(self) -> int:
        return self.num_tokens if self.per_token else self.num_documents

    def arrays(self) -> TextArrays:
        """The per-document arrays the store keeps (packed: per context, with the source lengths)."""
        corpus = self.corpus
        if corpus.packing is not None:
            contexts = self.num_documents
            return TextArrays(
                self.offsets, np.full(contexts, -1, np.int32), np.ones(contexts, bool), corpus.lengths
            )
        valid = corpus.valid
        if not self.per_token:  # a document without tokens has no pooled row (NaN): not valid for readers
            valid = valid & (corpus.lengths > 0)
        return TextArrays(self.offsets, corpus.labels, valid)

    def truncation(self) -> dict[str, int] | None:
        if not self.surveyed:
            return None
        return {
            "documents_truncated": self.corpus.truncated,
            "tokens_dropped": self.corpus.dropped,
            "empty_documents": self.corpus.empty,
            "context_length": self.context_length,
        }


def prepare_text(
    spec: JobSpec,
    processes: Processes,
    existing: Mapping[str, Any] | None,
    loaded: TextModel,
    layers: TextLayerSetup,
    dataset: TextSource,
    notes: list[str],
) -> TextJob:
    """The corpus's plan: surveyed now, split across ranks, unless the store being resumed was made from
    the same documents by the same tokenizer at the same context length and its per-document arrays
    are the ones written at its creation (then it holds them; damaged ones are surveyed again and
    rewritten, ``TextJob.rewrite``)."""
    context = _context_length(spec, loaded)
    packing = _packing(spec, loaded, layers)
    record = _tokenization(spec, loaded, dataset, context, packing)
    budget = batching(spec.to_dict(), text=True)["tokens_per_batch"]
    identity = (existing or {}).get("identity") or {}
    if not spec.overwrite and identity.get("tokenization") == record:
        stored, rewrite = _stored(spec, packing, notes)
        if stored is not None:
            return TextJob(stored, context, layers.per_token, budget, record, surveyed=False)
        corpus = survey(dataset, loaded, context, processes, packing)
        return TextJob(corpus, context, layers.per_token, budget, record, surveyed=True, rewrite=rewrite)
    corpus = survey(dataset, loaded, context, processes, packing)
    job = TextJob(corpus, context, layers.per_token, budget, record, surveyed=True)
    if job.num_tokens == 0:
        if packing is not None:
            raise ExtractError(
                f"--data {spec.data} has {corpus.pack.dropped_tokens if corpus.pack else 0} tokens, too few for one context of --pack "
                f"{spec.pack}; give more text or a smaller --pack"
            )
        raise ExtractError(f"--data {spec.data} has no tokens: every document is empty; point it at text")
    notes.extend(corpus.notes(context))
    return job


def _context_length(spec: JobSpec, loaded: TextModel) -> int:
    """The tokens a document is cut to: ``--pack`` or ``--context-length``, within the model's positions;
    else the model's own length, or its positions up to ``MAX_DEFAULT_CONTEXT``."""
    positions = loaded.max_positions
    if spec.context_length is not None and positions is not None and spec.context_length > positions:
        raise ExtractError(
            f"--context-length {spec.context_length} is beyond the model's {positions} positions; "
            f"use at most {positions}"
        )
    if spec.pack is not None and positions is not None and spec.pack > positions:
        raise ExtractError(f"--pack {spec.pack} is beyond the model's {positions} positions; use at most {positions}")
    # a model whose own files set a length (sentence-transformers' max_seq_length) was used at that length
    own = loaded.default_context_length
    return spec.pack or spec.context_length or own or min(positions or MAX_DEFAULT_CONTEXT, MAX_DEFAULT_CONTEXT)


def _tokenization(
    spec: JobSpec, loaded: TextModel, dataset: TextSource, context: int, packing: PackInfo | None
) -> dict[str, Any]:
    """What decides the token ids (part of the job's identity): a resume with the same reuses the plan."""
    return {
        "tokenizer": loaded.tokenizer_record(),
        "context_length": context,
        **({"pack": packing.identity()} if packing is not None else {}),
        "text_key": spec.text_key,
        "label_key": spec.label_key,
        "data": dataset.spec,
        "data_listing_sha256": dataset.listing_sha256(),
    }


def _stored(spec: JobSpec, packing: PackInfo | None, notes: list[str]) -> tuple[Corpus | None, list[str]]:
    """The plan's facts as the store being resumed keeps them; or, where its per-document arrays are not
    the ones written at its creation, None and those of them to write again (said in ``notes``)."""
    store = FeatureStore.open(spec.location, mode="r")
    damaged = store.creation.damage()
    if packing is not None and not store.has("source_lengths"):
        damaged.append("source_lengths")  # a store from before they were kept: survey again
    if not damaged:
        return _stored_corpus(store.creation.text_arrays(), packing), []
    notes.append(
        f"extract: {', '.join(damaged)} of {spec.out} are not as written at its creation; "
        "surveyed the data again to rewrite them"
    )
    return None, [name for name in damaged if store.has(name)]


def _stored_corpus(stored: TextArrays, packing: PackInfo | None) -> Corpus:
    """The plan's facts as a store keeps them: ragged, each document's length is its offsets'
    difference; packed, the source documents' lengths."""
    if packing is not None:
        assert stored.source_lengths is not None
        lengths = stored.source_lengths
        lengths = lengths.astype(np.int32)
        return Corpus(lengths, np.full(len(lengths), -1, np.int32), np.ones(len(lengths), bool), packing=packing)
    return Corpus(np.diff(stored.offsets).astype(np.int32), stored.labels.astype(np.int32), stored.valid)


def _packing(spec: JobSpec, model: TextModel, layers: TextLayerSetup) -> PackInfo | None:
    """``--pack``'s contexts for this model's tokenizer, or None without it."""
    if spec.pack is None:
        return None
    if not layers.per_token:
        raise ExtractError(
            f"--pack {spec.pack} stores every token of its contexts; it does not combine with --pool "
            f"{spec.pool} (drop --pool, or drop --pack to pool each document)"
        )
    bos, separator = model.packing_tokens()
    if bos is not None and spec.pack < 2:
        raise ExtractError(f"--pack {spec.pack} leaves no room beside the BOS each context starts with; use 2 or more")
    return PackInfo(spec.pack, bos, separator)


@dataclass(frozen=True)
class TextStage:
    """What the text loop reads, and nothing more: the runner builds it from the job it prepared.

    The corpus as planned (``text``, its documents read from ``dataset``), the model (``loaded``, its
    ``module`` with the layers ``refs`` set up as ``layers``, and the ``saes`` that encode some of them),
    the ``plan``, the ``shapes`` stored raw and a row's bytes in all, the job's ``processes`` (whether
    this one writes; when its tensor-parallel group stops), and the options of the spec the loop acts on."""

    text: TextJob
    dataset: TextSource
    loaded: TextModel
    module: nn.Module
    refs: Sequence[LayerRef]
    layers: TextLayerSetup
    saes: JobSaes | None
    plan: Plan
    shapes: Mapping[str, tuple[int, ...]]
    row_bytes: int  # a row's bytes as stored, raw layers and codes: how TextBatches sizes its windows
    processes: Processes
    dtype: torch.dtype  # the storage dtype (--dtype)
    writer_threads: int | None  # None: default_writer_threads(device)
    truncate: bool  # the forward stops after the last requested layer


def text_loop(
    stage: TextStage,
    store: FeatureStore,
    chunks: list[int],
    edit: Mapping[str, Edit] | None,
    stop: StopRequests,
    forwarded: Callable[[int], None] = lambda rows: None,
    held: Callable[[], None] = lambda: None,
) -> None:
    """The image loop's counterpart for text: token-budget batches of this rank's chunks
    (``TextBatches``), each forward's rows selected on the device and handed to the writer with each
    token chunk's token rows. ``held()`` raises once the lock is lost. Under tensor parallelism every rank of
    a group runs the group's batches (the forward and the gathers are collectives over it), and only its
    writing rank stages and writes them (``forward_only`` on the others)."""
    text, layers = stage.text, stage.layers
    if not stage.processes.writes:
        return forward_only(stage, chunks, edit, stop, held)
    device = input_device(stage.module)  # the process's device, or a dispatched model's first
    batches = _batches(stage, chunks)
    most = max(text.tokens_per_batch, text.context_length)  # a batch's stored rows at most (a document's tokens)
    saes = stage.saes
    encoders = {} if saes is None else saes.encoders
    staging = HostStaging(
        stage.shapes, most, stage.dtype, device, encoders=encoders, stats=store.stats_axes(),
        chunk_size=stage.plan.chunk_size,
    )  # fmt: skip
    threads = stage.writer_threads or default_writer_threads(device)
    codes = None if saes is None else saes.codes()
    writer = ChunkWriter(store, staging, stage.plan, stage.shapes, threads=threads, codes=codes)
    stop.defer()
    stopped = None  # the signal that stopped this rank, or a rank of its tensor-parallel group
    try:
        with (
            Capture(
                stage.module, stage.refs, reduce=layers.reduce, stop=stage.truncate, edit=edit,
                sink=staging.stage, gather=layers.gather,
            ) as cap,
            torch.inference_mode(),
        ):  # fmt: skip
            for batch in batches:
                stopped = stage.processes.agree_to_stop(stop.signum)
                if stopped is not None:
                    break
                held()
                if isinstance(batch, ChunkColumns):
                    writer.submit_columns(batch.chunk, batch.columns)
                    continue
                if not isinstance(batch, TextBatch):  # documents without tokens: their rows are NaN
                    writer.submit_rows(None, batch)
                    forwarded(len(batch))
                    continue
                inputs = upload(layers, batch, device)
                slot = staging.acquire(writer.check)
                staging.rows = np.asarray(batch.rows, np.int64)  # a GPU computes each chunk's statistics
                if encoders:  # each chunk's rows of the batch get statistics of their own
                    staging.segments = list(chunk_segments(np.asarray(batch.rows, np.int64), stage.plan.chunk_size))
                stage.loaded.call(cap.forward, inputs)
                staging.seal(slot)
                writer.submit_rows(slot, batch.rows)
                forwarded(len(batch.rows))
        stopped = stopped or stop.signum
        writer.close(complete=stopped is None)
    except BaseException:
        writer.abort()
        raise
    warn_infinite(writer.infinite)
    if stopped is not None:
        raise Interrupted(stopped, writer.chunks_written)


def _batches(stage: TextStage, chunks: list[int]) -> TextBatches:
    text = stage.text
    rows = TokenRows(stage.dataset, stage.loaded, text.context_length, text.corpus)
    return TextBatches.for_job(
        text.offsets, rows, stage.plan, chunks, per_token=text.per_token,
        tokens_per_batch=text.tokens_per_batch, pad_id=stage.loaded.pad_id, row_bytes=stage.row_bytes,
    )  # fmt: skip


def forward_only(
    stage: TextStage, chunks: list[int], edit: Mapping[str, Edit] | None, stop: StopRequests, held: Callable[[], None]
) -> None:
    """A tensor-parallel rank that does not write: the same batches and forwards as its group's writer,
    with the same captures (their gathers are collectives), nothing staged. It stops where its group stops."""
    layers = stage.layers
    device = input_device(stage.module)
    stop.defer()
    with (
        Capture(
            stage.module, stage.refs, reduce=layers.reduce, stop=stage.truncate, edit=edit,
            sink=lambda name, value: None, gather=layers.gather,
        ) as cap,
        torch.inference_mode(),
    ):  # fmt: skip
        for batch in _batches(stage, chunks):
            stopped = stage.processes.agree_to_stop(stop.signum)
            if stopped is not None:
                break
            held()
            if not isinstance(batch, TextBatch):  # written by the writer without a forward
                continue
            inputs = upload(layers, batch, device)
            stage.loaded.call(cap.forward, inputs)
        else:
            stopped = stop.signum
    if stopped is not None:
        raise Interrupted(stopped, 0)


def upload(
    layers: TextLayerSetup, batch: TextBatch, device: torch.device, pin: bool | None = None
) -> dict[str, torch.Tensor]:
    """The batch's model inputs on the device, and what every layer's reduction keeps of it there, each tensor
    sent once (the reductions use the model's own attention mask). On CUDA (``pin``) they go up from pinned
    memory: from pageable memory a ``non_blocking`` copy is synchronous, and the host would wait for it."""
    pin = device.type == "cuda" if pin is None else pin

    def up(value: torch.Tensor) -> torch.Tensor:
        return (value.pin_memory() if pin else value).to(device, non_blocking=True)

    inputs = {name: up(value) for name, value in batch.inputs.items()}
    selection = layers.selection
    selection.mask = inputs["attention_mask"]
    selection.flat = None if batch.flat is None else up(batch.flat)
    selection.order = None if batch.order is None else up(batch.order)
    return inputs
