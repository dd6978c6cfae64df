"""What the probes and comparisons read: the layers a user names (globs as the CLI expands them), and
the labelled rows of one layer of a store, read block by block so memory stays bounded. A layer that
cannot be read as asked raises ``UnusableLayerError``, so that a command skips that layer only."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..errors import ExtractError, LayerNotFoundError, UnusableLayerError
from ..names import Kind
from ..names.layers import closest, matches_glob
from ..read.features import Features

# Rows are read this many (pooled, float32) bytes at a time when a probe streams a layer.
BLOCK_BYTES = 16 * 2**20
# Rows that differ by less than this, relative to the largest value, are the same vector: float
# rounding of one computation that does not depend on the input.
CONSTANT_TOLERANCE = 1e-6


def open_rows(path: object, command: str) -> Features:
    """The store at ``path`` for a command that takes one row per sample (probe, compare, report): a
    token store has one row per token and its labels and keys per document, so it is refused by name."""
    from ..read.features import open_features

    features = open_features(path)  # type: ignore[arg-type]
    if features.kind is Kind.TOKENS:
        raise ExtractError(
            f"{path} stores one row per token; {command} takes one row per document: extract the same job "
            "with --pool mean (or last, max, first) into another store, or read the tokens with open_features"
        )
    return features


def no_layer_left(what: str, skipped: Mapping[str, str]) -> ExtractError:
    """The error once every layer was skipped: each one's reason, on one line."""
    reasons = "; ".join(f"{layer}: {reason}" for layer, reason in skipped.items())
    return ExtractError(f"no layer left to {what} ({reasons})")


def read_layer(features: Features, layer: str, rows: np.ndarray, pool: str | None) -> torch.Tensor:
    """(len(rows), dim) float32 of ``layer`` at store rows ``rows``, pooled and flattened."""
    try:
        return features.load(layer, rows, pool=pool, as_torch=True).flatten(1)
    except ExtractError as e:
        raise UnusableLayerError(features.path, layer, str(e)) from None


def spread(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per feature, the smallest and largest value over the rows of ``values``."""
    return values.amin(0), values.amax(0)


def is_constant(low: torch.Tensor, high: torch.Tensor) -> bool:
    """Whether features ranging from ``low`` to ``high`` are one vector up to float rounding."""
    scale = float(torch.maximum(low.abs(), high.abs()).max()) if low.numel() else 0.0
    return low.numel() == 0 or float((high - low).max()) <= CONSTANT_TOLERANCE * scale


def select_layers(stored: Sequence[str], patterns: Sequence[str] | None, *, store: object = "the store") -> list[str]:
    """Expand names and globs (``*`` stays within one dotted segment, as for ``--layers`` at extraction)
    against a store's layers, in the store's (model) order; all of them when ``patterns`` is empty."""
    if not patterns:
        return list(stored)
    picked: set[str] = set()
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            found = [name for name in stored if matches_glob(pattern, name)]
        else:
            found = [pattern] if pattern in stored else []
        if not found:
            raise LayerNotFoundError(
                f"layer '{pattern}' is not in {store}; closest: {closest(pattern, list(stored))} "
                f"(it has {len(stored)} layers: {', '.join(stored[:8])}{', ...' if len(stored) > 8 else ''})"
            )
        picked.update(found)
    return [name for name in stored if name in picked]


def default_pool(features: Features, layer: str) -> str | None:
    """avg for (C, H, W) maps, cls for (T, D) tokens, nothing for vectors."""
    return {3: "avg", 2: "cls"}.get(len(features.shapes[layer]))


def labelled_rows(features: Features) -> np.ndarray:
    """Sorted indices of the samples that have a label and features."""
    return np.flatnonzero((features.labels >= 0) & features.valid)


@dataclass
class Samples:
    """Some rows (sorted) of one layer, reduced by ``pool`` and flattened to vectors, with their labels."""

    features: Features
    layer: str
    pool: str | None
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def labels(self) -> np.ndarray:
        return self.features.labels[self.rows]

    @cached_property
    def dim(self) -> int:
        return int(self.read(self.rows[:1]).shape[1])

    def read(self, rows: np.ndarray) -> torch.Tensor:
        """(len(rows), dim) float32 for store rows ``rows``."""
        return read_layer(self.features, self.layer, rows, self.pool)

    @cached_property
    def constant(self) -> bool:
        """Whether every row holds the same vector (a layer that does not depend on the input, such as
        a ViT's first class token): nothing can be learnt from it. Usually decided by the first block."""
        low = high = None
        for _, values, _ in self.blocks():
            block_low, block_high = spread(values)
            low = block_low if low is None else torch.minimum(low, block_low)
            high = block_high if high is None else torch.maximum(high, block_high)
            if not is_constant(low, high):
                return False
        return low is not None

    def block_rows(self, block_bytes: int = BLOCK_BYTES, max_rows: int | None = None) -> int:
        """Rows per block: whole chunks (at least one), about ``block_bytes`` of float32 vectors and
        at most ``max_rows``."""
        chunk = self.features.chunk_size
        chunks = block_bytes // max(1, chunk * self.dim * 4)
        if max_rows is not None:
            chunks = min(chunks, max_rows // chunk)
        return chunk * max(1, chunks)

    def blocks(
        self, block_bytes: int = BLOCK_BYTES, max_rows: int | None = None
    ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
        """(positions in ``rows``, features, labels) block by block in store order; each block is
        a run of whole chunks, so every chunk is read once per pass."""
        span = self.block_rows(block_bytes, max_rows)
        if len(self.rows) == 0:
            return
        edges = np.arange(self.rows[0] - self.rows[0] % span, self.rows[-1] + span, span)
        bounds = np.searchsorted(self.rows, edges)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            if lo < hi:
                part = slice(int(lo), int(hi))
                yield part, self.read(self.rows[part]), torch.from_numpy(self.labels[part])

    def load(self) -> torch.Tensor:
        """Every row at once (the exact full-batch path, for small N)."""
        return self.read(self.rows)
