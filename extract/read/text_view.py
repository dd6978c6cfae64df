"""A text store's token-level accessors, ``Features.text``: where each document's tokens are, their ids and
special-token flags, each token's document and position, packing, and one document's rows."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidRequestError, SampleIndexError
from ..names import Kind

if TYPE_CHECKING:  # the view is made by Features, which imports this module; torch only names a type
    import torch

    from .checked import CheckedReads
    from .features import Features


class TextView:
    """The token-level view of a text store (kind ``tokens`` or ``documents``), reached as ``features.text``.

    In a token store the rows are tokens and ``token_ids``, ``special``, ``doc`` and ``doc_position``
    are chunked like the features: a chunk that is damaged is named with the verify --repair fix. In a
    document store they, like ``offsets`` everywhere, were written whole at the store's creation.
    """

    def __init__(self, features: Features, reads: CheckedReads) -> None:
        self.features = features
        self.reads = reads  # the features' checked reads, which name a damaged chunk or object

    @property
    def pack(self) -> dict[str, Any] | None:
        """A packed token store's packing (``--pack T``): ``context_length`` T, ``contexts``, ``bos`` and
        ``separator`` ids (None where the model has none), ``dropped_tokens`` (the last short context) and
        ``source_documents``; None for any other store. Its samples are the contexts, and the per-token
        ``doc`` and ``doc_position`` map each token back to its source document."""
        return self.features.attrs.get("pack")

    @cached_property
    def offsets(self) -> np.ndarray:
        """(N_docs + 1,) int64: document i is tokens ``offsets[i]:offsets[i+1]`` (its rows, in a token store)."""
        return self.reads.whole("offsets")

    @cached_property
    def token_ids(self) -> np.ndarray:
        """(N_tokens,) int32: every document's token ids as the model saw them, special tokens included."""
        return self._per_token("token_ids", "token ids")

    def load_token_ids(self, tokens: slice) -> np.ndarray:
        """(n,) int32: the token ids of the tokens ``tokens`` picks, read now from the chunks that hold
        them (``token_ids`` reads every token's and keeps them)."""
        features = self.features
        self._has_token_rows("token_ids")
        array = features.store.array("token_ids")
        picked = slice(*tokens.indices(array.shape[0]))
        if features.kind is not Kind.TOKENS:  # a document store written before they were left out
            return self.reads.whole("token_ids", picked)
        rows = range(array.shape[0])[picked]
        first, last = sorted((rows[0], rows[-1])) if rows else (0, -1)
        touched = range(first // features.chunk_size, last // features.chunk_size + 1)
        placed = self.reads.placed("token_ids", array)
        return self.reads.checked("token_ids", "token ids", touched, lambda: np.asarray(placed[picked]))

    @cached_property
    def special(self) -> np.ndarray:
        """(N_tokens,) bool: the tokenizer's special tokens (BOS, CLS, SEP...), for readers to drop."""
        return self._per_token("special", "special tokens")

    @cached_property
    def doc(self) -> np.ndarray:
        """(N_tokens,) int32, packed stores (``--pack``): each token's source document (an index into
        ``keys``), -1 for the BOS and separators packing inserted."""
        return self._packed("doc")

    @cached_property
    def doc_position(self) -> np.ndarray:
        """(N_tokens,) int32, packed stores: each token's position among its source document's content
        tokens, -1 for inserted ones."""
        return self._packed("doc_position")

    @property
    def num_documents(self) -> int:
        """The segments of ``offsets``: the documents, except in a packed store (``--pack``), where they are
        the contexts (the model's sequences, each ``pack["context_length"]`` tokens) and the source
        documents, which ``keys`` and ``doc`` name, number ``num_source_documents``. Kept under this name
        for the readers written before packing; ``num_contexts`` says it plainly."""
        return len(self.offsets) - 1

    @property
    def num_contexts(self) -> int:
        """The sequences the model ran: a packed store's contexts; in any other text store each document was
        one (truncated to the context length), so this is ``num_documents``."""
        return len(self.offsets) - 1

    @property
    def num_source_documents(self) -> int:
        """The documents of the data: ``num_documents``, or in a packed store those packed into the contexts
        (one key each)."""
        pack = self.pack
        if pack is None:
            return self.num_documents
        return int(pack.get("source_documents") or len(self.features.keys))

    @cached_property
    def token_documents(self) -> np.ndarray:
        """(N_tokens,) int64: the document of each token (``documents_of`` for a few of them)."""
        return np.repeat(np.arange(self.num_documents), np.diff(self.offsets))

    def documents_of(self, tokens: slice | np.ndarray) -> np.ndarray:
        """The document of each token ``tokens`` picks (a slice or token indices), without the whole map."""
        if isinstance(tokens, slice):
            tokens = np.arange(*tokens.indices(int(self.offsets[-1])))
        return np.searchsorted(self.offsets, np.asarray(tokens), side="right") - 1

    @cached_property
    def token_positions(self) -> np.ndarray:
        """(N_tokens,) int64: each token's position in its document."""
        return np.arange(int(self.offsets[-1])) - self.offsets[:-1][self.token_documents]

    def document(self, index: int, layer: str | None = None, **load: Any) -> np.ndarray | torch.Tensor:
        """Document ``index``'s rows of ``layer`` (the only layer when None): (its tokens, D) in a token
        store, read chunk-wise like ``Features.load`` (which takes the same keyword arguments)."""
        features = self.features
        if features.kind is not Kind.TOKENS:
            raise InvalidRequestError(
                f"{features.path} is a {features.kind} store; document(i) reads a token store's rows (use load)"
            )
        if not -self.num_documents <= index < self.num_documents:
            raise SampleIndexError(f"document {index} is out of range for {self.num_documents} documents")
        index %= self.num_documents
        if layer is None:
            if len(features.layers) != 1:
                raise InvalidRequestError(f"name the layer: {features.path} has {', '.join(features.layers)}")
            layer = features.layers[0]
        return features.load(layer, slice(int(self.offsets[index]), int(self.offsets[index + 1])), **load)

    def _per_token(self, name: str, what: str) -> np.ndarray:
        """Every token's ``name``: in a token store chunk by chunk like the features (each chunk checked),
        in a document store an array written whole at creation."""
        features = self.features
        self._has_token_rows(name)
        if features.kind is not Kind.TOKENS:  # a document store written before they were left out
            return self.reads.whole(name)
        array = self.reads.placed(name, features.store.array(name))
        return self.reads.checked(name, what, range(features.num_chunks), lambda: np.asarray(array[:]))

    def _has_token_rows(self, name: str) -> None:
        """A document store keeps each document's token count (``offsets``), not its tokens' ``name``."""
        if self.features.kind is Kind.DOCUMENTS and not self.features.store.has(name):
            raise InvalidRequestError(
                f"{self.features.path} is a document store (one pooled row per document): it keeps each document's "
                f"token count (offsets), not its {name}; extract without --pool for a token store"
            )

    def _packed(self, name: str) -> np.ndarray:
        if self.pack is None:
            raise InvalidRequestError(
                f"{self.features.path} is not packed; '{name}' belongs to stores extracted with --pack (its "
                "rows' documents are token_documents)"
            )
        return self._per_token(name, name)
