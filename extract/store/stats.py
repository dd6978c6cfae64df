"""Per-chunk statistics of a layer, recorded when the chunk is written, and their merge.

``stats/<layer>`` is a (K, 5 + 2F) float64 array with one row per chunk (one object each, chunks of one
row): ``count``, ``sum_norm``, ``max_abs``, ``float16_overflow`` (finite values with |x| > 65504, float16's
largest: what float16 storage could not hold), ``infinite`` (±inf values), then ``sum`` (F,) and ``sumsq``
(F,) of the chunk's rows as stored (after the cast to the store's dtype; bfloat16 read as float32), each
row flattened to its F values. Stores written before the two counts have 3 + 2F columns (the array's
``columns`` attribute says where each statistic lies). ``FeatureStore.write_chunk``
writes the row before ``done[k]``, so a resume recomputes exactly the rows of the chunks it redoes and the
statistics always equal a recomputation from the stored data.

Only layers whose stored row is 1-D have statistics (text layers, pooled image layers): an image layer
kept whole, (C, H, W), would need 2 * C * H * W values a chunk, as large as a few of its rows.

A row with a NaN (an invalid sample, an empty document) is not counted. A row with an infinity (the
model's own: a cast that would make one stops the job) is counted, so its statistics are infinite, as the
stored data are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

STATS = "stats"  # the group of ``stats/<layer>`` arrays; stores written before statistics have none
HEAD = ("count", "sum_norm", "max_abs", "float16_overflow", "infinite")  # then sum (F,) and sumsq (F,)
FLOAT16_MAX = 65504.0
# values converted to float64 at a time (1 MB): the two buffers stay in cache (2x faster than larger ones)
BLOCK_VALUES = 2**17


def has_stats(shape: Sequence[int]) -> bool:
    """Whether a layer stored as ``shape`` per row gets statistics: 1-D rows only."""
    return len(shape) == 1


def columns(features: int) -> dict[str, list[int]]:
    """Where each statistic lies in a row, as [start, stop): recorded as the array's ``columns``."""
    return {
        **{name: [i, i + 1] for i, name in enumerate(HEAD)},
        "sum": [len(HEAD), len(HEAD) + features],
        "sumsq": [len(HEAD) + features, len(HEAD) + 2 * features],
    }


def width(features: int) -> int:
    return len(HEAD) + 2 * features


def chunk_row(values: np.ndarray) -> np.ndarray:
    """The statistics row, (5 + 2F,) float64, of a chunk's ``values`` (rows, ...) as stored, in float64."""
    rows = values.reshape(len(values), -1)
    features = rows.shape[1]
    row = np.zeros(width(features), dtype=np.float64)
    total, squares = row[len(HEAD) : len(HEAD) + features], row[len(HEAD) + features :]
    # two float64 buffers reused block after block: fresh ones would page-fault on every block
    step = max(1, BLOCK_VALUES // max(1, features))
    block_buffer = np.empty((min(step, len(rows)), features), dtype=np.float64)
    square_buffer = np.empty_like(block_buffer)
    count, norms, peak, beyond, infinite = 0, 0.0, 0.0, 0, 0
    for start in range(0, len(rows), step):
        stored = rows[start : start + step]
        block, square = block_buffer[: len(stored)], square_buffer[: len(stored)]
        block[...] = stored  # the conversion to float64: exact
        np.multiply(block, block, out=square)
        norm_squared = square.sum(axis=1)  # NaN exactly where the row has a NaN (inf * inf stays inf)
        kept = ~np.isnan(norm_squared)
        if not kept.all():
            block, square, norm_squared = block[kept], square[kept], norm_squared[kept]
        if not len(block):
            continue
        count += len(block)
        norms += float(np.sqrt(norm_squared).sum())
        # max |x| = sqrt(max x^2): exact for float16 and float32 values (their squares are exact in float64)
        block_peak = float(square.max())
        peak = max(peak, math.sqrt(block_peak))
        if block_peak > FLOAT16_MAX**2:  # rare: counted only then (x^2 > 65504^2 exactly when |x| > 65504)
            infinite += int(np.count_nonzero(square == math.inf))  # no float32 value's square overflows float64
            beyond += int(np.count_nonzero(square > FLOAT16_MAX**2))
        total += block.sum(axis=0)
        squares += square.sum(axis=0)
    row[: len(HEAD)] = count, norms, peak, beyond - infinite, infinite
    return row


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
