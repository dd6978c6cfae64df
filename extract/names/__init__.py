"""The vocabulary every stage shares, importing no stage: what a store's rows are (``Kind``), what a
model takes (``ModelKind``), how a
packed store's contexts were cut (``PackInfo``), layer names (``LayerRef``, ``matches_glob``,
``closest``, ``shape_text``: ``layers.py``), which axis holds the channels (``Layout``: ``layout.py``)
the pool names (``POOL_CHOICES``, ``TEXT_POOLS``, ``MODEL_POOL``: here) and their reductions
(``make_pool``, ``per_layer``, ``ModelPooling``: ``pooling.py``, imported by name, since it loads torch),
and the store life cycle's actions (``Action``: ``life.py``).

Capture, the store, the reader and the analysis import these from here; nothing here imports them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from .layers import LayerRef, closest, matches_glob, shape_text
from .layout import Layout
from .life import Action

__all__ = [
    "COMPRESSORS",
    "DECODES",
    "MODEL_POOL",
    "POOL_CHOICES",
    "TEXT_POOLS",
    "Action",
    "Kind",
    "LayerRef",
    "Layout",
    "ModelKind",
    "PackInfo",
    "closest",
    "matches_glob",
    "shape_text",
]

# Option values the job's spec lists and the stage that acts on them checks: here, so that building the
# command's parser imports neither the data sources nor zarr.
DECODES = ("pil", "draft", "nvjpeg")  # --decode: PIL in full, PIL at a reduced JPEG scale, nvjpeg on the GPU
COMPRESSORS = ("zstd", "blosc", "bitshuffle", "none")  # --compressor
POOL_CHOICES = ("none", "avg", "max", "avg:K", "cls", "mean")  # --pool for an image (or any 4-D / 3-D) layer
TEXT_POOLS = ("mean", "max", "first", "last")  # --pool for a text model's tokens, per document
MODEL_POOL = "model"  # --pool model: the pooling the model's own files name (``pooling.ModelPooling``)


class ModelKind(StrEnum):
    """What a model takes: images, or text (``hf:`` text models). A ``StrEnum``: a model source's ``kind``
    compares equal to the string it was before, and prints as it."""

    IMAGE = "image"
    TEXT = "text"


class Kind(StrEnum):
    """What a store's rows are: images (or any sample), text documents pooled one row each, or tokens.
    A ``StrEnum``: it is the string the store's ``kind`` attribute holds."""

    IMAGES = "images"
    DOCUMENTS = "documents"
    TOKENS = "tokens"

    @classmethod
    def of(cls, attrs: dict[str, Any]) -> Kind:
        """The kind a store's attributes record (stores from before kinds hold images)."""
        return cls(attrs.get("kind", cls.IMAGES))

    @property
    def text(self) -> bool:
        return self is not Kind.IMAGES

    @property
    def row(self) -> str:
        """The name of the rows' axis: ``sample``, ``document`` or ``token``."""
        return {"images": "sample", "documents": "document", "tokens": "token"}[self.value]

    @property
    def rows(self) -> str:
        """The rows in messages: ``samples``, ``documents`` or ``tokens``."""
        return {"images": "samples", "documents": "documents", "tokens": "tokens"}[self.value]

    @property
    def unit(self) -> str:
        """The rate's unit in the progress bar and the summary: ``img``, ``doc`` or ``tok``."""
        return {"images": "img", "documents": "doc", "tokens": "tok"}[self.value]


@dataclass(frozen=True)
class PackInfo:
    """``--pack T``: the documents' content tokens concatenated, ``separator`` between two documents,
    cut into contexts of exactly T tokens that each start with ``bos`` (where the model has one); the
    tail too short for a context is dropped. Deterministic: the order of the documents decides it.
    A store records it with the counts of what came of it (``record``; ``Features.pack``)."""

    context_length: int
    bos: int | None
    separator: int | None
    contexts: int | None = field(default=None, compare=False)  # what came of it, once known
    dropped_tokens: int | None = field(default=None, compare=False)
    source_documents: int | None = field(default=None, compare=False)

    @property
    def content(self) -> int:
        """Stream tokens per context."""
        return self.context_length - (self.bos is not None)

    @property
    def gap(self) -> int:
        return int(self.separator is not None)

    def stream_length(self, lengths: np.ndarray) -> int:
        """Tokens in the stream: every document's, and a separator between two non-empty ones."""
        filled = int((lengths > 0).sum())
        return int(lengths.sum()) + self.gap * max(0, filled - 1)

    def num_contexts(self, lengths: np.ndarray) -> int:
        return self.stream_length(lengths) // self.content

    def cut(self, lengths: np.ndarray) -> PackInfo:
        """This packing with the counts of what it makes of documents of ``lengths`` content tokens."""
        contexts = self.num_contexts(lengths)
        dropped = self.stream_length(lengths) - contexts * self.content
        return PackInfo(self.context_length, self.bos, self.separator, contexts, dropped, len(lengths))

    def identity(self) -> dict[str, Any]:
        """What decides the contexts: part of the job's identity."""
        return {"context_length": self.context_length, "bos": self.bos, "separator": self.separator}

    def record(self) -> dict[str, Any]:
        """The store's ``pack`` attribute."""
        return {
            **self.identity(),
            "contexts": self.contexts,
            "dropped_tokens": self.dropped_tokens,
            "source_documents": self.source_documents,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PackInfo:
        return cls(**{name: record.get(name) for name in cls.__dataclass_fields__})  # type: ignore[arg-type]
