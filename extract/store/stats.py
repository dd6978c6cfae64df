"""Per-chunk statistics of a layer, recorded when the chunk is written, and their merge.

``stats/<layer>`` is a (K, 5 + 2F) float64 array with one row per chunk (one object each, chunks of one
row): ``count``, ``sum_norm``, ``max_abs``, ``float16_overflow`` (finite values with |x| > 65504, float16's
largest: what float16 storage could not hold), ``infinite`` (±inf values), then ``sum`` (F,) and ``sumsq``
(F,) of the chunk's rows as stored (after the cast to the store's dtype; bfloat16 read as float32), each
row flattened to its F values. Stores written before the two counts have 3 + 2F columns (the array's
``columns`` attribute says where each statistic lies). ``FeatureStore.write_chunk``
writes the row before ``done[k]``, so a resume recomputes exactly the rows of the chunks it redoes and the
statistics always equal a recomputation from the stored data.

Layers whose stored row is 1-D have statistics of that row (text layers, pooled image layers). A layer
kept whole with a known layout (``NLC``/``NCL`` tokens, ``NCHW``/``NHWC`` maps: a ViT block, a conv
stage under ``--pool none``) has statistics of its positions' channel vectors: every (sample, patch)
is a row of its C channels, as ``TokenStream`` streams it (``F = C``; the array's ``channel_axis``
attribute says where the channels are). Whole rows, (C, H, W) flattened, would need 2 * C * H * W
values a chunk, as large as a few of its rows. A layer of another shape (no layout) has none.

A row with a NaN (an invalid sample, an empty document) is not counted. A row with an infinity (the
model's own: a cast that would make one stops the job) is counted, so its statistics are infinite, as the
stored data are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..names.stats import BLOCK_ROWS, FLOAT16_MAX
from .dtypes import count_infinite

STATS = "stats"  # the group of ``stats/<layer>`` arrays; stores written before statistics have none
HEAD = ("count", "sum_norm", "max_abs", "float16_overflow", "infinite")  # then sum (F,) and sumsq (F,)
# values converted to float32 at a time (512 KB): the two buffers stay in cache
SLAB_VALUES = 2**17


def channel_axis(shape: Sequence[int], layout: str | None) -> int | None:
    """The channel axis (of a chunk, sample axis first) of a layer stored as ``shape`` per row in
    ``layout`` whose statistics are per position; None for a 1-D row or a shape the layout does not fit."""
    if layout is None or len(shape) < 2 or len(layout) != len(shape) + 1:
        return None
    return layout.index("C")


def has_stats(shape: Sequence[int], layout: str | None = None) -> bool:
    """Whether a layer stored as ``shape`` per row (in ``layout``) gets statistics: 1-D rows, and
    positions' channel vectors of a layer whose layout is known."""
    return len(shape) == 1 or channel_axis(shape, layout) is not None


def row_features(shape: Sequence[int], layout: str | None = None) -> int:
    """F, the values a statistics row describes: the whole 1-D row, or one position's channels."""
    axis = channel_axis(shape, layout)
    return int(math.prod(shape)) if axis is None else int(shape[axis - 1])


def columns(features: int) -> dict[str, list[int]]:
    """Where each statistic lies in a row, as [start, stop): recorded as the array's ``columns``."""
    return {
        **{name: [i, i + 1] for i, name in enumerate(HEAD)},
        "sum": [len(HEAD), len(HEAD) + features],
        "sumsq": [len(HEAD) + features, len(HEAD) + 2 * features],
    }


def width(features: int) -> int:
    return len(HEAD) + 2 * features


def _as_float32(values: np.ndarray, bfloat16: bool, out: np.ndarray) -> np.ndarray:
    """``values`` (samples, ..., F) as float32 in ``out``, exactly: one pass through torch, whose half and
    bfloat16 conversions are vectorized (numpy's float16 cast is 12x slower here)."""
    import torch  # a job's writer has it loaded; reading statistics never comes here

    source = torch.from_numpy(values)
    if bfloat16:
        source = source.view(torch.bfloat16)
    torch.from_numpy(out).view(values.shape).copy_(source)
    return out


@dataclass
class Partial:
    """Whole blocks of a chunk's rows whose statistics were computed where the rows were (a GPU:
    ``extract.capture.block_stats``), bit for bit as ``chunk_row`` computes them; ``chunk_row`` computes
    only the slabs these do not cover."""

    blocks: int
    features: int
    sums: np.ndarray = field(init=False)
    squares: np.ndarray = field(init=False)
    norm_squared: np.ndarray = field(init=False)
    peak: np.ndarray = field(init=False)
    beyond: np.ndarray = field(init=False)
    infinite: np.ndarray = field(init=False)
    covered: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.sums = np.zeros((self.blocks, self.features), dtype=np.float32)
        self.squares = np.zeros_like(self.sums)
        self.norm_squared = np.zeros(self.blocks * BLOCK_ROWS, dtype=np.float32)
        self.peak = np.zeros(self.blocks, dtype=np.float32)
        self.beyond = np.zeros(self.blocks, dtype=np.int64)
        self.infinite = np.zeros(self.blocks, dtype=np.int64)
        self.covered = np.zeros(self.blocks, dtype=bool)

    def add(self, part: Mapping[str, np.ndarray | int]) -> None:
        """Blocks ``first_block``.. of a batch (``BlockStats.numpy()``)."""
        first = int(part["first_block"])  # type: ignore[arg-type]
        sums = np.asarray(part["sums"])
        at = slice(first, first + len(sums))
        self.sums[at], self.squares[at] = sums, part["squares"]
        self.norm_squared[first * BLOCK_ROWS : (first + len(sums)) * BLOCK_ROWS] = part["norm_squared"]
        self.peak[at], self.beyond[at], self.infinite[at] = part["peak"], part["beyond"], part["infinite"]
        self.covered[at] = True


def chunk_row(
    values: np.ndarray, channels: int | None = None, bfloat16: bool = False, partial: Partial | None = None
) -> np.ndarray:
    """The statistics row, (5 + 2F,) float64, of a chunk's ``values`` (samples, ...) as stored (bfloat16:
    its bits, ``bfloat16=True``): of each sample's flattened row, or with ``channels`` (the channel axis,
    ``channel_axis``) of each position's channel vector. The arithmetic, exactly (docs/store-format.md):

    - every value is taken as float32 (exact for float16, bfloat16 and float32); a row with a NaN is left
      out (its values count as +0.0 below);
    - the rows, in order, are cut in blocks of ``BLOCK_ROWS`` from the chunk's first (the last may be
      shorter); per block, ``sum`` and ``sumsq`` of each column are float32 sums in row order of x and of
      fl32(x * x); ``sum`` and ``sumsq`` are the float64 sums of the blocks' in block order, from 0;
    - a row's norm is sqrt, in float64, of numpy's float32 sum of its fl32(x * x) (``np.add.reduce``
      along the row: pairwise summation); ``sum_norm`` is the float64 sum of the kept rows' norms in
      row order, from 0 (``np.cumsum``);
    - ``max_abs``, ``count``, ``float16_overflow`` and ``infinite`` are exact.

    Every step is a fixed sequence of IEEE float32/float64 additions and multiplications over the chunk's
    values, so the row is the same for any batching and process count. The float32 block sums are within
    (BLOCK_ROWS - 1) * 2^-24 of the sum of |x| (of x^2) of the block from the exact ones. ``partial``:
    blocks computed on a device (the same bits); a slab all of whose blocks it covers is not computed here."""
    if channels is None:
        values, positions = values.reshape(len(values), -1), 1
    else:  # a view: each slab is moved into the float32 buffer, never the whole chunk copied
        values = np.moveaxis(values, channels, -1)
        positions = math.prod(values.shape[1:-1])
    features = values.shape[-1]
    rows = len(values) * positions
    row = np.zeros(width(features), dtype=np.float64)
    blocks = -(-rows // BLOCK_ROWS)
    block_sums = np.empty((blocks, features), dtype=np.float32)
    block_squares = np.empty((blocks, features), dtype=np.float32)
    norms = np.empty(rows, dtype=np.float64)
    kept = np.ones(rows, dtype=bool)
    # samples per slab: whole blocks of rows (but the chunk's last), about SLAB_VALUES values
    unit = BLOCK_ROWS // math.gcd(positions, BLOCK_ROWS)
    step = max(unit, SLAB_VALUES // max(1, features * positions) // unit * unit)
    slab_rows = min(step, len(values)) * positions
    buffer, square_buffer = np.empty((2, slab_rows, features), dtype=np.float32)
    peak, beyond, infinite = 0.0, 0, 0
    exact_squares = values.dtype == np.float16 or bfloat16  # 11 or 8 significant bits: x^2 fits float32's 24
    for start in range(0, len(values), step):
        stored = values[start : start + step]
        size = len(stored) * positions
        first = start * positions
        at = first // BLOCK_ROWS
        if partial is not None and size % BLOCK_ROWS == 0 and partial.covered[at : at + size // BLOCK_ROWS].all():
            span = slice(at, at + size // BLOCK_ROWS)  # computed on the device: taken as it is
            block_sums[span], block_squares[span] = partial.sums[span], partial.squares[span]
            norm_squared = partial.norm_squared[first : first + size]
            nan = np.isnan(norm_squared)
            if nan.any():
                kept[first : first + size] = ~nan
            np.sqrt(norm_squared.astype(np.float64), out=norms[first : first + size])
            peak = max(peak, float(partial.peak[span].max()))
            beyond += int(partial.beyond[span].sum()) + int(partial.infinite[span].sum())
            infinite += int(partial.infinite[span].sum())
            continue
        block = _as_float32(stored, bfloat16, buffer[:size])
        square = np.multiply(block, block, out=square_buffer[:size])
        norm_squared = np.add.reduce(square, axis=1)
        nan = np.isnan(norm_squared)  # NaN exactly where the row has a NaN (squares are never -inf + inf)
        if nan.any():
            block[nan], square[nan] = 0.0, 0.0
            kept[first : first + size] = ~nan
        np.sqrt(norm_squared.astype(np.float64), out=norms[first : first + size])
        if exact_squares:  # sqrt(max x^2) is max |x| exactly: the squares of these are exact in float32
            slab_peak = math.sqrt(float(square.max(initial=0.0)))
        if not exact_squares or slab_peak == math.inf:  # a square past float32's range: from x itself
            slab_peak = max(float(block.max(initial=0.0)), -float(block.min(initial=0.0)))
        if slab_peak > FLOAT16_MAX:  # rare: counted only then
            magnitude = np.abs(block)
            infinite += int(np.count_nonzero(magnitude == math.inf))
            beyond += int(np.count_nonzero(magnitude > FLOAT16_MAX))
        peak = max(peak, slab_peak)
        whole = size // BLOCK_ROWS * BLOCK_ROWS  # a slab is whole blocks, but for the chunk's last
        if whole:
            shaped = (whole // BLOCK_ROWS, BLOCK_ROWS, features)
            np.add.reduce(block[:whole].reshape(shaped), axis=1, out=block_sums[at : at + shaped[0]])
            np.add.reduce(square[:whole].reshape(shaped), axis=1, out=block_squares[at : at + shaped[0]])
        if whole < size:
            np.add.reduce(block[whole:size], axis=0, out=block_sums[-1])
            np.add.reduce(square[whole:size], axis=0, out=block_squares[-1])
    head, total, squares = row[: len(HEAD)], row[len(HEAD) : len(HEAD) + features], row[len(HEAD) + features :]
    if blocks:  # numpy reduces a leading axis row after row: ((s_0 + s_1) + s_2)...; + 0.0 makes it "from 0"
        np.add.reduce(block_sums, axis=0, dtype=np.float64, out=total)
        np.add.reduce(block_squares, axis=0, dtype=np.float64, out=squares)
        total += 0.0
        squares += 0.0
    count = int(np.count_nonzero(kept))
    kept_norms = norms if count == rows else norms[kept]
    sum_norm = float(np.cumsum(kept_norms)[-1]) if count else 0.0
    head[:] = count, sum_norm, peak if count else 0.0, beyond - infinite, infinite
    return row


def infinite(row: np.ndarray, values: np.ndarray) -> int:
    """The ±inf values of a chunk's ``values`` (host dtype: bfloat16 as bits) whose statistics are ``row``:
    the row's count where every row of the chunk was counted (no NaN); else counted on the values."""
    features = (len(row) - len(HEAD)) // 2
    if row[HEAD.index("count")] * features == values.size:
        return int(row[HEAD.index("infinite")])
    return count_infinite(values)


def merge(rows: np.ndarray, layout: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """The statistics of the rows of ``rows`` (one per chunk, laid out as ``layout`` says) together:
    ``count``, ``mean`` and ``std`` (population) of each value, ``mean_norm`` (the mean L2 norm of a row),
    ``max_abs``, ``float16_overflow`` and ``infinite`` (counts of values; None for a store written before
    them), and ``scaling_factor`` = sqrt(F) / mean_norm (SAELens's ``ActivationScaler``: the factor that
    makes a row's mean norm sqrt(F)). NaN where no row was counted."""

    def part(name: str) -> np.ndarray:
        start, stop = layout[name]
        return rows[:, start:stop]

    count = int(part("count").sum())
    features = int(np.prod(shape))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = part("sum").sum(axis=0) / count
        # E[x^2] - E[x]^2 in float64: the cancellation is far below float16/float32's resolution
        variance = np.maximum(part("sumsq").sum(axis=0) / count - np.square(mean), 0.0)
        mean_norm = float(part("sum_norm").sum()) / count if count else math.nan
    max_abs = float(part("max_abs").max()) if count else math.nan
    counts = {name: int(part(name).sum()) if name in layout else None for name in ("float16_overflow", "infinite")}
    return {
        "count": count,
        "mean": mean.reshape(shape),
        "std": np.sqrt(variance).reshape(shape),
        "mean_norm": mean_norm,
        "max_abs": max_abs,
        **counts,
        "scaling_factor": math.sqrt(features) / mean_norm if count and mean_norm > 0 else math.nan,
    }
