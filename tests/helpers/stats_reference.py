"""The statistics row of a chunk, spelled out step by step from its contract (docs/store-format.md,
"Statistics"), independently of ``extract.store.stats``: loops over blocks and rows where the store's code
reduces whole slabs. The store's rows must equal these bit for bit; and the precision the contract
promises against float64 sums (``BOUND``) is what tests hold numpy's float64 recomputation to."""

from __future__ import annotations

import math

import numpy as np

BLOCK_ROWS = 16  # the contract's block of rows summed in float32
# a float32 block sum of at most 16 terms is within 15 * 2^-24 of the sum of the terms' magnitudes
BOUND = (BLOCK_ROWS - 1) * 2.0**-24


def chunk_rows(values: np.ndarray, channel_axis: int | None = None) -> np.ndarray:
    """The chunk's rows as float32 (samples, ...) -> (rows, F): each sample's flattened row, or each
    position's channel vector (positions in C order)."""
    if channel_axis is not None:
        values = np.moveaxis(values, channel_axis, -1)
    features = values.shape[-1] if channel_axis is not None else math.prod(values.shape[1:])
    return np.asarray(values, dtype=np.float32).reshape(-1, features)


def reference_row(values: np.ndarray, channel_axis: int | None = None) -> np.ndarray:
    """(5 + 2F,) float64: count, sum_norm, max_abs, float16_overflow, infinite, sum (F,), sumsq (F,)."""
    rows = chunk_rows(values, channel_axis)
    features = rows.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        nan_rows = np.isnan(rows).any(axis=1)
        kept = rows[~nan_rows]
        total, squares = np.zeros(features), np.zeros(features)
        for first in range(0, len(rows), BLOCK_ROWS):
            block_sum, block_squares = np.zeros(features, np.float32), np.zeros(features, np.float32)
            started = False
            for i in range(first, min(first + BLOCK_ROWS, len(rows))):
                x = np.where(nan_rows[i], np.float32(0), rows[i])  # a row with a NaN adds +0.0
                if not started:  # a float32 sum in row order from the block's first row
                    block_sum, block_squares, started = x.copy(), x * x, True
                else:
                    block_sum = block_sum + x
                    block_squares = block_squares + x * x
            total = total + block_sum.astype(np.float64)  # float64 in block order, from 0
            squares = squares + block_squares.astype(np.float64)
        sum_norm = 0.0
        for row in kept:  # sqrt (float64) of the row's float32 sum of squares (numpy's sum of a 1-D row)
            sum_norm += math.sqrt(float(np.sum(row * row, dtype=np.float32)))
        magnitude = np.abs(kept)
        head = [
            len(kept),
            sum_norm,
            float(magnitude.max()) if len(kept) else 0.0,
            int(np.count_nonzero(np.isfinite(kept) & (magnitude > 65504))),
            int(np.count_nonzero(np.isinf(kept))),
        ]
    return np.concatenate([np.array(head, dtype=np.float64), total, squares])
