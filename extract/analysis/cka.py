"""Layer similarity: linear CKA between every pair of layers of one store, or of two stores.

    compare("A.zarr", "B.zarr:layer3,layer4", max_samples=10_000)   # a CKA: matrix, layer names, samples

(``python -m extract.compare``, in ``extract.cli.compare``, is the command over ``compare``.) Each
store may name its LAYERS after a colon, a comma-separated list of names or globs (``encoder.layers.*``).
Two stores are compared over the samples they share, matched by their ``keys`` (by row index when a
store has no keys and both have the same N, which is said, or when ``match="rows"`` asks: the same
images read from different sources have different keys).

A layer that cannot be read as asked is left out with a note (``CKA.notes``); a constant layer (the
same features for every sample) has no CKA with anything: its row and column are NaN, with a note.

The estimator is minibatch CKA (Nguyen, Raghu and Kornblith, 2021): the unbiased HSIC estimator of
Song et al. (2012), summed over minibatches, CKA = sum HSIC(K, L) / sqrt(sum HSIC(K, K) sum HSIC(L, L)).
Memory holds one window of chunks of every layer (about 512 MiB unless ``window`` says how many
chunks) and one minibatch's Gram matrices per layer, whatever N is; each chunk is read once. The
minibatches are drawn from windows of randomly chosen chunks (a store in class order must not give
one-class minibatches, which would measure within-class similarity only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..errors import ExtractError, InvalidRequestError
from ..read.features import Features
from ..store import objects
from ..store.location import LocationError, from_object_storage, is_url, one_line, open_store, parse
from .options import MATCHES
from .samples import (
    UnusableLayerError,
    default_pool,
    is_constant,
    no_layer_left,
    open_rows,
    read_layer,
    select_layers,
    spread,
)

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
        return {layer: read_layer(self.features, layer, rows, self.pools[layer]) for layer in self.layers}

    def without(self, layer: str) -> Side:
        return Side(self.features, [name for name in self.layers if name != layer], self.pools, self.rows)


def shared_rows(a: Features, b: Features, match: str = "keys") -> tuple[np.ndarray, np.ndarray, str]:
    """Rows of ``a`` and of ``b`` holding the same samples (valid in both), in ``a``'s order, and how
    they matched: by key, or by row index (``match="rows"``, or when a store has no keys)."""
    if match not in MATCHES:
        raise InvalidRequestError(f"unknown --match '{match}'; choose one of {', '.join(MATCHES)}")
    keys_a, _ = keys_and_classes(a)
    keys_b, _ = keys_and_classes(b)
    if match == "keys" and keys_a is not None and keys_b is not None:
        _, rows_a, rows_b = np.intersect1d(keys_a, keys_b, assume_unique=False, return_indices=True)
        if len(rows_a) == 0:
            raise _no_key_matches(a, b, keys_a, keys_b)
        how = f"{len(rows_a)} samples matched by key"
    elif a.num_samples == b.num_samples:
        rows_a = rows_b = np.arange(a.num_samples)
        why = "--match rows" if match == "rows" else "a store has no keys"
        how = f"matched by row index ({a.num_samples} samples; {why}, so sample i is assumed the same in both)"
    elif match == "rows":
        raise InvalidRequestError(
            f"--match rows needs stores of the same size: {a.path} has {a.num_samples} samples, {b.path} {b.num_samples}"
        )
    else:
        raise ExtractError(
            f"{a.path} ({a.num_samples} samples) and {b.path} ({b.num_samples}) cannot be matched: a store has no "
            "keys; re-extract it with a version that stores keys, or compare stores with the same samples"
        )
    order = np.argsort(rows_a, kind="stable")
    rows_a, rows_b = rows_a[order], rows_b[order]
    keep = a.valid[rows_a] & b.valid[rows_b]
    return rows_a[keep], rows_b[keep], how


def _no_key_matches(a: Features, b: Features, keys_a: np.ndarray, keys_b: np.ndarray) -> ExtractError:
    """No key in common: the same images from different sources (a folder, shards, Parquet) are keyed
    differently; matching by row is offered when it can be right, i.e. when N agrees."""
    first = f"no keys match between {a.path} and {b.path} (e.g. '{keys_a[0]}' and '{keys_b[0]}')"
    if a.num_samples == b.num_samples:
        return ExtractError(
            f"{first}; if row i is the same image in both ({a.num_samples} samples each), compare with --match rows"
        )
    return ExtractError(f"{first}, and they hold {a.num_samples} and {b.num_samples} samples: not the same images")


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
    matrix: np.ndarray  # (len(rows), len(cols)); NaN in the row and column of a constant layer
    num_samples: int
    matched: str
    row_store: str = ""  # the stores the rows' and the columns' layers come from
    col_store: str = ""
    notes: tuple[str, ...] = ()  # layers left out, constant layers
    constant: tuple[str, ...] = ()  # layers (of either side) whose features are the same for every sample


class _Spread:
    """Per layer, the range of each feature over every row seen so far: constant layers are those
    whose range stays nil."""

    def __init__(self) -> None:
        self.ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for layer, x in values.items():
            low, high = spread(x)
            if layer in self.ranges:
                low, high = torch.minimum(low, self.ranges[layer][0]), torch.maximum(high, self.ranges[layer][1])
            self.ranges[layer] = low, high

    def constant(self, layers: Sequence[str]) -> np.ndarray:
        return np.array([layer in self.ranges and is_constant(*self.ranges[layer]) for layer in layers], dtype=bool)


def minibatch_cka(
    a: Side,
    b: Side | None = None,
    *,
    batch_size: int = 1024,
    window: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> CKA:
    """Linear CKA between ``a``'s layers and ``b``'s (``a``'s own when ``b`` is None); rows are paired by position.
    A constant layer's row or column is NaN: its HSIC with itself is 0, and the ratio means nothing."""
    device = torch.device(device)
    if batch_size < 4:
        raise InvalidRequestError(
            f"--batch-size must be at least 4 (the unbiased estimator needs 4 samples), got {batch_size}"
        )
    same = b is None
    other = a if b is None else b
    cross = torch.zeros(len(a.layers), len(other.layers), dtype=torch.float64)
    self_a = torch.zeros(len(a.layers), dtype=torch.float64)
    self_b = torch.zeros(len(other.layers), dtype=torch.float64)
    spread_a, spread_b = _Spread(), _Spread()
    used = 0
    if window is None:
        window = default_window([a] if same else [a, other], a.features.chunk_size)
    for positions, batches in _minibatches(a.rows, a.features.chunk_size, batch_size, window, seed):
        values_a = a.read(positions)  # the whole window once: its chunks are read once per pass
        values_b = values_a if same else other.read(positions)
        spread_a.add(values_a)
        spread_b.add(values_b)
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
    matrix = (cross / (self_a[:, None] * self_b[None, :]).clamp_min(1e-300).sqrt()).numpy()
    constant_a, constant_b = spread_a.constant(a.layers), spread_b.constant(other.layers)
    matrix[constant_a, :] = np.nan
    matrix[:, constant_b] = np.nan
    constant = [*np.array(a.layers)[constant_a], *np.array(other.layers)[constant_b]]
    return CKA(a.layers, other.layers, matrix, used, "", constant=tuple(dict.fromkeys(constant)))


def parse_target(text: str) -> tuple[str, list[str] | None]:
    """``STORE`` or ``STORE:L1,L2`` (names or globs): the store is the first prefix that is a directory,
    or on object storage (``s3://bucket/x.zarr:L1``) a prefix holding objects, so layer names may
    themselves hold a colon (``blocks.0:0``)."""
    if _is_store(text):
        return text, None
    start = text.index("://") + 3 if is_url(text) else 0  # the scheme's colon is no layer list's
    for at in [i for i, c in enumerate(text) if c == ":" and i >= start]:
        if _is_store(text[:at]):
            layers = [name for name in text[at + 1 :].split(",") if name]
            return text[:at], layers or None
    raise ExtractError(f"{text}: no such store (write STORE or STORE:LAYER,LAYER)")


def _is_store(text: str) -> bool:
    """Whether ``text`` names a directory, or a URL a prefix with objects in it (one delimited listing)."""
    try:
        location = parse(text)
        if location.path is not None:
            return location.path.is_dir()
        return bool(objects.children(open_store(location, read_only=True), ""))
    except LocationError:  # not a store URL as a whole: perhaps a prefix of it is
        return False
    except ExtractError:
        raise
    except Exception as e:
        if not from_object_storage(e):
            raise
        raise ExtractError(f"{text}: cannot list it ({one_line(e)})") from None  # credentials, network


def side(features: Features, patterns: Sequence[str] | None, rows: np.ndarray, pool: str | None) -> Side:
    layers = select_layers(features.layers, patterns, store=features.path)
    return Side(features, layers, {layer: pool or default_pool(features, layer) for layer in layers}, rows)


def usable_cka(a: Side, b: Side | None = None, **options: Any) -> CKA:
    """``minibatch_cka``, leaving out each layer that cannot be read as asked (and saying so in the
    notes); fails only when a side has no layer left. Constant layers are noted too."""
    notes: list[str] = []
    skipped: dict[str, str] = {}
    while True:
        try:
            result = minibatch_cka(a, b, **options)
            break
        except UnusableLayerError as e:
            notes.append(e.note)
            skipped[e.layer] = e.reason
            if b is not None and e.store == b.features.path and e.layer in b.layers:
                b = b.without(e.layer)
            else:
                a = a.without(e.layer)
            if not a.layers or (b is not None and not b.layers):
                raise no_layer_left("compare", skipped) from None
    notes += [
        f"layer '{layer}' is constant (the same features for every sample: it does not depend on the input), "
        "so its CKA is undefined (NaN, drawn as 'constant')"
        for layer in result.constant
    ]
    return dataclasses.replace(result, notes=tuple(notes))


def compare(
    first: str,
    second: str | None = None,
    *,
    pool: str | None = None,
    match: str = "keys",
    batch_size: int = 1024,
    window: int | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> CKA:
    """CKA for ``python -m extract.compare FIRST [SECOND]`` (each ``STORE[:LAYERS]``); two stores'
    samples are paired by key, or by row with ``match="rows"``."""
    path_a, layers_a = parse_target(first)
    a = open_rows(path_a, "extract.compare")
    if second is None:
        rows_a = rows_b = np.flatnonzero(a.valid)
        matched, b = f"{len(rows_a)} samples of one store", None
    else:
        path_b, layers_b = parse_target(second)
        b = open_rows(path_b, "extract.compare")
        rows_a, rows_b, matched = shared_rows(a, b, match)
    if max_samples is not None and len(rows_a) > max_samples:
        keep = np.sort(np.random.default_rng((seed, 3)).choice(len(rows_a), max_samples, replace=False))
        rows_a, rows_b = rows_a[keep], rows_b[keep]
        matched += f", {max_samples} drawn at random"
    side_a = side(a, layers_a, rows_a, pool)
    side_b = None if b is None else side(b, layers_b, rows_b, pool)
    result = usable_cka(side_a, side_b, batch_size=batch_size, window=window, seed=seed, device=device)
    stores = {"row_store": str(a.path), "col_store": str(a.path if b is None else b.path)}
    return dataclasses.replace(result, matched=matched, **stores)


def format_matrix(cka: CKA) -> str:
    """The matrix as aligned text, rows and columns labelled with the layer names."""
    width = max(5, *(len(c) for c in cka.cols))
    head = max(len(r) for r in cka.rows)
    lines = [" " * head + "  " + "  ".join(c.rjust(width) for c in cka.cols)]
    for name, values in zip(cka.rows, cka.matrix, strict=True):
        lines.append(name.ljust(head) + "  " + "  ".join(_cell(v).rjust(width) for v in values))
    return "\n".join(lines)


def _cell(value: float) -> str:
    return "const" if np.isnan(value) else f"{value:.3f}"
