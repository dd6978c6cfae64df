"""What ``TokenStream`` reads besides one token store's layers: the rows of an image store's per-position
layers (a ViT block's patches, a conv map's positions), and the check that several token stores hold
the same tokens, so that their rows can be read side by side (a crosscoder's models, a transcoder's or
CLT's layers of two runs).

Alignment is proven without reading the token rows: the tokenizer's digest, the packing, the token
count and chunking from the attributes, the documents' offsets (a few bytes each), then the crc32c that
ends each chunk object of ``token_ids``, ``special``, ``doc`` and ``doc_position`` (the checksum codec's,
4 bytes an object, as ``verify`` reads them). Only a chunk whose checksums differ is read and compared
(the same ids compressed by another zstd build give other bytes), so stores that differ are told apart
at their first differing chunk; a store from before checksums is read chunk by chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..errors import InvalidRequestError, UnalignedStoresError
from ..names import Kind
from ..store.arrays import PACKED_ARRAYS, TOKEN_ARRAYS
from ..store.chunks import Plan
from .features import Features

if TYPE_CHECKING:  # rows are numpy or torch, whichever the caller reads: export reads numpy, without torch
    import torch

# the layouts whose positions are rows: a token axis (L) or a map's height and width (H, W) beside C
PATCH_LAYOUTS = ("NLC", "NCL", "NHWC", "NCHW")
ALIGNED = (
    "TokenStream reads stores side by side only when they were extracted from the same corpus with the same "
    "tokenizer, --pack and --chunk-size"
)
Values = TypeVar("Values", np.ndarray, "torch.Tensor")


@dataclass(frozen=True)
class Rows:
    """How one sample of a layer lies as rows of D values: ``shape`` is the stored per-sample shape and
    ``channels`` the axis of a chunk (samples first) that holds D, or None for a layer stored as one (D,)
    row per sample (a token's row). A per-position layer has ``positions`` rows per sample, in the
    stored order of its positions: tokens for NLC/NCL (a ViT's CLS, registers, then patches), ``h * W + w``
    for NCHW/NHWC maps."""

    shape: tuple[int, ...]
    channels: int | None = None

    @property
    def width(self) -> int:
        return self.shape[0] if self.channels is None else self.shape[self.channels - 1]

    @property
    def positions(self) -> int:
        return 1 if self.channels is None else math.prod(self.shape) // self.width

    @property
    def contiguous(self) -> bool:
        """Whether a chunk's rows are its bytes as stored (channels last): zarr can decode into them."""
        return self.channels is None or self.channels == len(self.shape)

    def moved_shape(self, samples: int) -> tuple[int, ...]:
        """The shape of ``samples`` samples with the channels last, whose rows are ``as_rows``'s."""
        if self.channels is None:
            return (samples, *self.shape)
        rest = [n for axis, n in enumerate(self.shape, start=1) if axis != self.channels]
        return (samples, *rest, self.width)

    def as_rows(self, values: Values) -> Values:
        """(n, *shape) stored values as (n x positions, D) rows: a view when ``contiguous``, else a copy."""
        if self.channels is None:
            return values
        if isinstance(values, np.ndarray):
            return np.moveaxis(values, self.channels, -1).reshape(-1, self.width)
        return values.movedim(self.channels, -1).reshape(-1, self.width)  # a tensor


def layer_rows(features: Features, layer: str) -> Rows:
    """Layer ``layer`` of ``features`` as rows: a token store's (D,) rows, or an image store's positions
    when the store records its layout (a ViT block, a conv map, kept whole with ``--pool none``). A
    pooled image layer, a document store and a layer of unknown layout are refused in one line."""
    shape = features.pooled_shape(layer)  # an unknown layer: LayerNotFoundError with the valid names
    if features.kind is Kind.TOKENS:
        if len(shape) != 1:
            raise InvalidRequestError(f"{features.path}: layer '{layer}' is not stored as (tokens, D) rows")
        return Rows(shape)
    if features.kind is not Kind.IMAGES:
        raise InvalidRequestError(
            f"{features.path} is not a token store (kind '{features.kind}'); TokenStream reads token stores' rows "
            "and image stores' patches: read this one with FeatureDataset"
        )
    layout = features.layout(layer)
    if layout in PATCH_LAYOUTS and len(layout) == len(shape) + 1:
        return Rows(shape, layout.index("C"))
    stored = ", ".join(map(str, shape))
    if len(shape) == 1:
        raise InvalidRequestError(
            f"{features.path}: layer '{layer}' of this image store is one {tuple(shape)} row per image, pooled at "
            "extraction, not one per patch; read it with FeatureDataset, or extract it with --pool none"
        )
    raise InvalidRequestError(
        f"{features.path}: layer '{layer}' is stored as ({stored}) per image and the store records no layout "
        f"({', '.join(PATCH_LAYOUTS)}) saying which axis holds the channels; extract it again with --layout"
    )


def check_aligned(stores: Sequence[Features]) -> None:
    """Raise ``UnalignedStoresError`` naming the first difference unless every store holds the first
    one's tokens: row r of each is the same token of the same context, in the same chunk."""
    first = stores[0]
    for other in stores[1:]:
        difference = _difference(first, other)
        if difference is not None:
            raise UnalignedStoresError(
                f"{other.path} does not hold the tokens of {first.path}: {difference}; {ALIGNED}"
            )


def _difference(a: Features, b: Features) -> str | None:
    for check in (_recorded_difference, _document_difference, _token_difference):
        found = check(a, b)
        if found is not None:
            return found
    return None


def _recorded_difference(a: Features, b: Features) -> str | None:
    """The first difference in what the stores' attributes say about their tokens."""
    for store in (a, b):
        if store.kind is not Kind.TOKENS:
            return f"{store.path} is a store of kind '{store.kind}', not of tokens (--pool none on a text model)"
    tokenizers = [(store.attrs.get("tokenizer") or {}).get("sha256") for store in (a, b)]
    if None not in tokenizers and tokenizers[0] != tokenizers[1]:
        return f"another tokenizer (sha256 {tokenizers[0][:12]} vs {tokenizers[1][:12]})"
    if a.pack != b.pack:
        return _pack_difference(a.pack, b.pack)
    if a.num_samples != b.num_samples:
        return f"{a.num_samples} tokens vs {b.num_samples}"
    if a.chunk_size != b.chunk_size:
        return f"chunks of {a.chunk_size} tokens vs {b.chunk_size} (--chunk-size)"
    return None


def _pack_difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    if a is None or b is None:
        packed = a or b
        which = "the first" if a is not None else "the second"
        return f"{which} is packed (--pack {packed['context_length']}) and the other is not"
    if a.get("context_length") != b.get("context_length"):
        return f"--pack {a.get('context_length')} vs --pack {b.get('context_length')}"
    key = next(key for key in sorted({*a, *b}) if a.get(key) != b.get(key))
    return f"the packing's {key} is {a.get(key)} vs {b.get(key)}"


def _document_difference(a: Features, b: Features) -> str | None:
    """The first document whose place differs (``offsets``; packed: the source documents' lengths): a few
    bytes a document, read whole."""
    names = ["offsets", *(["source_lengths"] if a.pack is not None else [])]
    for name in names:
        values = [store._reads.whole(name) for store in (a, b)]
        if len(values[0]) != len(values[1]):
            what = "documents (contexts)" if name == "offsets" else "source documents"
            return f"{len(values[0]) - (name == 'offsets')} {what} vs {len(values[1]) - (name == 'offsets')}"
        unequal = np.flatnonzero(values[0] != values[1])
        if len(unequal):
            i = int(unequal[0])
            if name == "offsets":
                return f"document {i} starts at token {values[0][i]} vs {values[1][i]} (offsets[{i}])"
            return f"source document {i} has {values[0][i]} tokens vs {values[1][i]}"
    return None


def _token_difference(a: Features, b: Features) -> str | None:
    """The first token whose id (or special flag, source document, position in it) differs: chunks whose
    objects have the same crc32c are the same bytes; the others are read and compared."""
    names = [*TOKEN_ARRAYS, *(PACKED_ARRAYS if a.pack is not None else ())]
    plan = Plan(a.num_samples, a.chunk_size)
    digests = [_object_digests(store, names, plan.num_chunks) for store in (a, b)]
    suspects = (digests[0] != digests[1]).any(axis=1) | (digests[0] < 0).any(axis=1)
    for k in np.flatnonzero(suspects).tolist():
        start, stop = plan.bounds(k)
        for name in names:
            values = [_chunk_of(store, name, k, start, stop) for store in (a, b)]
            unequal = np.flatnonzero(values[0] != values[1])
            if len(unequal):
                t = start + int(unequal[0])
                return f"token {t} (chunk {k}) has {name} {values[0][t - start]} vs {values[1][t - start]}"
    return None


def _object_digests(store: Features, names: list[str], num_chunks: int) -> np.ndarray:
    """(K, len(names)) int64: the crc32c that ends each chunk object of ``names`` (the checksum codec's,
    read as 4 bytes, as ``verify`` reads them), -1 where there is none to compare: an object absent or too
    short, or a store from before checksums (every chunk is then read)."""
    if store.attrs.get("format_version", 0) < 2:
        return np.full((num_chunks, len(names)), -1, dtype=np.int64)
    found = store.store.integrity.object_digests(range(num_chunks), names)
    return np.array([[-1 if d is None else d for d in found[k]] for k in range(num_chunks)], dtype=np.int64)


def _chunk_of(store: Features, name: str, chunk: int, start: int, stop: int) -> np.ndarray:
    array = store._reads.placed(name, store.store.array(name))
    read: Callable[[], np.ndarray] = lambda: np.asarray(array[start:stop])  # noqa: E731
    return store._reads.checked(name, name.replace("_", " "), [chunk], read)
