"""A layer's statistics computed where its rows are (a GPU), before the copy: the host then only merges.

The arithmetic is the store's (``extract.store.stats.chunk_row``, docs/store-format.md "Statistics"),
written with elementwise float32 operations only, in the same order: each block of ``BLOCK_ROWS`` rows
(aligned on the chunk's first row) is summed row after row, and a row's sum of squares is numpy's pairwise
summation spelled out (``pairwise_rows``). IEEE additions and multiplications round the same on every
device, so the blocks computed here are bit for bit those the host would compute: a chunk's row is the
same whichever blocks came from a device, whatever the batches and the number of processes.

Only whole blocks inside a batch's contiguous rows of a chunk are computed here; the host computes the
rest (blocks a batch boundary cuts, rows that are not contiguous, a chunk's short last block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..names.stats import BLOCK_ROWS, FLOAT16_MAX

PAIRWISE_LEAF = 128  # numpy's PW_BLOCKSIZE
UNROLL = 8


def pairwise_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``values`` (rows, n) float32, in the order numpy's ``pairwise_sum`` adds a
    contiguous float32 row (``np.add.reduce(values, axis=1)``): under 8 values one after the other from 0;
    up to 128, 8 running sums over strides of 8 combined as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)),
    then the rest one after the other; above, the two halves (the first a multiple of 8) summed apart."""
    rows, n = values.shape
    if n < UNROLL:
        total = torch.zeros(rows, dtype=values.dtype, device=values.device)
        for i in range(n):
            total = total + values[:, i]
        return total
    if n <= PAIRWISE_LEAF:
        whole = n - n % UNROLL
        r = values[:, :UNROLL]
        for i in range(UNROLL, whole, UNROLL):
            r = r + values[:, i : i + UNROLL]
        total = ((r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])) + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))
        for i in range(whole, n):
            total = total + values[:, i]
        return total
    half = n // 2
    half -= half % UNROLL
    if 2 * half == n:  # equal halves: both summed at once, as twice the rows (the same operations)
        both = pairwise_rows(values.reshape(rows * 2, half)).view(rows, 2)
        return both[:, 0] + both[:, 1]
    return pairwise_rows(values[:, :half]) + pairwise_rows(values[:, half:])


@dataclass
class BlockStats:
    """Statistics of whole blocks ``first_block``.. of a chunk's rows, on the device until ``numpy()``."""

    first_block: int
    sums: torch.Tensor  # (blocks, F) float32
    squares: torch.Tensor  # (blocks, F) float32
    norm_squared: torch.Tensor  # (blocks * BLOCK_ROWS,) float32, NaN for a row with a NaN
    peak: torch.Tensor  # (blocks,) float32: max |x| of the kept rows
    beyond: torch.Tensor  # (blocks,) int64: finite values with |x| > 65504
    infinite: torch.Tensor  # (blocks,) int64: ±inf values

    def numpy(self) -> dict[str, np.ndarray | int]:
        """On the host (one synchronization), as ``extract.store.stats.Partial.add`` takes them."""
        return {
            "first_block": self.first_block,
            **{name: getattr(self, name).cpu().numpy() for name in ("sums", "squares", "norm_squared", "peak")},
            "beyond": self.beyond.cpu().numpy(),
            "infinite": self.infinite.cpu().numpy(),
        }


def block_stats(rows: torch.Tensor, first_row: int) -> BlockStats | None:
    """The whole blocks among ``rows`` (m, F), values as stored, whose first is row ``first_row`` of its
    chunk; None when no whole block lies within them."""
    skip = -first_row % BLOCK_ROWS
    blocks = (len(rows) - skip) // BLOCK_ROWS
    if blocks <= 0:
        return None
    x = rows[skip : skip + blocks * BLOCK_ROWS].to(torch.float32)
    square = x * x
    norm_squared = pairwise_rows(square)
    nan = torch.isnan(norm_squared)[:, None]  # a row with a NaN is left out: its values count as +0.0
    x = torch.where(nan, 0.0, x)
    square = torch.where(nan, 0.0, square)
    shaped, squared = x.view(blocks, BLOCK_ROWS, -1), square.view(blocks, BLOCK_ROWS, -1)
    sums, squares = shaped[:, 0], squared[:, 0]
    for i in range(1, BLOCK_ROWS):  # row after row, as numpy reduces the middle axis
        sums = sums + shaped[:, i]
        squares = squares + squared[:, i]
    magnitude = shaped.abs()
    infinite = torch.isinf(magnitude).sum(dim=(1, 2))
    return BlockStats(
        first_block=(first_row + skip) // BLOCK_ROWS,
        sums=sums,
        squares=squares,
        norm_squared=norm_squared,
        peak=magnitude.amax(dim=(1, 2)),
        beyond=(magnitude > FLOAT16_MAX).sum(dim=(1, 2)) - infinite,
        infinite=infinite,
    )


def stored_rows(value: torch.Tensor, channel_axis: int | None) -> torch.Tensor:
    """A batch's values (samples, ...) as the rows its statistics describe: each sample's flattened row,
    or each position's channel vector (``channel_axis``, positions in C order)."""
    if channel_axis is None:
        return value.reshape(len(value), -1)
    return value.movedim(channel_axis, -1).reshape(-1, value.shape[channel_axis])
