"""Layer similarity: linear CKA between every pair of layers of one store, or of two stores.

    compare("A.zarr", "B.zarr:layer3,layer4", max_samples=10_000)   # a CKA: matrix, layer names, samples

(``python -m extract.compare``, in ``extract.cli.compare``, is the command over ``compare``.) Each
store may name its LAYERS after a colon, a comma-separated list of names or globs (``encoder.layers.*``).
Two stores are compared over the samples they share, matched by their ``keys`` (by row index when a
store has no keys and both have the same N, which is said).

The estimator is minibatch CKA (Nguyen, Raghu and Kornblith, 2021): the unbiased HSIC estimator of
Song et al. (2012), summed over minibatches, CKA = sum HSIC(K, L) / sqrt(sum HSIC(K, K) sum HSIC(L, L)).
Memory holds one window of chunks of every layer (about 512 MiB unless ``window`` says how many
chunks) and one minibatch's Gram matrices per layer, whatever N is; each chunk is read once. The
minibatches are drawn from windows of randomly chosen chunks (a store in class order must not give
one-class minibatches, which would measure within-class similarity only).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..errors import ExtractError
from ..read.features import Features, open_features
from .samples import default_pool, select_layers

# One window of chunks, every layer read, takes about this much memory (float32) unless ``window`` says.
WINDOW_BYTES = 512 * 2**20


def keys_and_classes(features: Features) -> tuple[np.ndarray | None, list[str] | None]:
    """The store's ``keys`` (N,) and class names, None where absent (stores written before keys)."""
    try:
        keys = np.asarray(features.keys, dtype=object)
    except ExtractError:
        keys = None
    return keys, features.classes


@dataclass
class Side:
    """Layers of one store and the rows of it that take part, paired by position with the other side's."""

    features: Features
    layers: list[str]
    pools: dict[str, str | None]
    rows: np.ndarray

    @cached_property
    def dims(self) -> dict[str, int]:
        """Features per sample of each layer after pooling."""
        return {layer: value.shape[1] for layer, value in self.read(np.arange(min(1, len(self.rows)))).items()}

    def read(self, positions: np.ndarray) -> dict[str, torch.Tensor]:
        rows = self.rows[positions]
        return {
            layer: self.features.load(layer, rows, pool=self.pools[layer], as_torch=True).flatten(1)
            for layer in self.layers
        }


def shared_rows(a: Features, b: Features) -> tuple[np.ndarray, np.ndarray, str]:
    """Rows of ``a`` and of ``b`` holding the same samples (valid in both), in ``a``'s order, and how they matched."""
    keys_a, _ = keys_and_classes(a)
    keys_b, _ = keys_and_classes(b)
    if keys_a is not None and keys_b is not None:
        _, rows_a, rows_b = np.intersect1d(keys_a, keys_b, assume_unique=False, return_indices=True)
        how = f"{len(rows_a)} samples matched by key"
    elif a.num_samples == b.num_samples:
        rows_a = rows_b = np.arange(a.num_samples)
        how = f"matched by row index ({a.num_samples} samples; a store has no keys, so sample i is assumed the same in both)"
    else:
        raise ExtractError(
            f"{a.path} ({a.num_samples} samples) and {b.path} ({b.num_samples}) cannot be matched: a store has no "
            "keys; re-extract it with a version that stores keys, or compare stores with the same samples"
        )
    order = np.argsort(rows_a, kind="stable")
    rows_a, rows_b = rows_a[order], rows_b[order]
    keep = a.valid[rows_a] & b.valid[rows_b]
    return rows_a[keep], rows_b[keep], how


def _minibatches(
    rows: np.ndarray, chunk_size: int, batch_size: int, window: int, seed: int
) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Per window of ``window`` randomly chosen chunks (of the first side's store): the window's
    positions into ``rows`` (sorted, to be read at once) and its minibatches, shuffled indices into them."""
    rng = np.random.default_rng(seed)
    chunk_of = rows // chunk_size
    chunks = rng.permutation(np.unique(chunk_of))
    for start in range(0, len(chunks), window):
        positions = np.flatnonzero(np.isin(chunk_of, chunks[start : start + window]))
        order = rng.permutation(len(positions))
        yield positions, [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def default_window(sides: Sequence[Side], chunk_size: int, budget_bytes: int = WINDOW_BYTES) -> int:
    """Chunks per window such that one window of every layer (float32) takes about ``budget_bytes``."""
    row_bytes = sum(4 * side.dims[layer] for side in sides for layer in side.layers)
    return max(1, budget_bytes // max(1, row_bytes * chunk_size))


def _centered_grams(values: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """(layers, n*n) Gram matrices of the batch with their diagonals zeroed (the K tilde of the
    unbiased estimator), from features centered per batch (the estimator is translation invariant,
    and centering keeps float precision)."""
    grams = []
    for x in values.values():
        x = x.to(device, torch.float64)
        x = x - x.mean(0)
        gram = x @ x.T
        gram.fill_diagonal_(0)
        grams.append(gram.flatten())
    return torch.stack(grams)


def _hsic1(grams_a: torch.Tensor, grams_b: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased HSIC (Song et al. 2012, eq. 5) of every Gram in ``grams_a`` with every one in ``grams_b``."""
    sum_a = grams_a.view(len(grams_a), n, n).sum(2)  # (layers, n): K~ 1
    sum_b = grams_b.view(len(grams_b), n, n).sum(2)
    trace = grams_a @ grams_b.T  # tr(K~ L~) = sum of the elementwise product (both symmetric)
    totals = sum_a.sum(1)[:, None] * sum_b.sum(1)[None, :] / ((n - 1) * (n - 2))
    cross = sum_a @ sum_b.T * (2 / (n - 2))
    return (trace + totals - cross) / (n * (n - 3))


def _hsic1_self(grams: torch.Tensor, n: int) -> torch.Tensor:
    """The diagonal of ``_hsic1(grams, grams, n)`` without the cross terms."""
    sums = grams.view(len(grams), n, n).sum(2)
    trace = grams.square().sum(1)
    return (trace + sums.sum(1).square() / ((n - 1) * (n - 2)) - sums.square().sum(1) * (2 / (n - 2))) / (n * (n - 3))


@dataclass(frozen=True)
class CKA:
    rows: list[str]  # layer names of the first side
    cols: list[str]
    matrix: np.ndarray  # (len(rows), len(cols))
    num_samples: int
    matched: str


def minibatch_cka(
    a: Side,
    b: Side | None = None,
    *,
    batch_size: int = 1024,
    window: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> CKA:
    """Linear CKA between ``a``'s layers and ``b``'s (``a``'s own when ``b`` is None); rows are paired by position."""
    device = torch.device(device)
    if batch_size < 4:
        raise ExtractError(
            f"--batch-size must be at least 4 (the unbiased estimator needs 4 samples), got {batch_size}"
        )
    same = b is None
    other = a if b is None else b
    cross = torch.zeros(len(a.layers), len(other.layers), dtype=torch.float64)
    self_a = torch.zeros(len(a.layers), dtype=torch.float64)
    self_b = torch.zeros(len(other.layers), dtype=torch.float64)
    used = 0
    if window is None:
        window = default_window([a] if same else [a, other], a.features.chunk_size)
    for positions, batches in _minibatches(a.rows, a.features.chunk_size, batch_size, window, seed):
        values_a = a.read(positions)  # the whole window once: its chunks are read once per pass
        values_b = values_a if same else other.read(positions)
        for batch in batches:
            n = len(batch)
            if n < 4:  # a window's last few rows: too few for the estimator
                continue
            index = torch.from_numpy(batch)
            grams_a = _centered_grams({k: v[index] for k, v in values_a.items()}, device)
            grams_b = grams_a if same else _centered_grams({k: v[index] for k, v in values_b.items()}, device)
            weight = n / batch_size  # a short last batch counts for its size (still unbiased)
            cross += weight * _hsic1(grams_a, grams_b, n).cpu()
            if not same:
                self_a += weight * _hsic1_self(grams_a, n).cpu()
                self_b += weight * _hsic1_self(grams_b, n).cpu()
            used += n
    if used == 0:
        raise ExtractError(f"fewer than 4 samples to compare ({len(a.rows)}): CKA needs at least 4")
    if same:
        self_a = self_b = cross.diagonal().clone()
    matrix = cross / (self_a[:, None] * self_b[None, :]).clamp_min(1e-300).sqrt()
    return CKA(a.layers, other.layers, matrix.numpy(), used, "")


def parse_target(text: str) -> tuple[str, list[str] | None]:
    """``STORE`` or ``STORE:L1,L2`` (names or globs): the store is the longest prefix that is a directory,
    so layer names may themselves hold a colon (``blocks.0:0``)."""
    if Path(text).is_dir():
        return text, None
    for at in [i for i, c in enumerate(text) if c == ":"]:
        if Path(text[:at]).is_dir():
            layers = [name for name in text[at + 1 :].split(",") if name]
            return text[:at], layers or None
    raise ExtractError(f"{text}: no such store (write STORE or STORE:LAYER,LAYER)")


def side(features: Features, patterns: Sequence[str] | None, rows: np.ndarray, pool: str | None) -> Side:
    layers = select_layers(features.layers, patterns, store=features.path)
    return Side(features, layers, {layer: pool or default_pool(features, layer) for layer in layers}, rows)


def compare(
    first: str,
    second: str | None = None,
    *,
    pool: str | None = None,
    batch_size: int = 1024,
    window: int | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> CKA:
    """CKA for ``python -m extract.compare FIRST [SECOND]`` (each ``STORE[:LAYERS]``)."""
    path_a, layers_a = parse_target(first)
    a = open_features(path_a)
    if second is None:
        rows_a = rows_b = np.flatnonzero(a.valid)
        matched, b = f"{len(rows_a)} samples of one store", None
    else:
        path_b, layers_b = parse_target(second)
        b = open_features(path_b)
        rows_a, rows_b, matched = shared_rows(a, b)
    if max_samples is not None and len(rows_a) > max_samples:
        keep = np.sort(np.random.default_rng((seed, 3)).choice(len(rows_a), max_samples, replace=False))
        rows_a, rows_b = rows_a[keep], rows_b[keep]
        matched += f", {max_samples} drawn at random"
    side_a = side(a, layers_a, rows_a, pool)
    side_b = None if b is None else side(b, layers_b, rows_b, pool)
    result = minibatch_cka(side_a, side_b, batch_size=batch_size, window=window, seed=seed, device=device)
    return CKA(result.rows, result.cols, result.matrix, result.num_samples, matched)


def format_matrix(cka: CKA) -> str:
    """The matrix as aligned text, rows and columns labelled with the layer names."""
    width = max(5, *(len(c) for c in cka.cols))
    head = max(len(r) for r in cka.rows)
    lines = [" " * head + "  " + "  ".join(c.rjust(width) for c in cka.cols)]
    for name, values in zip(cka.rows, cka.matrix, strict=True):
        lines.append(name.ljust(head) + "  " + "  ".join(f"{v:.3f}".rjust(width) for v in values))
    return "\n".join(lines)
