"""What a store holds, defined in one place: its format, its codecs, and the identity and attributes
built from the job's parts.

The parts come in as plain values (``JobParts``): the job's options and what the model source, the
data source and the layer set-up resolved them to. The store package never sees a model or a data
source; the runner collects the parts and asks this module for the store's metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from zarr.codecs import BloscCodec, ZstdCodec

from ..errors import InvalidRequestError
from ..names import COMPRESSORS
from . import checksum

FORMAT = "extract-features"
# 2: every object has a crc32c checksum; 3: a done chunk's objects' checksums are recorded in ``digests``,
# and the identity attributes' digests in ``identity_sha256``
FORMAT_VERSION = 3
KNOWN_FORMAT_VERSIONS = (1, 2, 3)
# numpy's variable-width strings: zarr writes them 3x faster than fixed-width "<U" (numpy >= 2)
STRINGS = np.dtypes.StringDType() if hasattr(np.dtypes, "StringDType") else str
# the identity's fields a reader most often wants, copied to the top level of the attributes
# the attributes that say what the store holds, digested at creation (``identity_digests``); the job's
# record (``runs``, ``status``, ``summary``, a writer's token) changes legitimately and is left out
# (``latents``: each --sae layer's SAE as recorded, ``latents.py``)
IDENTITY_ATTRIBUTES = (
    "format", "format_version", "identity", "fingerprint", "layers", "num_samples", "chunk_size", "latents",
)  # fmt: skip
# digested only from a later version on: a store made before has no digest of them, and is checked without
ADDED_LATER = ("latents",)
TOP_LEVEL = ("model", "weights", "preprocessing", "num_samples", "chunk_size", "dtype", "precision", "pool")


def codecs(compressor: str) -> list[Any] | None:
    """The compressor of ``--compressor`` (refused by name when unknown)."""
    if compressor == "zstd":
        return [ZstdCodec(level=1)]
    if compressor == "blosc":
        return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]
    if compressor == "bitshuffle":  # blosc lz4 on the bits: the most bytes saved on dense activations, cheaply
        return [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")]
    if compressor == "none":
        return None
    raise InvalidRequestError(f"unknown --compressor '{compressor}'; choose one of {', '.join(COMPRESSORS)}")


def checked(compressors: list[Any] | None) -> list[Any]:
    """The checksum goes last: it covers the bytes as stored, after compression."""
    return [*(compressors or []), checksum.codec()]


def fingerprint(identity: Mapping[str, Any]) -> str:
    """A stable hash of everything that decides the stored values and layout."""
    return _digest(identity)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def identity_digests(attrs: Mapping[str, Any], arrays: Sequence[str]) -> dict[str, str]:
    """A digest of each identity attribute and of the store's list of arrays: ``verify`` recomputes
    them and names the attribute that was edited (one digest of them all could not say which)."""
    values = {name: attrs.get(name) for name in IDENTITY_ATTRIBUTES} | {"arrays": sorted(arrays)}
    return {name: _digest(value) for name, value in values.items()}


@dataclass(frozen=True)
class JobParts:
    """A job's parts as plain values: ``options`` (the job's options as a dict, ``JobSpec.to_dict()``)
    and what the model, the data and the layer set-up made of them."""

    options: Mapping[str, Any]
    data: str  # --data as the identity records it: its path resolved (one job however the path is given)
    weights: str  # the weights the model source loaded
    checkpoint_sha256: str | None
    source: str  # the model source
    preprocess: str  # the repr of the model's own transform: it decides the stored values
    preprocessing: Mapping[str, Any]  # that transform described field by field
    layers: Sequence[str]  # resolved layer names, in the order asked
    resolved_layers: Mapping[str, str]  # each layer's name -> the tensor it is: module, module:0, module@input
    shapes: Mapping[str, tuple[int, ...]]  # stored shape per sample, per layer
    pools: Mapping[str, str]
    layouts: Mapping[str, str | None]  # stored layout per layer (none once pooled)
    data_listing_sha256: str | None
    classes: Sequence[str] | None
    num_samples: int
    chunk_size: int
    precision: str
    versions: Mapping[str, str]
    image_root: str | None = None  # where the data source's images live (the report's thumbnails)
    # text jobs: kind (tokens | documents), tokenization (tokenizer, context length, data), num_documents, num_tokens
    text: Mapping[str, Any] | None = None
    model_pooling: Mapping[str, Any] | None = None  # --pool model: the pooling the model's files named, as applied
    saes: Mapping[str, Any] | None = None  # --sae: each layer's SAE (weights' sha256, k) and --sae-only
    tensor_parallel: int = 1  # --tensor-parallel: a sum split over N ranks changes the last bits
    # which rows share a forward and how it runs (``extract.job.spec.batching``): another batch rounds otherwise
    batching: Mapping[str, Any] | None = None

    def identity(self) -> dict[str, Any]:
        """Everything that decides the stored values and their layout: a store is resumed only by a job
        with the same identity, and a differing one is named field by field."""
        options = self.options
        pool = options["pool"]
        identity = {
            "model": options["model"],
            "weights": self.weights,
            "checkpoint_sha256": self.checkpoint_sha256,
            "layers": list(self.layers),
            "data": self.data,
            "data_listing_sha256": self.data_listing_sha256,
            "image_key": options["image_key"],
            "label_key": options["label_key"],
            "decode": options["decode"],
            "exif_transpose": options["exif_transpose"],
            "num_samples": self.num_samples,
            "pool": pool if isinstance(pool, str) else list(pool),
            "dtype": options["dtype"],
            "precision": self.precision,
            "chunk_size": self.chunk_size,
            "compressor": options["compressor"],
            "preprocessing": self.preprocess,
        }
        if options.get("layout"):
            identity["layout"] = list(options["layout"])
        if self.text is not None:  # image stores keep the identity they always had
            identity["kind"] = self.text["kind"]
            identity["tokenization"] = dict(self.text["tokenization"])
        if self.model_pooling is not None:  # the files behind --pool model decide the values too
            identity["model_pooling"] = dict(self.model_pooling)
        if self.saes is not None:  # the SAE decides the codes: a resume with another is refused
            identity["sae"] = dict(self.saes)
        if self.tensor_parallel > 1:  # stores made on one device keep the identity they always had
            identity["tensor_parallel"] = self.tensor_parallel
        identity.update(self.batching or {})  # a store made before it was recorded: ``StoreLife.decide``
        return identity

    def attributes(self) -> dict[str, Any]:
        """The store's attributes at creation: the identity and its fingerprint, the job, its top-level
        copies, and what a reader needs to interpret the arrays."""
        identity = self.identity()
        return {
            "status": "running",
            "fingerprint": fingerprint(identity),
            "identity": identity,
            "job": dict(self.options),
            **{key: identity[key] for key in TOP_LEVEL},
            "source": self.source,
            "preprocessing": dict(self.preprocessing),
            "pools": dict(self.pools),
            **({"model_pooling": dict(self.model_pooling)} if self.model_pooling is not None else {}),
            "layouts": dict(self.layouts),
            "dataset": self.options["data"],
            **({"image_root": self.image_root} if self.image_root is not None else {}),
            "classes": self.classes,
            "layers": list(self.shapes),
            "resolved_layers": dict(self.resolved_layers),
            "feature_shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "versions": dict(self.versions),
            "runs": [],
            **(self._text_attributes() if self.text is not None else {}),
        }

    def _text_attributes(self) -> dict[str, Any]:
        text = self.text or {}
        tokenization = text["tokenization"]
        return {
            "kind": text["kind"],
            "num_documents": text["num_documents"],
            "num_tokens": text["num_tokens"],
            "tokenizer": tokenization["tokenizer"],
            "context_length": tokenization["context_length"],
            **({"pack": dict(text["pack"])} if text.get("pack") is not None else {}),
        }
